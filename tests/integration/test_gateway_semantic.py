"""The semantic cache at the gateway (lua/kvgate/semantic.lua, issue 15): real nginx, Redis and
simulators; the service is the protocol's stand-in (fakesemantic.py), so what the gateway sends
(scope, text, eligibility) and what it does with each answer (replay, fail open) is checked on
its own. The real service's own tests: tests/integration/test_semantic_service.py."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from fakesemantic import FakeSemantic
from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _start_sims, _stop_all, make_policy, wait_cached
from kvgate.control.apikeys import ApiKeys
from kvgate.control.store import Store
from kvgate.policy.loader import parse_policy

pytestmark = pytest.mark.integration

SUCCESS = "vllm:request_success_total"
SEMANTIC = {"enabled": True, "similarity_min": 0.85, "timeout_ms": 50, "max_temperature": 0.7}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, FakeSemantic, ApiKeys]]:
    base = tmp_path_factory.mktemp("semantic")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(2, base)
        stack.callback(_stop_all, sims)
        fake = FakeSemantic()
        stack.callback(fake.stop)
        data = make_policy(sims, redis, pool={"semantic": SEMANTIC},
                           top={"semantic_service": {"listen": fake.listen}}).model_dump(mode="json")
        data["gateway"].update({"auth": "optional", "auth_cache_ttl_s": 1})
        data["tenants"] = [{"id": "default"}, {"id": "t1"}, {"id": "t2"}]
        gw = _start_gateway(base, parse_policy(data, "semantic-policy"), sims, redis)
        stack.callback(gw.stop)
        yield gw, fake, ApiKeys(Store(redis.url))


@pytest.fixture
def env(setup) -> tuple[Gateway, FakeSemantic, ApiKeys]:
    gw, fake, keys = setup
    gw.redis.client().flushdb()
    fake.reset()
    if fake.server is None:
        fake.start()
    return gw, fake, keys


def engine_requests(gw: Gateway) -> float:
    return sum(s.metrics().get(SUCCESS, 0.0) for s in gw.sims)


def ask(gw: Gateway, messages, *, headers=None, **params) -> requests.Response:
    if isinstance(messages, str):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": messages}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 6, **params}
    return requests.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def seed(gw: Gateway, fake: FakeSemantic, question, n: int = 1, **kw) -> requests.Response:
    r = ask(gw, question, **kw)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS", (r.status_code, r.headers, r.text)
    fake.wait_inserts(n)
    return r


def sse_text(r: requests.Response) -> str:
    out = ""
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices") or []:
                out += (ch.get("delta") or {}).get("content") or ""
    return out


def test_a_paraphrase_is_answered_from_the_cache_json_and_sse(env) -> None:
    gw, fake, _ = env
    first = seed(gw, fake, "What is the capital of France?")
    ins = fake.entries[0]
    assert ins["text"] == "What is the capital of France?" and ins["pool"] == "default"
    assert ins["entry"].startswith("kvgate:resp:") and gw.redis.client().exists(ins["entry"])
    assert len(ins["scope"]) == 64 and ins["ttl_s"] == 3600
    before = engine_requests(gw)
    hit = ask(gw, "what's the capital of France")
    assert hit.status_code == 200, hit.text
    assert hit.headers["X-Kvgate-Cache"] == "SEMANTIC"
    sim = hit.headers["X-Kvgate-Similarity"]
    assert len(sim.split(".")[1]) == 3 and 0.85 <= float(sim) < 1
    assert hit.headers["X-Kvgate-Node"] == "cache"
    assert hit.json() == first.json(), "the cached answer, replayed exactly"
    stream = ask(gw, "What's the capital of France?", stream=True)
    assert stream.status_code == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
    assert stream.headers["X-Kvgate-Cache"] == "SEMANTIC"
    assert sse_text(stream) == first.json()["choices"][0]["message"]["content"]
    assert stream.text.rstrip().endswith("data: [DONE]")
    time.sleep(0.2)
    assert engine_requests(gw) == before, "no engine touched"
    assert gw.wait_metric("kvgate_semantic_lookups_total", 2, pool="default", result="semantic")
    assert gw.metric_sum("kvgate_semantic_lookup_seconds_count", pool="default") >= 3
    # a semantic hit is logged and priced as a cache hit (the request log: cache SEMANTIC)
    gw.wait_metric("kvgate_requests_total", 2, cache="SEMANTIC")


def test_guard_rejection_and_unrelated_question_are_misses(env) -> None:
    gw, fake, _ = env
    seed(gw, fake, "What is 17 times 23?")
    other = ask(gw, "What is 17 times 24?")
    assert other.headers["X-Kvgate-Cache"] == "MISS"
    unrelated = ask(gw, "Tell me a joke about penguins")
    assert unrelated.headers["X-Kvgate-Cache"] == "MISS"
    gw.wait_metric("kvgate_semantic_guard_rejections_total", 1, pool="default", guard="number")
    assert gw.metric_sum("kvgate_semantic_lookups_total", result="rejected") >= 1
    # a guard name the gateway does not know (another service version) is counted as "other":
    # the label set stays bounded whatever the service sends
    for i, name in enumerate(("tone-v2", "x" * 200, 'bad"label\n{')):
        fake.reject_as = name
        assert ask(gw, f"What is 17 times {30 + i}?").headers["X-Kvgate-Cache"] == "MISS"
    gw.wait_metric("kvgate_semantic_guard_rejections_total", 3, pool="default", guard="other")
    assert gw.metric_sum("kvgate_semantic_guard_rejections_total", pool="default") == 4


def test_another_tenants_paraphrase_is_a_miss(env) -> None:
    gw, fake, keys = env
    _, s1 = keys.create("t1")
    _, s2 = keys.create("t2")
    seed(gw, fake, "How do I reset my password?", headers={"Authorization": f"Bearer {s1}"})
    mine = ask(gw, "how can I reset my password", headers={"Authorization": f"Bearer {s1}"})
    assert mine.headers["X-Kvgate-Cache"] == "SEMANTIC"
    theirs = ask(gw, "how can I reset my password", headers={"Authorization": f"Bearer {s2}"})
    assert theirs.headers["X-Kvgate-Cache"] == "MISS"
    scopes = {c["scope"] for c in fake.calls("/lookup")}
    assert len(scopes) == 2


def test_a_follow_up_in_another_conversation_is_a_miss(env) -> None:
    gw, fake, _ = env
    a = [{"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": "Paris is big."},
         {"role": "user", "content": "What is its population?"}]
    b = [{"role": "user", "content": "Tell me about Lyon."}, {"role": "assistant", "content": "Lyon is nice."},
         {"role": "user", "content": "What is its population?"}]
    seed(gw, fake, a)
    assert ask(gw, b).headers["X-Kvgate-Cache"] == "MISS"
    # the same conversation, the question reworded: a hit
    a2 = a[:2] + [{"role": "user", "content": "what's its population"}]
    assert ask(gw, a2).headers["X-Kvgate-Cache"] == "SEMANTIC"
    # a different system prompt is another scope too
    sys = [{"role": "system", "content": "Answer in French."}] + a2
    assert ask(gw, sys).headers["X-Kvgate-Cache"] == "MISS"


def test_no_store_high_temperature_and_images_never_ask(env) -> None:
    gw, fake, _ = env
    seed(gw, fake, "Which rivers cross Germany?")
    n = len(fake.calls("/lookup"))
    r = ask(gw, "which rivers cross germany", headers={"Cache-Control": "no-store"})
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS"
    r = ask(gw, "which rivers cross germany", temperature=1.0, seed=3)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    img = [{"role": "user", "content": [{"type": "text", "text": "which rivers cross germany"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    r = ask(gw, img)
    assert r.headers["X-Kvgate-Cache"] != "SEMANTIC"
    assert len(fake.calls("/lookup")) == n, "none of them asked the service"
    time.sleep(0.3)
    # the high-temperature answer is cached exactly but never offered to the semantic cache
    assert len(fake.entries) == 1


def test_a_last_message_over_max_question_bytes_is_neither_asked_nor_stored(env) -> None:
    # the model reads 256 tokens: a pasted document (the trace's and the multi-turn chat's turns)
    # would only be refused for its length after an embedding, so the gateway does not ask
    gw, fake, _ = env
    n = len(fake.calls("/lookup"))
    long_q = "Summarise this report for me. " + "The quarter went well for the northern region. " * 44
    assert len(long_q.encode()) > 2048
    r = ask(gw, long_q)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    gw.wait_metric("kvgate_semantic_lookups_total", 1, pool="default", result="long")
    again = ask(gw, long_q)
    assert again.headers["X-Kvgate-Cache"] == "HIT", "the exact cache still answers it"
    time.sleep(0.3)
    assert len(fake.calls("/lookup")) == n and fake.entries == []
    # at the limit it is asked as before
    seed(gw, fake, long_q[:2048])
    assert len(fake.calls("/lookup")) == n + 1


def test_the_service_slow_or_down_is_a_miss_within_the_timeout(env) -> None:
    gw, fake, _ = env
    seed(gw, fake, "What is the boiling point of water?")
    # the service answers after 0.5 s; the gateway waits 50 ms
    fake.delay_s = 0.5
    t0 = time.monotonic()
    r = ask(gw, "what's the boiling point of water", max_tokens=1)
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    assert took < 0.4, took
    gw.wait_metric("kvgate_semantic_lookups_total", 1, pool="default", result="timeout")
    fake.delay_s = 0
    fake.stop()
    for i in range(3):
        r = ask(gw, f"what's the boiling point of water, {'really ' * i}", max_tokens=1)
        assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS"
    gw.wait_metric("kvgate_semantic_lookups_total", 3, pool="default", result="error")


def test_tags_are_filed_with_the_entry_and_sent_with_the_insert(env) -> None:
    gw, fake, _ = env
    seed(gw, fake, "What does the refund policy say?", headers={"X-Kvgate-Cache-Tags": "doc-7, faq ,bad tag!"})
    entry = fake.entries[0]
    assert entry["tags"] == ["doc-7", "faq"]
    r = gw.redis.client()
    assert r.smembers("kvgate:tag:doc-7") == {entry["entry"].encode()}
    assert 0 < r.ttl("kvgate:tag:faq") <= 3600
    # an untagged entry is in no set
    seed(gw, fake, "Where is the head office?", n=2)
    assert r.scard("kvgate:tag:doc-7") == 1
    wait_cached(gw, 2)
