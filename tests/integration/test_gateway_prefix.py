"""The prefix balancer in the real gateway (nginx + Lua, 4 engine simulators with real prefix
caches, Redis), its `prefix_chars` left at the default 2,048 bytes, inside the tests' shared
6 KB system prompt (with chash every request would have one key). Two conversations sharing
the system prompt land where the longest match is, whatever their session keys say, and hit
there; a hot-prefix workload (every request one system prompt, arriving together) spreads with
no node computing more than 1.3 x the mean prefill while the system prompt still hits. One
stack for the module."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from gwfixtures import Gateway, _start_gateway, _start_redis, _start_sims, _wait, make_policy
from oracles.ring import key_point, pool_ring

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CHUNK = 512


def _words(seed: int, n: int) -> str:
    # one word = one simulator token; distinct per seed
    return " ".join(f"w{seed}x{i}" for i in range(n))


SYSTEM = _words(0, 800)  # ~6.5 KB, 800 tokens


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("prefix")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(4, base, prefix="p")
        for s in sims:
            stack.callback(s.stop)
        policy = make_policy(sims, redis, balancer="prefix",
                             pool={"prefix_index": {"chunk_chars": CHUNK}, "saturated_queue": None})
        g = _start_gateway(base, policy, sims, redis)
        stack.callback(g.stop)
        yield g


def _reset(gw: Gateway) -> None:
    for s in gw.sims:
        requests.post(s.url + "/reset_prefix_cache", timeout=5).raise_for_status()
    assert gw.redis is not None
    gw.redis.client().flushdb()


def _counters(gw: Gateway) -> dict[str, tuple[float, float]]:
    out = {}
    for s in gw.sims:
        m = s.metrics()
        out[s.node_id] = (m.get(QUERIES, 0.0), m.get(HITS, 0.0))
    return out


def _conversation(user: str, turns: list[tuple[str, str]] = ()) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    for answer, question in turns:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return msgs


def test_conversations_sharing_a_system_prompt_land_by_longest_match(gw: Gateway) -> None:
    # the gateway's index starts from nothing in this module: a fresh dict, fresh caches
    _reset(gw)
    ring = pool_ring(gw.policy, "default")
    # two sessions whose ring homes differ
    sa = "conv-a"
    sb = next(f"conv-b{i}" for i in range(100) if ring.home(key_point(f"s:conv-b{i}")) != ring.home(key_point("s:" + sa)))
    home_a = ring.home(key_point("s:" + sa))
    a1 = gw.chat(_conversation(_words(1, 300)), max_tokens=2, headers={"X-Session-Id": sa})
    assert a1.status_code == 200, a1.text
    # nothing held anywhere: the session's node
    assert a1.headers["X-Kvgate-Node"] == home_a
    before = _counters(gw)
    # conversation b: its session hashes elsewhere, but only home_a holds the system prompt
    b1 = gw.chat(_conversation(_words(2, 300)), max_tokens=2, headers={"X-Session-Id": sb})
    assert b1.status_code == 200, b1.text
    assert b1.headers["X-Kvgate-Node"] == home_a
    after = _counters(gw)
    hit = after[home_a][1] - before[home_a][1]
    assert hit >= 800 - 16, f"b's first turn reused the system prompt: {hit} tokens hit"
    # the next turns of both go where their previous turn is, and hit all of it
    for user_seed, session, first in ((1, sa, a1), (2, sb, b1)):
        answer = first.json()["choices"][0]["message"]["content"]
        before = _counters(gw)
        r = gw.chat(_conversation(_words(user_seed, 300), [(answer, _words(10 + user_seed, 50))]), max_tokens=2,
                    headers={"X-Session-Id": session})
        assert r.status_code == 200
        node = r.headers["X-Kvgate-Node"]
        assert node == home_a
        hit = _counters(gw)[node][1] - before[node][1]
        assert hit >= 800 + 300 - 16, f"turn 2 of {session} hit {hit} tokens"


def test_hot_prefix_spreads_prefill_and_keeps_the_system_prompt_hits(gw: Gateway) -> None:
    _reset(gw)
    before = _counters(gw)
    n = 48
    results: list = [None] * n

    def send(i: int) -> None:
        # one system prompt, a short distinct question, no session: every prefix key the same
        results[i] = gw.chat(_conversation(_words(100 + i, 40)), max_tokens=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.03)  # arrivals a little apart: each pick sees the ones before in flight
    for t in threads:
        t.join()
    assert all(r is not None and r.status_code == 200 for r in results), [r.status_code for r in results if r]
    after = _counters(gw)
    prefill = {k: (after[k][0] - before[k][0]) - (after[k][1] - before[k][1]) for k in after}
    queries = sum(after[k][0] - before[k][0] for k in after)
    hits = sum(after[k][1] - before[k][1] for k in after)
    mean = sum(prefill.values()) / len(prefill)
    assert max(prefill.values()) <= 1.3 * mean, prefill
    nodes = {r.headers["X-Kvgate-Node"] for r in results}
    assert len(nodes) == 4, nodes
    # the ceiling: each node computes the system prompt once, everything else hits it
    ceiling = (n - 4) * (800 - 16) / queries
    assert hits / queries >= 0.9 * ceiling, (hits, queries, ceiling)
    _wait(lambda: all(v == 0 for k, v in gw.metrics().items() if k.startswith("kvgate_upstream_load_tokens{")), 5,
          "the load back at 0")
