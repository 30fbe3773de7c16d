"""kvgate.control.traffic over a real redis-server: synthetic request-log entries (the shape
lua/kvgate/reqlog.lua writes) and response-cache keys."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path
from typing import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvgate.control.traffic import cache_stats, home_weights, traffic_view
from kvgate.policy.loader import parse_policy
from kvgate.ring import key_point, pool_ring

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    d: Path = tmp_path_factory.mktemp("redis")
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=1).ping():
                    break
            except redis.RedisError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.fixture
def r(redis_server: int) -> redis.Redis:
    client = redis.Redis(port=redis_server)
    client.flushdb()
    return client


POLICY = parse_policy({"version": 1, "pools": [
    {"name": "a", "models": ["m"], "nodes": [
        {"id": "a1", "url": "http://127.0.0.1:9001"},
        {"id": "a2", "url": "http://127.0.0.1:9002", "weight": 2},
        {"id": "a3", "url": "http://127.0.0.1:9003"},
    ]},
    {"name": "b", "models": ["mb"], "balancer": "round_robin", "nodes": [
        {"id": "b1", "url": "http://127.0.0.1:9101"},
        {"id": "b2", "url": "http://127.0.0.1:9102"},
    ]},
]})
BASE = {n.id: n.weight * 100 for n in POLICY.nodes()}
RING_A = pool_ring(POLICY, "a", BASE)


def add(r: redis.Redis, *, pool: str = "a", node: str = "", status: int = 200, cache: str = "BYPASS",
        kind: str = "session", key: str = "", point: int | None = None, tries: int | None = 1,
        ts: float | None = None, n: int = 1, old: bool = False) -> None:
    fields = {"ts": f"{time.time() if ts is None else ts:.3f}", "pool": pool, "node": node, "status": str(status),
              "cache": cache, "kind": kind, "fp": "", "key": key, "ms": "5"}
    if not old:
        fields["point"] = "" if point is None else str(point)
        fields["tries"] = "" if tries is None else str(tries)
    for _ in range(n):
        r.xadd("kvgate:log", fields)


def session(name: str) -> tuple[str, int, str]:
    """(logged key hash stand-in, point, home node in pool a) of session ``name``."""
    p = key_point("s:" + name)
    return f"{p:016x}", p, RING_A.home(p)


def other_than(node: str) -> str:
    return next(n for n in ("a1", "a2", "a3") if n != node)


def view(r: redis.Redis, **kw) -> dict[str, dict]:
    kw.setdefault("weights", BASE)
    return {v["pool"]: v for v in traffic_view(r, POLICY, **kw)}


def test_affinity_failovers_cache_and_hot_keys(r: redis.Redis) -> None:
    k1, p1, h1 = session("one")
    k2, p2, h2 = session("two")
    k3, p3, _ = session("three")
    add(r, node=h1, key=k1, point=p1, n=10)
    add(r, node="cache", cache="HIT", key=k1, point=p1, tries=0, n=3)
    add(r, node=other_than(h2), key=k2, point=p2, tries=2, cache="MISS", n=2)  # failed over
    add(r, node="", status=502, key=k3, point=p3, tries=2)  # every node failed
    add(r, node=h1, key=k1, cache="MISS", old=True)  # written before point/tries existed
    add(r, pool="gone", node="x", key=k1, point=p1)  # a pool that left the policy
    add(r, node=h1, key=k1, point=p1, ts=time.time() - 2000)  # before the window
    v = view(r)
    a = v["a"]
    assert a["requests"] == 17
    assert a["cache"] == {"HIT": 3, "MISS": 3, "BYPASS": 11}
    assert a["cache_ratio"] == {"HIT": 3 / 17, "MISS": 3 / 17, "BYPASS": 11 / 17}
    assert (a["routed"], a["at_home"]) == (12, 10)
    assert a["affinity_ratio"] == pytest.approx(10 / 12)
    assert (a["failovers"], a["errors"], a["truncated"]) == (3, 1, False)
    hot = a["hot_keys"]
    assert [k["key"] for k in hot] == [k1, k2]  # k3 was never served: not a hot key
    assert hot[0] == {"key": k1, "kind": "session", "requests": 13, "share": 13 / 15, "home": h1,
                      "nodes": {h1: 10, "cache": 3}}
    assert hot[1]["home"] == h2 and hot[1]["nodes"] == {other_than(h2): 2} and hot[1]["share"] == 2 / 15
    assert a["balancer"] == "chash" and a["window_s"] == 900
    b = v["b"]
    assert b["requests"] == 0 and b["affinity_ratio"] is None and b["hot_keys"] == []
    assert b["cache_ratio"] == {"HIT": None, "MISS": None, "BYPASS": None}


def test_hot_keys_top_ten_by_requests(r: redis.Redis) -> None:
    for i in range(14):
        k, p, h = session(f"s{i}")
        add(r, node=h, key=k, point=p, n=i + 1)
    hot = view(r)["a"]["hot_keys"]
    assert [k["requests"] for k in hot] == list(range(14, 4, -1))
    total = sum(range(1, 15))
    assert hot[0]["share"] == pytest.approx(14 / total)


def test_drained_node_keeps_its_keys_home(r: redis.Redis) -> None:
    """a2 drained (weight 0): its keys went to their next node, and count as away from home."""
    weights = {**BASE, "a2": 0}
    assert home_weights(POLICY, weights)["a2"] == 200
    live = pool_ring(POLICY, "a", weights)
    moved = stayed = 0
    for i in range(60):
        k, p, h = session(f"d{i}")
        node = live.route(p)  # where nginx sends it now
        assert node != "a2"
        add(r, node=node, key=k, point=p)
        if h == "a2":
            moved += 1
        else:
            stayed += 1
    assert moved and stayed
    a = view(r, weights=weights)["a"]
    assert (a["routed"], a["at_home"]) == (60, stayed)
    # a weight change moves the home: judged against the weights in force
    k, p, _ = session("w")
    heavy = {**BASE, "a1": 1000}
    r.delete("kvgate:log")
    add(r, node=pool_ring(POLICY, "a", heavy).home(p), key=k, point=p)
    assert view(r, weights=heavy)["a"]["at_home"] == 1


def test_round_robin_pool_and_keyless_entries(r: redis.Redis) -> None:
    add(r, pool="b", node="b1", kind="prefix", point=None, n=4)  # rr pools do not compute prefix keys
    k, p, _ = session("rr")
    home = pool_ring(POLICY, "b", BASE).home(p)
    add(r, pool="b", node=home, key=k, point=p, n=2)
    b = view(r)["b"]
    assert (b["requests"], b["routed"], b["at_home"], b["affinity_ratio"]) == (6, 2, 2, 1.0)
    assert b["balancer"] == "round_robin" and [k["requests"] for k in b["hot_keys"]] == [2]


def test_truncation_and_window(r: redis.Redis) -> None:
    now = time.time()
    # an entry the stream itself dates before the window (its id), then 30 recent ones
    r.xadd("kvgate:log", {"ts": f"{now - 5000:.3f}", "pool": "a", "node": "a1", "status": "200",
                          "cache": "BYPASS", "kind": "", "fp": "", "key": "", "ms": "1", "point": "1",
                          "tries": "1"}, id=f"{int((now - 5000) * 1000)}-0")
    for i in range(30):
        add(r, node="a1", ts=now - 30 + i, point=5)
    a = view(r, max_entries=20, now=now + 1)["a"]
    assert a["truncated"] is True and a["requests"] == 20
    assert 10 < a["covered_s"] < 30  # the newest 20 entries go back ~20 s
    a = view(r, max_entries=30, now=now + 1)["a"]
    assert a["truncated"] is False and a["requests"] == 30 and a["covered_s"] == 900
    a = view(r, window_s=11.5, now=now + 1)["a"]  # from now - 10.5: the last 10
    assert a["requests"] == 10 and a["truncated"] is False
    a = view(r, window_s=10_000, now=now + 1)["a"]
    assert a["requests"] == 31


def test_empty_log_decoded_client_and_redis_errors(r: redis.Redis, redis_server: int) -> None:
    v = view(r)
    assert v["a"]["requests"] == 0 and v["a"]["affinity_ratio"] is None
    k, p, h = session("dec")
    add(r, node=h, key=k, point=p)
    text_client = redis.Redis(port=redis_server, decode_responses=True)
    assert traffic_view(text_client, POLICY, BASE)[0]["at_home"] == 1
    dead = redis.Redis(port=_free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.RedisError):
        traffic_view(dead, POLICY, BASE)
    with pytest.raises(redis.RedisError):
        cache_stats(dead, 1)


def test_cache_stats(r: redis.Redis) -> None:
    for i in range(5):
        r.set(f"kvgate:resp:v2:default:{i:064x}", "x" * (100 * (i + 1)))
    for i in range(3):
        r.set(f"kvgate:resp:v1:default:{i:064x}", "y" * 1000)
    r.set("kvgate:resp:v9x:weird", "z")
    r.set("kvgate:other", "z" * 5000)
    r.xadd("kvgate:log", {"a": "b"})
    usage = {k: r.memory_usage(k) for k in r.scan_iter("kvgate:resp:v*")}
    cur = sum(v for k, v in usage.items() if k.startswith(b"kvgate:resp:v2:"))
    old = sum(v for k, v in usage.items() if k.startswith(b"kvgate:resp:v1:"))
    s = cache_stats(r, 2)
    assert s == {"namespace_version": 2, "entries": 5, "bytes": cur, "stale_entries": 3, "stale_bytes": old,
                 "estimated": False}
    assert cache_stats(r, 1)["entries"] == 3 and cache_stats(r, 1)["stale_entries"] == 5
    assert cache_stats(r, 3)["entries"] == 0 and cache_stats(r, 3)["bytes"] == 0
    sampled = cache_stats(r, 2, sample=2)
    assert sampled["estimated"] is True and sampled["entries"] == 5
    assert 0.2 * cur < sampled["bytes"] < 5 * cur
    cut = cache_stats(r, 2, scan_limit=4)
    assert cut["estimated"] is True and cut["entries"] + cut["stale_entries"] <= 4


def test_without_scripting_the_plain_command_is_used(r: redis.Redis, redis_server: int) -> None:
    k, p, h = session("acl")
    add(r, node=h, key=k, point=p, n=3)
    add(r, node=other_than(h), key=k, point=p, tries=2)
    expected = view(r)
    r.acl_setuser("noscript", enabled=True, nopass=True, commands=["+@all", "-eval", "-evalsha"], keys=["*"])
    try:
        limited = redis.Redis(port=redis_server, username="noscript", password="x")
        with pytest.raises(redis.ResponseError):
            limited.eval("return 1", 0)
        got = {v["pool"]: v for v in traffic_view(limited, POLICY, BASE)}
        assert got == expected and got["a"]["at_home"] == 3 and got["a"]["failovers"] == 1
    finally:
        r.acl_deluser("noscript")
