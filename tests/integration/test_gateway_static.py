"""Static answers at the gateway (lua/kvgate/semantic.lua, issue 15): an FAQ question answered by
the gateway in OpenAI's chat.completion shape (JSON and SSE), X-Kvgate-Cache: STATIC, no engine
touched; only for a single user turn. Real nginx, Redis and simulators; the service is the
protocol's stand-in (fakesemantic.py)."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from typing import Iterator

import openai
import pytest
import requests

from fakesemantic import FakeSemantic
from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _start_sims, _stop_all, make_policy, wait_cached

pytestmark = pytest.mark.integration

SUCCESS = "vllm:request_success_total"
ANSWER = "You can pay by card, bank transfer or PayPal. " + "We also take gift cards at the till. " * 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, FakeSemantic]]:
    base = tmp_path_factory.mktemp("static")
    faq = base / "faq.yaml"
    faq.write_text(f"answers:\n  - questions: [What payment methods do you support?]\n    answer: {ANSWER}\n")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(1, base)
        stack.callback(_stop_all, sims)
        fake = FakeSemantic()
        stack.callback(fake.stop)
        # static answers only: the semantic cache stays off
        policy = make_policy(sims, redis, pool={"semantic": {"static_answers": str(faq), "similarity_min": 0.8}},
                             top={"semantic_service": {"listen": fake.listen}})
        gw = _start_gateway(base, policy, sims, redis)
        stack.callback(gw.stop)
        yield gw, fake


@pytest.fixture
def env(setup) -> tuple[Gateway, FakeSemantic]:
    gw, fake = setup
    gw.redis.client().flushdb()
    fake.reset()
    fake.static["What payment methods do you support?"] = ANSWER
    return gw, fake


def engine_requests(gw: Gateway) -> float:
    return sum(s.metrics().get(SUCCESS, 0.0) for s in gw.sims)


def ask(gw: Gateway, messages, **params) -> requests.Response:
    if isinstance(messages, str):
        messages = [{"role": "system", "content": "You are the shop's assistant."},
                    {"role": "user", "content": messages}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 6, **params}
    return requests.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def test_a_faq_question_and_its_paraphrase_are_static_json_and_sse(env) -> None:
    gw, fake = env
    before = engine_requests(gw)
    r = ask(gw, "What payment methods do you support?")
    assert r.status_code == 200, r.text
    assert r.headers["X-Kvgate-Cache"] == "STATIC"
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ANSWER},
                                "finish_reason": "stop", "logprobs": None}]
    u = body["usage"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    para = ask(gw, "what payment methods do you support")
    assert para.headers["X-Kvgate-Cache"] == "STATIC" and float(para.headers["X-Kvgate-Similarity"]) >= 0.8
    s = ask(gw, "Which payment methods do you support?", stream=True, stream_options={"include_usage": True})
    assert s.status_code == 200 and s.headers["Content-Type"].startswith("text/event-stream")
    assert s.headers["X-Kvgate-Cache"] == "STATIC"
    events = [json.loads(line[6:]) for line in s.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
    assert text == ANSWER
    assert events[-1]["usage"]["completion_tokens"] == u["completion_tokens"]
    # the OpenAI SDK takes it as any answer
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                         messages=[{"role": "user", "content": "What payment methods do you support?"}])
    assert out.choices[0].message.content == ANSWER
    time.sleep(0.2)
    assert engine_requests(gw) == before, "no engine touched"
    gw.wait_metric("kvgate_semantic_lookups_total", 4, pool="default", result="static")
    gw.wait_metric("kvgate_requests_total", 4, cache="STATIC")
    # the tokens the static answers avoided (the log phase reads them from the built answer)
    assert gw.metric_sum("kvgate_tokens_avoided_total", kind="completion") >= 4 * u["completion_tokens"]
    # static answers are never offered to the semantic cache (it is off in this pool) nor stored
    assert not fake.calls("/insert")
    assert all(c["static"] is True and c["semantic"] is False for c in fake.calls("/lookup"))


def test_a_follow_up_never_gets_a_static_answer(env) -> None:
    gw, fake = env
    convo = [{"role": "user", "content": "I have a question about my order."},
             {"role": "assistant", "content": "Sure, go ahead."},
             {"role": "user", "content": "What payment methods do you support?"}]
    r = ask(gw, convo)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    assert fake.calls("/lookup")[-1]["static"] is False


def test_an_unrelated_question_goes_to_an_engine(env) -> None:
    gw, _ = env
    before = engine_requests(gw)
    r = ask(gw, "Where is my parcel number 4411?")
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    time.sleep(0.2)
    assert engine_requests(gw) == before + 1


def _resp_keys(gw: Gateway) -> list[bytes]:
    return list(gw.redis.client().scan_iter("kvgate:resp:*"))


def test_an_engine_answer_never_shadows_a_static_one(env) -> None:
    """A FAQ question whose static lookup did not run (Cache-Control: no-cache) or failed (the
    service down) goes to an engine, and that answer is served but not stored: stored, the exact
    cache would answer the same question with it for cache.ttl_s, before the static lookup."""
    gw, fake = env
    q = "What payment methods do you support?"
    # no-cache: no lookup at all (the client asked for a fresh answer)
    r = requests.post(gw.url + "/v1/chat/completions", timeout=30, headers={"Cache-Control": "no-cache"},
                      json={"model": MODEL, "temperature": 0, "max_tokens": 6,
                            "messages": [{"role": "system", "content": "You are the shop's assistant."},
                                         {"role": "user", "content": q}]})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS", r.headers
    assert not fake.calls("/lookup")
    # the service down: the lookup fails open (a MISS), and nothing is stored either
    fake.stop()
    try:
        r = ask(gw, q)
        assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    finally:
        fake.start()
    gw.wait_metric("kvgate_cache_store_skipped_total", 2, reason="static-unchecked")
    time.sleep(0.6)  # past the cache's write timer
    assert not _resp_keys(gw)
    # the service back: the same question gets the operator's answer, not the engine's
    r = ask(gw, q)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "STATIC"
    assert r.json()["choices"][0]["message"]["content"] == ANSWER
    # a question the static lookup ran for and missed is stored as before
    r = ask(gw, "Where is my parcel number 4411?")
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    r = ask(gw, "Where is my parcel number 4411?")
    assert r.headers["X-Kvgate-Cache"] == "HIT"
    # a follow-up can never get a static answer: stored even without a lookup
    convo = [{"role": "user", "content": "I have a question about my order."},
             {"role": "assistant", "content": "Sure, go ahead."},
             {"role": "user", "content": q}]
    r = requests.post(gw.url + "/v1/chat/completions", timeout=30, headers={"Cache-Control": "no-cache"},
                      json={"model": MODEL, "temperature": 0, "max_tokens": 6, "messages": convo})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 2)
