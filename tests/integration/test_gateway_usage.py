"""The gateway's usage record (issue 13): through real nginx, Redis and the engine simulator, a
non-stream answer, a stream whose client did not ask for usage, and a response-cache hit each
leave the right tokens, TTFT, block hashes, cost and savings (integer nano-dollars) in the
request log (``kvgate:log``), the usage counters agree with the log, and the engine's own
token counters agree with both."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import requests
from kvgate import keys

from gwfixtures import MODEL, Gateway, _wait, wait_cached

# $ per 1M tokens -> n$ per token: 2.0 -> 2000, 0.2 -> 200, 6.0 -> 6000
PRICES = {"input_usd_per_1m_tokens": 2.0, "cached_input_usd_per_1m_tokens": 0.2, "output_usd_per_1m_tokens": 6.0,
          "batch_discount": 0.5}
P_IN, P_CACHED, P_OUT = 2000, 200, 6000
CHUNK = 2048  # the pool's prefix_index.chunk_chars (default)
SYSTEM = {"role": "system", "content": "You summarise rivers. " + "The Rhine flows north. " * 200}


def _entries(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange(keys.LOG_STREAM)]


def _wait_entries(gw: Gateway, n: int) -> list[dict[str, str]]:
    _wait(lambda: len(_entries(gw)) >= n, 10, f"{n} request-log entries")
    return _entries(gw)


def _canonical_len(messages: list[dict]) -> int:
    # kvgate.prompt.canonical of a chat without tools: RS role US content per message
    return sum(2 + len(m["role"].encode()) + len(m["content"].encode()) for m in messages)


def _normalized(text: str) -> str:
    return re.sub(r'"created": ?\d+', '"created": 0', re.sub(r'"id": ?"[^"]+"', '"id": "x"', text))


def _check_money(e: dict[str, str]) -> None:
    p, cached, c = int(e["prompt"]), int(e["cached"]), int(e["completion"])
    if e["cache"] == "HIT":
        assert (e["cost"], e["saved_prefix"], e["saved_batch"]) == ("0", "0", "0")
        assert int(e["saved_cache"]) == p * P_IN + c * P_OUT
    else:
        assert int(e["cost"]) == (p - cached) * P_IN + cached * P_CACHED + c * P_OUT
        assert int(e["saved_prefix"]) == cached * (P_IN - P_CACHED)
        assert (e["saved_cache"], e["saved_batch"]) == ("0", "0")


def test_usage_of_a_miss_a_stripped_stream_and_a_hit(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(1, prefix="u")
    gw = start_gateway(sims, start_redis(), pool={"prices": PRICES})
    before = sims[0].metrics()
    messages = [SYSTEM, {"role": "user", "content": "The Rhine?"}]
    t0 = time.time()
    miss = gw.chat(messages, max_tokens=3, temperature=0)
    assert miss.status_code == 200 and miss.headers["X-Kvgate-Cache"] == "MISS"
    u_miss = miss.json()["usage"]
    wait_cached(gw)
    hit = gw.chat(messages, max_tokens=3, temperature=0)
    assert hit.headers["X-Kvgate-Cache"] == "HIT"
    # a stream whose client did not ask for usage: the gateway asks, strips, and still counts
    body = {"max_tokens": 5, "stream": True, "temperature": 0, "seed": 3}
    turn2 = messages + [{"role": "assistant", "content": "North."}, {"role": "user", "content": "And then?"}]
    stream = gw.chat(turn2, headers={"Cache-Control": "no-store"}, **body)
    direct = requests.post(sims[0].url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": turn2, **body})
    assert stream.status_code == direct.status_code == 200
    assert '"usage"' not in stream.text and stream.text.endswith("data: [DONE]\n\n")
    assert _normalized(stream.text) == _normalized(direct.text), "the stream the client asked for, byte for byte"

    entries = _wait_entries(gw, 3)
    assert len(entries) == 3
    # (two workers flush in their own order) the stream is no-store: BYPASS
    by = {e["cache"]: e for e in entries}
    e_miss, e_hit, e_stream = by["MISS"], by["HIT"], by["BYPASS"]
    for e in entries:
        assert set(e) == set(keys.LOG_FIELDS)
        assert (e["model"], e["key_id"], e["batch"], e["tenant"]) == (MODEL, "", "", "")
    # the miss: the engine's own usage, its TTFT
    assert int(e_miss["prompt"]) == u_miss["prompt_tokens"]
    assert int(e_miss["completion"]) == u_miss["completion_tokens"]
    assert int(e_miss["cached"]) == (u_miss.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert 0 <= int(e_miss["ttft"]) <= int(e_miss["ms"])
    assert abs(float(e_miss["ts"]) - t0) < 5
    _check_money(e_miss)
    # the hit: the tokens it avoided, from the cached answer; no engine, no TTFT
    assert (e_hit["prompt"], e_hit["completion"], e_hit["cached"]) == (e_miss["prompt"], e_miss["completion"], "0")
    assert e_hit["ttft"] == "" and e_hit["node"] == "cache"
    _check_money(e_hit)
    assert int(e_hit["saved_cache"]) > 0
    # the stream: tokens from the usage chunk the client never saw; its prompt's start was cached
    assert int(e_stream["completion"]) == 5
    assert int(e_stream["prompt"]) > int(e_miss["prompt"])
    assert int(e_stream["cached"]) > 0, "the engine's prefix cache held the system prompt"
    assert e_stream["ttft"] != "" and int(e_stream["ttft"]) <= int(e_stream["ms"])
    _check_money(e_stream)
    # block hashes: 16 hex digits per full chunk of the canonical prompt; a later turn shares the first
    assert len(e_miss["blocks"]) == 16 * (_canonical_len(messages) // CHUNK) > 0
    assert re.fullmatch(r"[0-9a-f]+", e_miss["blocks"])
    assert e_hit["blocks"] == e_miss["blocks"]
    assert len(e_stream["blocks"]) == 16 * (_canonical_len(turn2) // CHUNK)
    assert e_stream["blocks"].startswith(e_miss["blocks"][:16 * (len(e_miss["blocks"]) // 16 - 1)])

    # the counters agree with the log, and the engine's counters with both
    computed = [e_miss, e_stream]
    gw.wait_metric("kvgate_tokens_total", sum(int(e["prompt"]) for e in computed), kind="prompt", pool="default",
                   tenant="none")
    gw.wait_metric("kvgate_tokens_total", sum(int(e["cached"]) for e in computed), kind="cached")
    gw.wait_metric("kvgate_tokens_total", sum(int(e["completion"]) for e in computed), kind="completion")
    gw.wait_metric("kvgate_tokens_avoided_total", int(e_hit["prompt"]), kind="prompt")
    gw.wait_metric("kvgate_tokens_avoided_total", int(e_hit["completion"]), kind="completion")
    cost = gw.metric_sum("kvgate_cost_usd_total", pool="default")
    assert abs(cost - sum(int(e["cost"]) for e in computed) / 1e9) < 1e-12
    saved_cache = gw.metric_sum("kvgate_saved_usd_total", lever="cache")
    assert abs(saved_cache - int(e_hit["saved_cache"]) / 1e9) < 1e-12
    saved_prefix = gw.metric_sum("kvgate_saved_usd_total", lever="prefix")
    assert abs(saved_prefix - sum(int(e["saved_prefix"]) for e in computed) / 1e9) < 1e-12
    after = sims[0].metrics()
    engine_prompt = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0)
    engine_cached = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    # the direct request (not through the gateway) is the stream's twin
    assert engine_prompt == int(e_miss["prompt"]) + 2 * int(e_stream["prompt"])
    assert engine_cached >= int(e_miss["cached"]) + int(e_stream["cached"])


def test_no_prices_no_cost(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(1, prefix="v"), start_redis(), cache={"enabled": False})
    r = gw.chat("short", max_tokens=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and '"prompt_tokens"' in r.text, "a client that asked keeps its usage chunk"
    (e,) = _wait_entries(gw, 1)
    assert int(e["prompt"]) > 0 and int(e["completion"]) == 2
    assert (e["cost"], e["saved_cache"], e["saved_prefix"], e["saved_batch"]) == ("", "", "", "")
    assert e["blocks"] == "", "no full chunk of prompt"
    assert gw.metric_sum("kvgate_cost_usd_total") == 0


def _blocks_direct(messages: list[dict], pool: str) -> str:
    """kvgate.usage.blocks computed in plain luajit from the messages (no balancer's chain)."""
    lua = ('package.path = "./lua/?.lua;" .. package.path; package.loaded["kvgate.redis"] = {}; '
           '_G.ngx = {shared = {}, log = function() end}; local cjson = require "cjson"; '
           'local req = cjson.decode(io.read("*a")); '
           f'io.write(require("kvgate.usage").blocks(req, "chat", "{pool}", {CHUNK}, 64))')
    out = subprocess.run(["luajit", "-e", lua], input=json.dumps({"model": MODEL, "messages": messages}),
                         capture_output=True, text=True, timeout=10, check=True, cwd=Path(__file__).parents[2])
    return out.stdout


def test_the_prefix_balancers_chain_is_the_logged_one(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(2, prefix="w"), start_redis(), balancer="prefix", cache={"enabled": False})
    messages = [SYSTEM, {"role": "user", "content": "The Elbe?"}]
    assert gw.chat(messages, max_tokens=2).status_code == 200
    (e,) = _wait_entries(gw, 1)
    assert e["blocks"] == _blocks_direct(messages, "default") != ""


def test_a_stream_with_stream_options_not_asking_for_usage_is_billed(start_sims, start_redis, start_gateway) -> None:
    """stream_options {}, {"include_usage": false} or null: the gateway asks the engine for usage
    anyway (rewriting the member in place) and strips it on the way back, so the stream is
    billed and the client gets no usage chunk it did not ask for."""
    gw = start_gateway(start_sims(1, prefix="w"), start_redis(), pool={"prices": PRICES}, cache={"enabled": False})
    for i, so in enumerate(({}, {"include_usage": False}, None)):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"options {i}"}], "max_tokens": 3,
                "stream": True, "stream_options": so}
        r = requests.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        assert '"prompt_tokens"' not in r.text, f"{so!r}: a usage chunk the client did not ask for"
    entries = _wait_entries(gw, 3)
    for e in entries:
        assert int(e["prompt"]) > 0 and int(e["completion"]) == 3, e
        _check_money(e)
