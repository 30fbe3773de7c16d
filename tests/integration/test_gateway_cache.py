"""The exact response cache in Redis, through the real gateway and simulators."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest
import requests

from gwfixtures import MODEL, Gateway, sims_total, wait_cached

PROMPT_TOKENS = "vllm:prompt_tokens_total"


def _ask(gw: Gateway, content: str, **params) -> requests.Response:
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 4)
    return gw.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], **params)


def test_miss_then_hit_without_touching_an_engine(fleet_clean: Gateway) -> None:
    first = _ask(fleet_clean, "What is the capital of France?")
    assert first.status_code == 200 and first.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    before = sims_total(fleet_clean.sims, PROMPT_TOKENS)
    second = _ask(fleet_clean, "What is the capital of France?")
    assert second.status_code == 200
    assert second.headers["X-Kvgate-Cache"] == "HIT"
    assert second.headers["X-Kvgate-Node"] == "cache"
    assert second.json() == first.json()
    assert sims_total(fleet_clean.sims, PROMPT_TOKENS) == before
    assert fleet_clean.metric_sum("kvgate_requests_total", cache="HIT") >= 1


@pytest.mark.parametrize("change", [
    {"temperature": 0.7, "seed": 7},
    {"top_p": 0.5},
    {"max_tokens": 5},
    {"seed": 123},
    {"stop": ["\n"]},
    {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5},
    {"logit_bias": {"42": -5}},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
], ids=lambda c: "+".join(c))
def test_any_parameter_change_is_a_miss(fleet_clean: Gateway, change: dict) -> None:
    assert _ask(fleet_clean, "Name three rivers.").headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    assert _ask(fleet_clean, "Name three rivers.").headers["X-Kvgate-Cache"] == "HIT"
    changed = _ask(fleet_clean, "Name three rivers.", **change)
    assert changed.status_code == 200, changed.text
    assert changed.headers["X-Kvgate-Cache"] == "MISS"


def test_reordered_json_keys_hit(fleet_clean: Gateway) -> None:
    a = ('{"model":"%s","temperature":0,"max_tokens":3,"messages":[{"role":"user","content":"order?"}],'
         '"response_format":{"type":"text"}}' % MODEL)
    b = ('{"response_format":{"type":"text"},"messages":[{"content":"order?","role":"user"}],'
         '"max_tokens":3,"temperature":0.0,"model":"%s"}' % MODEL)
    url = fleet_clean.url + "/v1/chat/completions"
    h = {"Content-Type": "application/json"}
    assert requests.post(url, data=a, headers=h, timeout=10).headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    assert requests.post(url, data=b, headers=h, timeout=10).headers["X-Kvgate-Cache"] == "HIT"


def test_non_deterministic_and_no_store_bypass(fleet_clean: Gateway) -> None:
    r = _ask(fleet_clean, "random please", temperature=0.9)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS"
    r = _ask(fleet_clean, "no store please", headers={"Cache-Control": "no-store"})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS"
    time.sleep(0.3)
    assert list(fleet_clean.redis.client().scan_iter("kvgate:resp:*")) == []


def test_stream_is_stored_then_served_as_sse_and_as_json(fleet_clean: Gateway) -> None:
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Stream me a short answer."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["X-Kvgate-Cache"] == "MISS"
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text
    wait_cached(fleet_clean, 1)

    before = sims_total(fleet_clean.sims, PROMPT_TOKENS)
    # stream_options is transport only: the same entry answers with or without it
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["X-Kvgate-Cache"] == "HIT"
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6)
    assert raw.headers["X-Kvgate-Cache"] == "HIT"
    completion = raw.parse()
    assert completion.choices[0].message.content == text
    assert completion.choices[0].finish_reason == "length"
    assert sims_total(fleet_clean.sims, PROMPT_TOKENS) == before


def test_json_stored_then_served_as_sse(fleet_clean: Gateway) -> None:
    first = _ask(fleet_clean, "json first, stream later")
    assert first.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=4, stream=True,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "json first, stream later"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == first.json()["choices"][0]["message"]["content"]


def _raw_post(gw: Gateway, body: bytes, extra_headers: bytes = b"") -> socket.socket:
    host, port = gw.listen.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\n" + extra_headers +
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _read_all(s: socket.socket) -> tuple[bytes, bytes]:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    head, _, payload = got.partition(b"\r\n\r\n")
    return head, payload


def test_aborted_stream_is_not_cached(fleet_clean: Gateway) -> None:
    # include_usage: the same stream, completed, is stored (proven below), so only the
    # abort can keep this one out of the cache
    body = json.dumps({"model": MODEL, "temperature": 0, "max_tokens": 60, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "a long story, then hang up"}]}).encode()
    stores = fleet_clean.metric_sum("kvgate_cache_stores_total")
    with _raw_post(fleet_clean, body) as s:
        got = b""
        while b"data:" not in got:
            got += s.recv(4096)
        assert b"X-Kvgate-Cache: MISS" in got
    # the whole generation would take ~0.6 s; give the gateway time to finish the request
    time.sleep(1.5)
    assert list(fleet_clean.redis.client().scan_iter("kvgate:resp:*")) == []
    assert fleet_clean.metric_sum("kvgate_cache_stores_total") == stores

    # the same request read to the end is stored
    with _raw_post(fleet_clean, body) as s:
        head, payload = _read_all(s)
    assert b"X-Kvgate-Cache: MISS" in head
    assert b"data: [DONE]" in payload and b'"usage"' in payload
    wait_cached(fleet_clean, 1)
    assert fleet_clean.metric_sum("kvgate_cache_stores_total") == stores + 1


def test_cached_json_replayed_as_sse_has_no_empty_objects_for_lists(fleet_clean: Gateway) -> None:
    # lua-cjson decodes [] and {} alike: a hit must not turn a list into {}
    first = _ask(fleet_clean, "plain answer, no tools")
    assert first.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    body = json.dumps({"model": MODEL, "temperature": 0, "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "plain answer, no tools"}]}).encode()
    with _raw_post(fleet_clean, body) as s:
        head, payload = _read_all(s)
    assert b"X-Kvgate-Cache: HIT" in head
    text = payload.decode()
    assert '"tool_calls":{}' not in text and '"tool_calls"' not in text, text
    assert '"choices":[]' in text and "data: [DONE]" in text
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    for ev in events:
        assert isinstance(ev["choices"], list)
        for c in ev["choices"]:
            assert not isinstance(c.get("logprobs"), dict) or all(
                isinstance(v, list) or v is None for v in c["logprobs"].values()), c


def test_no_store_in_a_second_cache_control_header_bypasses(fleet_clean: Gateway) -> None:
    # $http_cache_control would hold only the first header
    body = json.dumps({"model": MODEL, "temperature": 0, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "two cache-control headers"}]}).encode()
    with _raw_post(fleet_clean, body, b"Cache-Control: max-age=0\r\nCache-Control: no-store\r\n") as s:
        head, _ = _read_all(s)
    assert head.startswith(b"HTTP/1.1 200")
    assert b"X-Kvgate-Cache: BYPASS" in head
    assert b"X-Kvgate-Cache-Reason: no-store" in head
    with _raw_post(fleet_clean, body, b"Cache-Control: max-age=0\r\nCache-Control: no-cache\r\n") as s:
        head, _ = _read_all(s)
    assert b"X-Kvgate-Cache: MISS" in head


def test_response_over_max_entry_bytes_is_served_and_counted(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(1, prefix="t"), start_redis(), cache={"max_entry_bytes": 1024})
    before = gw.metric_sum("kvgate_cache_store_skipped_total", reason="too-large")
    r = _ask(gw, "a long answer please", max_tokens=200)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    assert len(r.content) > 1024
    time.sleep(0.3)
    assert list(gw.redis.client().scan_iter("kvgate:resp:*")) == []
    assert gw.metric_sum("kvgate_cache_store_skipped_total", reason="too-large") == before + 1


def test_redis_down_bypasses_and_serves(start_sims, start_redis, start_gateway) -> None:
    redis = start_redis()
    gw = start_gateway(start_sims(1, prefix="c"), redis)
    assert _ask(gw, "cache me").headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    redis.stop()
    for _ in range(3):
        r = _ask(gw, "cache me")
        assert r.status_code == 200, r.text
        assert r.headers["X-Kvgate-Cache"] == "BYPASS"
    assert gw.metric_sum("kvgate_cache_errors_total") >= 1
    log = (gw.nginx.prefix / "logs/error.log").read_text()
    assert log.count("kvgate cache get failed") == 1


def test_cache_disabled_bypasses(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(1, prefix="x"), start_redis(), cache={"enabled": False})
    for _ in range(2):
        assert _ask(gw, "no cache here").headers["X-Kvgate-Cache"] == "BYPASS"


def test_stream_without_usage_is_not_stored_so_hits_always_carry_usage(fleet_clean: Gateway) -> None:
    messages = [{"role": "user", "content": "no usage requested"}]
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=5, stream=True) if c.choices)
    assert text
    time.sleep(0.5)
    assert list(fleet_clean.redis.client().scan_iter("kvgate:resp:*")) == []
    assert fleet_clean.metric_sum("kvgate_cache_store_skipped_total", reason="no-usage") >= 1
    # the JSON answer is stored and then serves both kinds of client with usage
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=5)
    assert first.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(fleet_clean, 1)
    hit = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                           max_tokens=5)
    assert hit.headers["X-Kvgate-Cache"] == "HIT"
    assert hit.parse().usage.completion_tokens == 5
    assert hit.parse().choices[0].message.content == text


def test_seed_beyond_double_precision_is_not_cached(fleet_clean: Gateway) -> None:
    big = 2 ** 53
    for seed in (big, big + 1):
        r = _ask(fleet_clean, "seeded", temperature=0.9, seed=seed)
        assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS", r.headers
    ok = _ask(fleet_clean, "seeded", temperature=0.9, seed=big - 1)
    assert ok.headers["X-Kvgate-Cache"] == "MISS"


def test_repeated_session_header_with_a_bad_value_is_rejected(fleet_clean: Gateway) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with _raw_post(fleet_clean, body, b"X-Session-Id: good\r\nX-Session-Id: " + b"x" * 300 + b"\r\n") as s:
        head, payload = _read_all(s)
    assert head.startswith(b"HTTP/1.1 400")
    assert b'"code":"invalid_session_id"' in payload


def test_no_store_behind_many_headers_still_bypasses(fleet_clean: Gateway) -> None:
    filler = {f"X-Filler-{i}": "1" for i in range(120)}
    r = _ask(fleet_clean, "hidden no-store", headers={**filler, "Cache-Control": "no-store"})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS"
    time.sleep(0.3)
    assert list(fleet_clean.redis.client().scan_iter("kvgate:resp:*")) == []


def test_no_cache_skips_the_lookup_and_refreshes_the_entry(fleet_clean: Gateway) -> None:
    assert _ask(fleet_clean, "fresh please").headers["X-Kvgate-Cache"] == "MISS"
    (key,) = wait_cached(fleet_clean, 1)
    client = fleet_clean.redis.client()
    client.set(key, client.get(key), ex=5)  # shorten the TTL: the refresh must reset it
    before = sims_total(fleet_clean.sims, PROMPT_TOKENS)
    r = _ask(fleet_clean, "fresh please", headers={"Cache-Control": "no-cache"})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    assert r.headers["X-Kvgate-Cache-Reason"] == "no-cache"
    assert sims_total(fleet_clean.sims, PROMPT_TOKENS) > before  # a node answered
    deadline = time.monotonic() + 3
    while client.ttl(key) <= 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.ttl(key) > 5
    assert _ask(fleet_clean, "fresh please").headers["X-Kvgate-Cache"] == "HIT"
