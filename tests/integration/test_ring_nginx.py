"""tests/oracles/ring.py (the oracle) against the real gateway (the Lua ring of
``kvgate.balancer.chash`` in nginx): for every route key, the Python ring names the node the
gateway sends it to, with unequal weights, with a ``down`` node, at the ring's edges and where
two nodes' points have the same hash; and the request log's ``point``/``tries`` fields feed
kvgate.web.admin.traffic.traffic_view (and its incremental TrafficTracker)."""

from __future__ import annotations

import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import pytest
import requests

from gwfixtures import (
    MODEL,
    Gateway,
    RedisServer,
    Sim,
    _start_gateway,
    _start_redis,
    _start_sims,
    _wait,
    make_policy,
)
from kvgate.web.admin.traffic import TrafficTracker, traffic_view
from kvgate.render import WEIGHT_SCALE, Runtime
from oracles.ring import Ring, key_point, node_points, pool_ring

WEIGHTS = [1, 2, 1, 3]  # policy weights → nginx weight=100, 200, 100, 300


# ---------------------------------------------------------------- keys with a chosen CRC-32
_FREE = 10  # suffix bytes 0x60 | nibble: "`abcdefghijklmno", printable, 40 free bits


def forge_session(prefix: str, target: int) -> str:
    """A session id ``prefix + 10 letters`` whose route key ``s:<id>`` has CRC-32 ``target``.

    CRC-32 over messages of one length is affine in the message bits, so the 40 free bits of
    the suffix are solved for over GF(2)."""
    head = ("s:" + prefix).encode()
    m0 = bytearray(head + b"\x60" * _FREE)
    c0 = zlib.crc32(bytes(m0))
    basis: list[tuple[int, int]] = []  # (crc difference, bit mask of suffix bits), reduced
    for i in range(_FREE):
        for b in range(4):
            m = bytearray(m0)
            m[len(head) + i] ^= 1 << b
            v, mask = zlib.crc32(bytes(m)) ^ c0, 1 << (4 * i + b)
            for bv, bm in basis:
                if v ^ bv < v:
                    v, mask = v ^ bv, mask ^ bm
            if v:
                basis.append((v, mask))
                basis.sort(reverse=True)
    want, mask = target ^ c0, 0
    for bv, bm in basis:
        if want ^ bv < want:
            want, mask = want ^ bv, mask ^ bm
    assert want == 0, "the free bits do not span CRC-32"
    suffix = bytes(0x60 | ((mask >> (4 * i)) & 0xF) for i in range(_FREE))
    sid = prefix + suffix.decode()
    assert key_point("s:" + sid) == target
    return sid


# ---------------------------------------------------------------- fixture
class Fleet:
    def __init__(self, base: Path, stack: ExitStack) -> None:
        self.base, self.stack = base, stack
        self.redis: RedisServer = _start_redis(base)
        stack.callback(self.redis.stop)
        self.sims: list[Sim] = _start_sims(4, base, prefix="r")
        stack.callback(lambda: [s.stop() for s in self.sims])

    def gateway(self, weights: list[int], redis: bool = True) -> Gateway:
        nodes = [{"id": s.node_id, "url": s.url, "weight": w} for s, w in zip(self.sims, weights)]
        policy = make_policy(self.sims, self.redis if redis else None, pool={"nodes": nodes},
                             cache={"enabled": False})
        gw = _start_gateway(self.base, policy, self.sims, self.redis if redis else None)
        self.stack.callback(gw.stop)
        return gw


@pytest.fixture(scope="module")
def ring_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield Fleet(tmp_path_factory.mktemp("ring"), stack)


@pytest.fixture(scope="module")
def weighted(ring_fleet: Fleet) -> Gateway:
    return ring_fleet.gateway(WEIGHTS)


def _served_by(gw: Gateway, session: str, http: requests.Session) -> str:
    r = http.post(gw.url + "/v1/chat/completions", timeout=30, headers={"X-Session-Id": session},
                  json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {session}"}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.headers["X-Kvgate-Route-Key-Kind"] == "session"
    assert r.headers["X-Kvgate-Node"] == r.headers["X-Kvgate-Sim-Node"]
    return r.headers["X-Kvgate-Node"]


def _log(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange("kvgate:log")]


def _wait_log(gw: Gateway, n: int) -> list[dict[str, str]]:
    _wait(lambda: len(_log(gw)) >= n, 15, f"{n} request-log entries")
    return _log(gw)


def _edge_sessions(ring: Ring) -> list[str]:
    """Keys on the ring's edges: exactly on a point, one past it, past the last point
    (wraps to the first), 0 and 2^32-1."""
    hashes = ring.hashes
    targets = [0, 0xFFFFFFFF, hashes[0], hashes[-1], (hashes[-1] + 1) & 0xFFFFFFFF]
    for i in range(1, len(hashes), len(hashes) // 40):
        targets += [hashes[i], hashes[i] + 1, hashes[i] - 1]
    return [forge_session(f"edge{n}-", t & 0xFFFFFFFF) for n, t in enumerate(targets)]


# ---------------------------------------------------------------- tests
def test_python_ring_predicts_the_gateway_with_unequal_weights(weighted: Gateway) -> None:
    gw = weighted
    gw.redis.client().delete("kvgate:log")
    ring = pool_ring(gw.policy, "default", {})
    assert dict(ring.nodes) == {s.node_id: w * WEIGHT_SCALE for s, w in zip(gw.sims, WEIGHTS)}
    sessions = [f"session-{i}" for i in range(200)] + _edge_sessions(ring)
    http = requests.Session()
    wrong = {}
    served = {}
    for s in sessions:
        served[s] = _served_by(gw, s, http)
        if served[s] != ring.home(key_point("s:" + s)):
            wrong[s] = (served[s], ring.home(key_point("s:" + s)))
    assert not wrong, f"{len(wrong)} of {len(sessions)} keys went elsewhere: {list(wrong.items())[:5]}"
    assert len(set(served.values())) == 4  # every node took keys

    # the request log carries the key's ring point and one try each
    entries = _wait_log(gw, len(sessions))
    assert len(entries) == len(sessions)
    for e in entries:
        assert e["tries"] == "1" and e["cache"] == "BYPASS", e
        assert ring.home(int(e["point"])) == e["node"]
    assert {e["point"] for e in entries} == {str(zlib.crc32(b"s:" + s.encode())) for s in sessions}

    # ... and traffic_view finds every request at home
    weights = {n.id: n.weight * WEIGHT_SCALE for n in gw.policy.pools[0].nodes}
    (view,) = traffic_view(gw.redis.client(), gw.policy, window_s=300)
    assert view["pool"] == "default" and view["requests"] == view["routed"] == len(sessions)
    assert view["affinity_ratio"] == 1.0 and view["at_home"] == len(sessions)
    assert (view["failovers"], view["errors"], view["truncated"]) == (0, 0, False)
    assert view["cache"] == {"HIT": 0, "MISS": 0, "BYPASS": len(sessions)}
    assert len(view["hot_keys"]) == 10
    for k in view["hot_keys"]:
        assert k["requests"] == 1 and k["share"] == pytest.approx(1 / len(sessions))
        assert k["nodes"] == {k["home"]: 1} and k["kind"] == "session"


def test_down_node_keys_move_to_the_next_point(weighted: Gateway) -> None:
    gw = weighted
    gw.redis.client().delete("kvgate:log")
    weights = {n.id: n.weight * WEIGHT_SCALE for n in gw.policy.pools[0].nodes}
    drained = gw.sims[1].node_id  # the weight-2 node
    weights[drained] = 0
    assert gw.nginx.apply(gw.policy, Runtime(weights=weights)) == "pushed"  # the runtime's: no reload
    try:
        live = pool_ring(gw.policy, "default", weights)
        assert live.down == {drained}
        home = pool_ring(gw.policy, "default", {})  # the ring with every node up
        sessions = [f"moved-{i}" for i in range(120)]
        http = requests.Session()
        served = {s: _served_by(gw, s, http) for s in sessions}
        for s in sessions:
            p = key_point("s:" + s)
            assert served[s] == live.route(p) != drained, s
            if home.home(p) != drained:
                assert served[s] == home.home(p)  # other nodes' keys stay
        was_drained = sum(home.home(key_point("s:" + s)) == drained for s in sessions)
        assert 10 < was_drained < 80
        _wait_log(gw, len(sessions))
        (view,) = traffic_view(gw.redis.client(), gw.policy, window_s=300)
        # the drained node's keys are still homed there: they count as away from home
        assert view["routed"] == len(sessions)
        assert view["at_home"] == len(sessions) - was_drained
        assert view["failovers"] == 0
    finally:
        gw.nginx.apply(gw.policy)


def test_logged_home_and_node_under_a_drain(weighted: Gateway) -> None:
    """Issue 10: the gateway logs each request's node and its key's home node (the home ring:
    every node at its runtime home_weight, a drained node at its target), for chash and for
    round_robin alike; the request log's fields agree with the oracle, and traffic_view reads
    them as they are."""
    gw = weighted
    nodes = gw.policy.pools[0].nodes
    weights = {n.id: n.weight * WEIGHT_SCALE for n in nodes}
    drained = gw.sims[1].node_id  # weight 200; its target 300 here (not its base weight)
    weights[drained] = 0
    home_weights = {**weights, drained: 300}
    home_ring = pool_ring(gw.policy, "default", home_weights)
    live = pool_ring(gw.policy, "default", weights)
    http = requests.Session()
    try:
        for balancer in ("chash", "round_robin"):
            gw.redis.client().delete("kvgate:log")
            rt = Runtime(weights=weights, home_weights=home_weights, balancers={"default": balancer},
                         states={drained: "drained"})
            assert gw.nginx.apply(gw.policy, rt) == "pushed"
            sessions = [f"{balancer}-{i}" for i in range(80)]
            served = {s: _served_by(gw, s, http) for s in sessions}
            by_key = {e["point"]: e for e in _wait_log(gw, len(sessions))}
            away = 0
            for s in sessions:
                p = key_point("s:" + s)
                e = by_key[str(p)]
                assert e["node"] == served[s] != drained, (balancer, s)
                assert e["home"] == home_ring.home(p), (balancer, s, e)
                if balancer == "chash":
                    assert e["node"] == live.route(p)
                    if e["home"] != drained:
                        assert e["node"] == e["home"]  # only the drained node's keys moved
                away += e["node"] != e["home"]
            homed_drained = sum(home_ring.home(key_point("s:" + s)) == drained for s in sessions)
            assert homed_drained > 5
            if balancer == "chash":
                assert away == homed_drained
            else:
                assert away > homed_drained  # round robin scatters keys against their home
            (view,) = traffic_view(gw.redis.client(), gw.policy, window_s=300)
            assert (view["routed"], view["at_home"]) == (len(sessions), len(sessions) - away)
        # a home only with a route key (its point)
        gw.redis.client().delete("kvgate:log")
        assert gw.chat("no key here", max_tokens=1).status_code == 200
        (e,) = _wait_log(gw, 1)
        assert e["home"] == "" or e["point"] != "", e
    finally:
        gw.nginx.apply(gw.policy)


def test_equal_point_hashes_keep_the_lowest_id(ring_fleet: Fleet) -> None:
    """Weight 10 (weight=1000) on 4 nodes: 640,000 points, about 30 hashes shared by points
    of two nodes. The ring keeps the first of each run of equal hashes: the point of the node
    whose id sorts first, whatever the order the nodes are listed in."""
    gw = ring_fleet.gateway([10, 10, 10, 10], redis=False)
    ring = pool_ring(gw.policy, "default", {})
    first_owner: dict[int, str] = {}
    shared: dict[int, set[str]] = {}
    for node in gw.policy.pools[0].nodes:
        for h in node_points(node.id, 1000):
            if h in first_owner and first_owner[h] != node.id:
                shared.setdefault(h, {first_owner[h]}).add(node.id)
            first_owner.setdefault(h, node.id)
    assert len(shared) >= 5, "expected a few equal hashes across servers"
    http = requests.Session()
    wrong = []
    for n, (h, owners) in enumerate(sorted(shared.items())):
        idx = ring.index(h)
        prev = ring.hashes[idx - 1]
        for target in {h, (prev + 1) & 0xFFFFFFFF}:  # exactly on the point, and the arc's start
            served = _served_by(gw, forge_session(f"dup{n}-", target), http)
            if served != ring.home(target):
                wrong.append((h, sorted(owners), served, ring.home(target)))
    assert not wrong, f"the gateway disagrees with the oracle ring on shared hashes: {wrong}"
    # and what the ring (so the gateway) keeps is the point of the lowest id
    for h, owners in shared.items():
        idx = ring.index(h)
        assert ring.hashes[idx] == h and ring.owner(idx) == min(owners)


def test_failover_is_logged_and_leaves_home(weighted: Gateway) -> None:
    """Last in the module: it stops a node."""
    gw = weighted
    gw.redis.client().delete("kvgate:log")
    ring = pool_ring(gw.policy, "default", {})
    dead = gw.sims[3]  # the weight-3 node
    dead.stop()
    sessions = [f"fail-{i}" for i in range(60)]
    homed_dead = [s for s in sessions if ring.home(key_point("s:" + s)) == dead.node_id]
    assert len(homed_dead) >= 10
    http = requests.Session()
    t0 = time.time()
    tracker = TrafficTracker(window_s=300)  # the admin page's incremental reader, fed as the log grows
    for i, s in enumerate(sessions):
        assert _served_by(gw, s, http) == ring.route(key_point("s:" + s), skip=[dead.node_id])
        if i == len(sessions) // 2:
            _wait_log(gw, i + 1)
            tracker.update(gw.redis.client(), gw.policy)
    entries = _wait_log(gw, len(sessions))
    tries = [int(e["tries"]) for e in entries]
    # the dead node is tried once, then skipped for FAIL_TIMEOUT_S by every worker (kvgate_state)
    assert 1 <= tries.count(2) <= gw.policy.gateway.worker_processes
    assert set(tries) <= {1, 2}
    now = time.time()
    (view,) = traffic_view(gw.redis.client(), gw.policy, window_s=300, now=now)
    tracker.update(gw.redis.client(), gw.policy, now=now)
    assert tracker.view(gw.policy, now=now) == [view]
    (view,) = traffic_view(gw.redis.client(), gw.policy, window_s=time.time() - t0 + 5)
    assert view["failovers"] == tries.count(2)
    assert view["routed"] == len(sessions)
    assert view["at_home"] == len(sessions) - len(homed_dead)
    assert view["affinity_ratio"] == pytest.approx((len(sessions) - len(homed_dead)) / len(sessions))
