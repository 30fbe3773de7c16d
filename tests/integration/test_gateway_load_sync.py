"""Two gateways of one policy (two nginx instances, one Redis, scriptable mock engines) judge
chash_bounded's load bound on the same figures: each adds the other's in-flight prefill, summed
through Redis (lua/kvgate/gwload.lua), so a node loaded through one gateway is passed over by
both for the keys it is the home of, and both send such a key to the same next node. Measures
how stale the other gateway's figure is (printed; docs/scale-out.md quotes it)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from gwfixtures import Gateway, _start_gateway, _start_redis, _wait, free_port, make_policy
from mockengine import Behaviour, start_mock_engines

from kvgate import keys

REMOTE = keys.UPSTREAM_LOAD_REMOTE
HOLD_S = 4.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway, list]]:
    base = tmp_path_factory.mktemp("loadsync")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        mocks = start_mock_engines(4, prefix="s")
        for m in mocks:
            stack.callback(m.stop)
        l1, i1, l2, i2, l3, i3 = (f"127.0.0.1:{free_port()}" for _ in range(6))
        policy = make_policy(mocks, redis, balancer="chash_bounded", cache={"enabled": False},
                             gateway={"listen": l1, "internal_listen": i1},
                             pool={"bound_factor": 1.25,
                                   "admission": {"node_capacity": 1, "queue_timeout_s": 0.5}},
                             top={"gateways": [{"id": "g1", "listen": l1, "internal_listen": i1},
                                               {"id": "g2", "listen": l2, "internal_listen": i2},
                                               # a member that never runs here (a host that is down)
                                               {"id": "g3", "listen": l3, "internal_listen": i3}]})
        gws = []
        for member in ("g1", "g2"):
            gw = _start_gateway(base, policy.member_policy(member), mocks, redis)
            stack.callback(gw.stop)
            gws.append(gw)
        yield gws[0], gws[1], mocks


def _ask(gw: Gateway, session: str, i: int) -> str:
    # the same prompt length for every request: the same estimated cost on every node
    r = gw.chat(f"question {i:08d} " + "x" * 400, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    return r.headers["X-Kvgate-Node"]


def _remote(gw: Gateway, node: str) -> float:
    return gw.metric_sum(REMOTE, node=node)


def test_one_gateway_renders_no_remote_figures(pair: tuple[Gateway, Gateway, list], tmp_path) -> None:
    g1, _, mocks = pair
    assert g1.metric_sum(REMOTE) == 0  # two members: the family is there, all zero at rest
    single = make_policy(mocks, g1.redis, balancer="chash_bounded")
    gw = _start_gateway(tmp_path, single, mocks, g1.redis)
    try:
        text = requests.get(f"http://{single.gateway.internal_listen}/metrics", timeout=5).text
        assert f"\n{REMOTE}{{" not in text  # one member: no samples, no Redis round
        assert not g1.redis.client().exists(keys.GWLOAD_PREFIX + "local")
    finally:
        gw.stop()


def test_a_node_loaded_through_one_gateway_is_passed_over_by_both(pair: tuple[Gateway, Gateway, list]) -> None:
    g1, g2, mocks = pair
    by_id = {m.node_id: m for m in mocks}
    session = "load-sync-session"
    home = _ask(g2, session, 0)
    assert _ask(g1, session, 1) == home  # no load anywhere: the same home from both

    # one slow request on the home through g1: over its bound for the next request of equal cost
    by_id[home].script(Behaviour(stall_s=HOLD_S))
    held: dict[str, object] = {}

    def slow() -> None:
        held["node"] = _ask(g1, session, 2)

    t = threading.Thread(target=slow)
    sent = time.monotonic()
    t.start()
    try:
        _wait(lambda: _remote(g2, home) > 0, 2.0, "g2 sees g1's load on the home")
        seen_after = time.monotonic() - sent
        print(f"\ng2 saw g1's in-flight load on {home} {seen_after * 1000:.0f} ms after g1 took it")
        assert seen_after < 1.0
        # both gateways pass over the loaded home for its key, to the same next node
        via2 = _ask(g2, session, 3)
        via1 = _ask(g1, session, 4)
        assert via2 != home and via1 == via2, (home, via1, via2)
    finally:
        t.join(HOLD_S + 5)
    assert held["node"] == home
    # the load gone at g1, gone from g2's view within a round or two: the key is home again
    _wait(lambda: _remote(g2, home) == 0, 2.0, "g2's view of the home back at 0")
    assert _ask(g2, session, 5) == home and _ask(g1, session, 6) == home


def test_a_lost_gateway_drops_out_of_the_sums(pair: tuple[Gateway, Gateway, list]) -> None:
    """g3's hash as its last round left it (TTL 4 rounds): counted by g2 while it lives, gone from
    g2's figures once it expired, without g3 ever saying goodbye (killed, partitioned)."""
    g1, g2, mocks = pair
    r = g1.redis.client()
    node = mocks[0].node_id
    key = keys.GWLOAD_PREFIX + "g3"
    r.hset(key, mapping={"default\t": 1000, f"default\t{node}": 1000})
    r.pexpire(key, 400)
    _wait(lambda: _remote(g2, node) == 1000, 1.0, "g3's figure counted at g2")
    t0 = time.monotonic()
    _wait(lambda: _remote(g2, node) == 0, 2.0, "g3's figure gone once its hash expired")
    print(f"\ng3's figure left g2's view {(time.monotonic() - t0) * 1000:.0f} ms after it was first seen "
          f"(hash TTL 400 ms)")
    for k in (keys.GWLOAD_PREFIX + "g1", keys.GWLOAD_PREFIX + "g2"):
        ttl = r.pttl(k)
        assert ttl == -2 or 0 < ttl <= 200, (k, ttl)  # a hash only while it has figures, always a TTL


def test_the_admission_slots_are_the_tiers(pair: tuple[Gateway, Gateway, list]) -> None:
    """node_capacity 1 × 4 nodes = 4 slots for both gateways together: 4 slow requests admitted
    through g1 leave none to g2 (its request waits, then 503 overloaded), once they end g2 serves."""
    g1, g2, mocks = pair
    for m in mocks:
        m.script(Behaviour(stall_s=3.0), Behaviour(stall_s=3.0))
    results: list[int] = []

    def slow(i: int) -> None:
        r = g1.chat(f"slot {i} " + "y" * 100, headers={"X-Session-Id": f"slot-{i}"})
        results.append(r.status_code)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        _wait(lambda: g1.metric_sum("kvgate_admission_inflight") == 4, 2.0, "4 admitted at g1")
        time.sleep(3 * 0.25)  # g2 has read them
        r = g2.chat("over the tier's slots", headers={"X-Session-Id": "late"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert r.headers.get("Retry-After")
    finally:
        for t in threads:
            t.join(10)
        for m in mocks:
            m.clear()
    assert results == [200] * 4
    _wait(lambda: g2.chat("a slot again", headers={"X-Session-Id": "late2"}).status_code == 200, 3.0,
          "g2 admits once g1's requests ended")


def test_with_no_load_a_thousand_keys_go_to_the_same_node_from_both(pair: tuple[Gateway, Gateway, list]) -> None:
    """chash_bounded with no node over its bound: every key's node is its home, the same through
    either gateway (one request at a time, so nothing is in flight when the next is routed)."""
    g1, g2, _ = pair
    import random

    rng = random.Random(11)
    keys = [f"k-{rng.getrandbits(64):016x}" for _ in range(1000)]
    s = requests.Session()

    model = g1.policy.pools[0].models[0]
    s.headers["Content-Type"] = "application/json"

    def node_m(gw: Gateway, key: str) -> str:
        r = s.post(gw.url + "/v1/chat/completions", headers={"X-Session-Id": key}, timeout=30,
                   json={"model": model, "messages": [{"role": "user", "content": "same length"}]})
        assert r.status_code == 200, r.text
        assert r.headers.get("X-Kvgate-Route-Key-Kind") == "session"
        return r.headers["X-Kvgate-Node"]

    via1 = {k: node_m(g1, k) for k in keys}
    time.sleep(0.3)  # g1's figures (all zero by now) are the ones g2 reads
    via2 = {k: node_m(g2, k) for k in keys}
    differ = [k for k in keys if via1[k] != via2[k]]
    spread = {n: list(via1.values()).count(n) for n in set(via1.values())}
    print(f"\n1,000 keys with no load: {len(differ)} on different nodes; per node {sorted(spread.items())}")
    assert not differ
    assert len(spread) == 4
