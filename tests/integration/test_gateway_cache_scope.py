"""The response cache against a scriptable engine (tests/integration/mockengine.py):
whom an entry is shared with (issue 9, item 1) and which answers are complete enough to
store and replay (item 2). Real nginx and Redis; the mock logs every request and puts a
unique nonce in every completion, so "the engine computed this" is told from "the cache
replayed that"."""

from __future__ import annotations

import http.client
import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _wait, make_policy, wait_cached
from mockengine import Behaviour, MockEngine, start_mock_engines


@pytest.fixture(scope="module")
def mocked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One mock engine + Redis + gateway, shared by the module (tests reset both)."""
    base = tmp_path_factory.mktemp("cache-scope")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        mocks = start_mock_engines(1, prefix="m")
        stack.callback(lambda: [m.stop() for m in mocks])
        gw = _start_gateway(base, make_policy(mocks, redis), mocks, redis)
        stack.callback(gw.stop)
        yield gw


@pytest.fixture
def gw(mocked: Gateway) -> Gateway:
    """The shared gateway with an empty cache and a mock back at its default behaviour."""
    mocked.redis.client().flushdb()
    mock = engine(mocked)
    mock.clear()
    mock.default = Behaviour()
    return mocked


def engine(gw: Gateway) -> MockEngine:
    return gw.sims[0]


def body(content: str, stream: bool = False, endpoint: str = "chat") -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 8}
    if endpoint == "chat":
        b["messages"] = [{"role": "user", "content": content}]
    else:
        b["prompt"] = content
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


def post(gw: Gateway, payload: dict, headers: dict | None = None, endpoint: str = "chat") -> requests.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return requests.post(gw.url + path, json=payload, headers=headers or {}, timeout=15)


def sse_events(r: requests.Response) -> list[dict]:
    text = r.text
    assert text.rstrip().endswith("data: [DONE]"), text
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def streamed(events: list[dict], field: str) -> str:
    return "".join((c.get("delta") or {}).get(field) or "" for ev in events for c in ev["choices"])


def answer_text(r: requests.Response) -> str:
    if r.headers["Content-Type"].startswith("text/event-stream"):
        return streamed(sse_events(r), "content")
    return r.json()["choices"][0]["message"]["content"]


def resp_keys(gw: Gateway) -> list[bytes]:
    return list(gw.redis.client().scan_iter("kvgate:resp:*"))


def skipped(gw: Gateway, reason: str) -> float:
    return gw.metric_sum("kvgate_cache_store_skipped_total", reason=reason)


def wait_skipped(gw: Gateway, reason: str, above: float) -> None:
    """The log phase runs after the client has its answer: wait (bounded) for the count."""
    _wait(lambda: skipped(gw, reason) > above, 3.0, f"kvgate_cache_store_skipped_total{{reason={reason!r}}}")


def redis_text(gw: Gateway) -> str:
    """Every key and value in Redis, as text (strings, lists, hashes, sets, zsets, streams)."""
    r = gw.redis.client()
    out: list[str] = []
    for key in r.scan_iter("*"):
        out.append(key.decode(errors="replace"))
        kind = r.type(key).decode()
        if kind == "string":
            out.append(repr(r.get(key)))
        elif kind == "list":
            out.append(repr(r.lrange(key, 0, -1)))
        elif kind == "hash":
            out.append(repr(r.hgetall(key)))
        elif kind == "set":
            out.append(repr(r.smembers(key)))
        elif kind == "zset":
            out.append(repr(r.zrange(key, 0, -1)))
        elif kind == "stream":
            out.append(repr(r.xrange(key)))
    return "\n".join(out)


def gateway_logs(gw: Gateway) -> str:
    logs = Path(gw.nginx.prefix) / "logs"
    return "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))


# --------------------------------------------------------------------------- item 1: scope
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_callers_with_different_credentials_never_share_an_entry(gw: Gateway, stream: bool) -> None:
    secret_a, secret_b = "sk-alpha-7f3a9c2e", "sk-bravo-0d1e5b44"
    callers = {"A": {"Authorization": f"Bearer {secret_a}"}, "B": {"Authorization": f"Bearer {secret_b}"},
               "none": {}}
    payload = body("Who am I talking to?", stream=stream)
    first: dict[str, str] = {}
    for n, (name, headers) in enumerate(callers.items(), start=1):
        r = post(gw, payload, headers)
        assert r.status_code == 200, r.text
        assert r.headers["X-Kvgate-Cache"] == "MISS", name
        first[name] = answer_text(r)
        wait_cached(gw, n)
    mock = engine(gw)
    assert len(mock.completions()) == 3
    assert len(set(mock.nonces)) == 3
    assert len(resp_keys(gw)) == 3
    # each caller's answer is the one the engine computed for it
    for name, nonce in zip(callers, mock.nonces):
        assert nonce in first[name]
    # each caller's repeat is its own HIT, with its own nonce
    for name, headers in callers.items():
        r = post(gw, payload, headers)
        assert r.status_code == 200
        assert r.headers["X-Kvgate-Cache"] == "HIT", name
        assert answer_text(r) == first[name]
    assert len(mock.completions()) == 3
    # the credential itself is nowhere but on the wire to the engine: only a digest of it
    # went into the (hashed) key material
    stored, logs = redis_text(gw), gateway_logs(gw)
    for secret in (secret_a, secret_b):
        assert secret not in stored
        assert secret not in logs


def test_a_query_string_credential_scopes_the_entry(gw: Gateway) -> None:
    # nginx forwards the query string to the engine, which (or a proxy before it) may read a
    # key there: callers with different query strings, or none, never share an entry
    payload = body("Who asks by query string?")
    urls = {q: gw.url + "/v1/chat/completions" + q for q in ("?api_key=A", "?api_key=B", "")}
    first = {}
    for n, (q, url) in enumerate(urls.items(), start=1):
        r = requests.post(url, json=payload, timeout=15)
        assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS", (q, r.text)
        first[q] = answer_text(r)
        wait_cached(gw, n)
    assert len(set(engine(gw).nonces)) == 3 and len(resp_keys(gw)) == 3
    for q, url in urls.items():
        r = requests.post(url, json=payload, timeout=15)
        assert r.headers["X-Kvgate-Cache"] == "HIT" and answer_text(r) == first[q], q
    assert "api_key=A" not in redis_text(gw)


def post_raw(gw: Gateway, payload: dict, pairs: list[tuple[str, str]]) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/chat/completions with exactly these headers, a repeated name sent as many times as
    listed (requests keeps only the last value of a repeated name). -> (status, headers, body)."""
    u = urlsplit(gw.url)
    data = json.dumps(payload).encode()
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=15)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        for k, v in pairs:
            conn.putheader(k, v)
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


API_KEY_HEADERS = ["api-key", "X-Api-Key"]


@pytest.mark.parametrize("header", API_KEY_HEADERS)
def test_an_api_key_callers_entry_is_served_to_no_one_else(gw: Gateway, header: str) -> None:
    # an engine or proxy that takes the key in api-key (Azure-style clients) or X-Api-Key
    other = API_KEY_HEADERS[1 - API_KEY_HEADERS.index(header)]
    k1, k2 = "azure-key-one-5c1e9a", "azure-key-two-73bd02"
    callers = {"k1": {header: k1}, "none": {}, "k2": {header: k2}, "k1 in the other header": {other: k1}}
    payload = body(f"keyed by {header}")
    first: dict[str, str] = {}
    for n, (name, headers) in enumerate(callers.items(), start=1):
        r = post(gw, payload, headers)
        assert r.status_code == 200, r.text
        assert r.headers["X-Kvgate-Cache"] == "MISS", name
        first[name] = answer_text(r)
        wait_cached(gw, n)
    mock = engine(gw)
    assert len(mock.completions()) == 4 and len(set(mock.nonces)) == 4
    assert len(resp_keys(gw)) == 4
    for name, headers in callers.items():
        r = post(gw, payload, headers)
        assert r.headers["X-Kvgate-Cache"] == "HIT", name
        assert answer_text(r) == first[name], name
    assert len(mock.completions()) == 4
    stored, logs = redis_text(gw), gateway_logs(gw)
    for secret in (k1, k2):
        assert secret not in stored and secret not in logs


def test_a_caller_sending_authorization_and_api_key_is_scoped_by_both(gw: Gateway) -> None:
    callers = {
        "A+K": {"Authorization": "Bearer a", "api-key": "k"},
        "A": {"Authorization": "Bearer a"},
        "K": {"api-key": "k"},
        "A+K2": {"Authorization": "Bearer a", "api-key": "k2"},
        "A2+K": {"Authorization": "Bearer a2", "api-key": "k"},
        "A+K+X": {"Authorization": "Bearer a", "api-key": "k", "X-Api-Key": "k"},
    }
    payload = body("two credentials at once")
    for n, (name, headers) in enumerate(callers.items(), start=1):
        r = post(gw, payload, headers)
        assert r.status_code == 200, r.text
        assert r.headers["X-Kvgate-Cache"] == "MISS", name
        wait_cached(gw, n)
    for name, headers in callers.items():
        assert post(gw, payload, headers).headers["X-Kvgate-Cache"] == "HIT", name
    assert len(engine(gw).completions()) == len(callers)


@pytest.mark.parametrize("header", API_KEY_HEADERS)
def test_every_value_of_a_repeated_credential_header_counts(gw: Gateway, header: str) -> None:
    payload = body(f"{header} sent twice")
    sends = [[(header, "k1")], [(header, "k1"), (header, "k2")], [(header, "k2"), (header, "k1")]]
    for n, pairs in enumerate(sends, start=1):
        status, headers, text = post_raw(gw, payload, pairs)
        assert status == 200, text
        # a value behind the first is another credential (the engine may read either)
        assert headers["x-kvgate-cache"] == "MISS", pairs
        wait_cached(gw, n)
    for pairs in sends:
        assert post_raw(gw, payload, pairs)[1]["x-kvgate-cache"] == "HIT", pairs
    assert len(engine(gw).completions()) == len(sends)


def test_nginx_refuses_a_repeated_authorization_header(gw: Gateway) -> None:
    # nginx 1.22 itself answers 400 to a second Authorization header (before any Lua runs),
    # so only the other credential headers can carry several values to the engine
    one, two = "Bearer sk-first-4e0c1b", "Bearer sk-second-9a7d35"
    status, headers, text = post_raw(gw, body("two authorization headers"),
                                     [("Authorization", one), ("Authorization", two)])
    assert status == 400, text
    assert headers["content-type"].startswith("application/json")
    assert json.loads(text)["error"]["type"] == "invalid_request_error"
    assert engine(gw).completions() == []
    assert resp_keys(gw) == []
    # nginx names the duplicate line at `info`, below the gateway's error_log level
    logs = gateway_logs(gw)
    assert one not in logs and two not in logs


def test_an_engine_api_key_is_not_bypassed_by_a_cached_answer(start_mocks, start_redis, start_gateway) -> None:
    (mock,) = start_mocks(1, prefix="k", api_key="right-key")
    gw = start_gateway([mock], start_redis())
    payload = body("only for key holders")
    good = {"Authorization": "Bearer right-key"}
    r = post(gw, payload, good)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    for headers in ({"Authorization": "Bearer wrong-key"}, {}):
        r = post(gw, payload, headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["X-Kvgate-Cache"] == "MISS"
    r = post(gw, payload, good)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "HIT"
    assert len(mock.completions()) == 3
    assert len(resp_keys(gw)) == 1


def test_the_policy_names_the_credential_headers(start_mocks, start_redis, start_gateway) -> None:
    (mock,) = start_mocks(1, prefix="h")
    # names are case-insensitive: the policy's spelling need not be the client's
    gw = start_gateway([mock], start_redis(), cache={"credential_headers": ["X-API-Key"]})
    payload = body("keyed by x-api-key only")
    assert post(gw, payload, {"x-api-key": "k1"}).headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    assert post(gw, payload, {"X-Api-Key": "k2"}).headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 2)
    # the listed headers replace the default list: Authorization and api-key are not read
    hit = {"X-Api-Key": "k1", "Authorization": "Bearer z", "api-key": "z"}
    assert post(gw, payload, hit).headers["X-Kvgate-Cache"] == "HIT"
    assert len(mock.completions()) == 2


# --------------------------------------------------------------------------- item 2: what is stored
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_answer_without_finish_reason_is_served_not_stored(gw: Gateway, stream: bool, endpoint: str) -> None:
    engine(gw).set(finish_reason=None)
    payload = body("unfinished business", stream=stream, endpoint=endpoint)
    before = skipped(gw, "unfinished")
    r = post(gw, payload, endpoint=endpoint)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"usage"' in r.text
    wait_skipped(gw, "unfinished", before)
    assert resp_keys(gw) == []
    r = post(gw, payload, endpoint=endpoint)
    assert r.headers["X-Kvgate-Cache"] == "MISS"
    assert len(engine(gw).completions()) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_answer_without_choices_is_served_not_stored(gw: Gateway, stream: bool) -> None:
    engine(gw).set(choices=0)
    payload = body("nothing to choose", stream=stream)
    before = skipped(gw, "no-choices")
    r = post(gw, payload)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    if not stream:
        assert r.json()["choices"] == []
    wait_skipped(gw, "no-choices", before)
    assert resp_keys(gw) == []
    assert post(gw, payload).headers["X-Kvgate-Cache"] == "MISS"
    assert len(engine(gw).completions()) == 2


def test_an_answer_whose_choices_all_finished_is_stored(gw: Gateway) -> None:
    # n=2, both finished (one unfinished choice among finished ones: tests/lua/test_sse.lua)
    engine(gw).set(choices=2)
    payload = {**body("two choices"), "n": 2}
    assert post(gw, payload).headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    assert post(gw, payload).headers["X-Kvgate-Cache"] == "HIT"


REASONING = "First, think about the question: 2 + 2 is 4."


@pytest.mark.parametrize("stored_as", ["json", "sse"])
@pytest.mark.parametrize("replayed_as", ["json", "sse"])
def test_replays_keep_the_reasoning(gw: Gateway, stored_as: str, replayed_as: str) -> None:
    engine(gw).set(reasoning=REASONING)
    content = f"reasoning {stored_as} to {replayed_as}"
    first = post(gw, body(content, stream=stored_as == "sse"))
    assert first.status_code == 200 and first.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    hit = post(gw, body(content, stream=replayed_as == "sse"))
    assert hit.headers["X-Kvgate-Cache"] == "HIT"
    if replayed_as == "sse":
        events = sse_events(hit)
        assert streamed(events, "reasoning_content") == REASONING
        assert streamed(events, "reasoning") == REASONING
        assert streamed(events, "content") == answer_text(first)
    else:
        msg = hit.json()["choices"][0]["message"]
        assert msg["reasoning_content"] == REASONING
        assert msg["reasoning"] == REASONING
        assert msg["content"] == answer_text(first)
    assert len(engine(gw).completions()) == 1
