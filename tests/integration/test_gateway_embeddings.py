"""``/v1/embeddings`` at the gateway (issue 14 item 1): routed like chat to the pool serving the
model, exact-cached by default (an embedding is deterministic) with the tenant's scope and the
cache TTL, usage into the request log (completion 0), and the simulator's answer in OpenAI's
shape. Real nginx, Redis and engine simulators; tenants and keys from the control plane's store."""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _start_sims, _stop_all, _wait, make_policy, \
    sims_total, wait_cached
from kvgate import keys
from kvgate.control.apikeys import ApiKeys
from kvgate.control.store import Store
from kvgate.policy.loader import parse_policy

pytestmark = pytest.mark.integration

TTL_S = 120
PRICES = {"input_usd_per_1m_tokens": 0.1, "cached_input_usd_per_1m_tokens": 0.1, "output_usd_per_1m_tokens": 0.0}


@pytest.fixture(scope="module")
def egw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, str]]]:
    """3 simulators, Redis, a gateway with two tenants (auth required); yields it and a key per tenant."""
    base = tmp_path_factory.mktemp("embed")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(3, base)
        stack.callback(_stop_all, sims)
        data = make_policy(sims, redis, cache={"ttl_s": TTL_S}, pool={"prices": PRICES}).model_dump(mode="json")
        data["gateway"]["auth"] = "required"
        data["tenants"] = [{"id": "t1"}, {"id": "t2"}]
        gw = _start_gateway(base, parse_policy(data, "embed-policy"), sims, redis)
        stack.callback(gw.stop)
        api = ApiKeys(Store(redis.url))
        yield gw, {t: api.create(t, "embed")[1] for t in ("t1", "t2")}


def embed(gw: Gateway, key: str, **body) -> requests.Response:
    return requests.post(gw.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


def entries(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange(keys.LOG_STREAM)]


def test_an_embedding_is_routed_cached_per_tenant_and_logged(egw):
    gw, key = egw
    assert gw.redis is not None
    client = gw.redis.client()
    for k in client.scan_iter("kvgate:resp:*"):
        client.delete(k)  # (the keys stay)
    n = len(entries(gw))
    before = sims_total(gw.sims, "vllm:prompt_tokens_total")
    text = "The Rhine flows north into the sea."
    miss = embed(gw, key["t1"], input=text)
    assert miss.status_code == 200, miss.text
    assert miss.headers["X-Kvgate-Cache"] == "MISS" and miss.headers["X-Kvgate-Route-Key-Kind"] == "prefix"
    body = miss.json()
    assert body["object"] == "list" and body["model"] == MODEL
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0 and len(item["embedding"]) == 384
    assert math.isclose(math.fsum(x * x for x in item["embedding"]), 1.0, rel_tol=1e-9)
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    node = miss.headers["X-Kvgate-Node"]
    # the engine computed it: its prompt tokens count
    _wait(lambda: sims_total(gw.sims, "vllm:prompt_tokens_total") == before + usage["prompt_tokens"], 5,
          "the engines' prompt tokens")

    (entry_key,) = wait_cached(gw)
    assert 0 < gw.redis.client().ttl(entry_key) <= TTL_S
    hit = embed(gw, key["t1"], input=text)
    assert hit.headers["X-Kvgate-Cache"] == "HIT" and hit.json() == body
    # the same input of another tenant: its own scope, a miss computed by an engine again
    other = embed(gw, key["t2"], input=text)
    assert other.headers["X-Kvgate-Cache"] == "MISS"
    assert other.headers["X-Kvgate-Node"] == node  # the same prefix: the same node
    assert other.json()["data"] == body["data"]     # (and the engine is deterministic)

    _wait(lambda: len(entries(gw)) >= n + 3, 10, "3 request-log entries")
    # (each worker flushes its own entries: the stream's order is not the requests')
    logged = sorted(entries(gw)[n:], key=lambda e: (e["tenant"], e["cache"] != "MISS"))
    assert [(e["tenant"], e["cache"]) for e in logged] == [("t1", "MISS"), ("t1", "HIT"), ("t2", "MISS")]
    for e in logged:
        assert (int(e["prompt"]), e["completion"], e["model"]) == (usage["prompt_tokens"], "0", MODEL)
    p_in = 100  # n$ per token
    assert int(logged[0]["cost"]) == usage["prompt_tokens"] * p_in
    assert (logged[1]["cost"], int(logged[1]["saved_cache"])) == ("0", usage["prompt_tokens"] * p_in)


def test_input_forms_and_options_pass_and_are_cached_apart(egw):
    gw, key = egw
    forms = [["first text", "second text"], [1, 2, 3, 4], [[1, 2], [3, 4, 5]]]
    for form in forms:
        r = embed(gw, key["t1"], input=form, encoding_format="float")
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == (1 if isinstance(form[0], int) else len(form))
    small = embed(gw, key["t1"], input="dims", dimensions=8)
    assert small.status_code == 200 and len(small.json()["data"][0]["embedding"]) == 8
    b64 = embed(gw, key["t1"], input="dims", encoding_format="base64")
    assert b64.headers["X-Kvgate-Cache"] == "MISS" and isinstance(b64.json()["data"][0]["embedding"], str)


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [1, "a"]}, 400, "input[1]"),
    ({"input": [[1], []]}, 400, "input[1]"),
    ({"input": {"a": 1}}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "stream": True}, 400, "stream"),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
def test_bad_bodies_are_refused_before_any_engine(egw, body, status, param):
    gw, key = egw
    before = sims_total(gw.sims, "vllm:request_success_total")
    r = embed(gw, key["t1"], **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert sims_total(gw.sims, "vllm:request_success_total") == before


def test_no_key_no_embedding(egw):
    gw, _ = egw
    r = requests.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
