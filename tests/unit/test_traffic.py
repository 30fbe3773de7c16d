"""kvgate.web.admin.traffic over a real redis-server: synthetic request-log entries (the shape
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

from kvgate.web.admin import traffic
from kvgate.web.admin.traffic import TrafficTracker, cache_stats, traffic_view
from kvgate.policy.loader import parse_policy
from kvgate.render import Runtime, runtime_document
from oracles.ring import key_point, pool_ring

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


def _home(pool: str, point: int | None, cache: str) -> str:
    """The home the gateway logs with every node at its base weight: the key's node on the
    pool's home ring (the oracle's), "" for a HIT or an entry without a key."""
    if point is None or cache == "HIT":
        return ""
    for policy in (POLICY, POLICY_B_GONE):
        if any(p.name == pool for p in policy.pools):
            return pool_ring(policy, pool, {}).home(point)
    return ""


def add(r: redis.Redis, *, pool: str = "a", node: str = "", status: int = 200, cache: str = "BYPASS",
        kind: str = "session", key: str = "", point: int | None = None, tries: int | None = 1,
        ts: float | None = None, n: int = 1, old: bool = False, home: str | None = None,
        no_home: bool = False) -> None:
    """One entry (``n`` times). ``home``: the logged home (default :func:`_home`); ``old``: an
    entry from before ``point``/``tries``/``home``; ``no_home``: from before ``home`` only."""
    fields = {"ts": f"{time.time() if ts is None else ts:.3f}", "pool": pool, "node": node, "status": str(status),
              "cache": cache, "kind": kind, "fp": "", "key": key, "ms": "5"}
    if not old:
        fields["point"] = "" if point is None else str(point)
        fields["tries"] = "" if tries is None else str(tries)
        if not no_home:
            fields["home"] = _home(pool, point, cache) if home is None else home
    for _ in range(n):
        r.xadd("kvgate:log", fields)


def session(name: str) -> tuple[str, int, str]:
    """(logged key hash stand-in, point, home node in pool a) of session ``name``."""
    p = key_point("s:" + name)
    return f"{p:016x}", p, RING_A.home(p)


def other_than(node: str) -> str:
    return next(n for n in ("a1", "a2", "a3") if n != node)


def view(r: redis.Redis, **kw) -> dict[str, dict]:
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
    assert a["balancer"] == "chash_bounded" and a["window_s"] == 900  # the default
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
    # the home ring's weight of a drained node: its base weight (the runtime's home_weight;
    # the gateway logs each entry's home on that ring)
    assert runtime_document(POLICY, Runtime(weights=weights))["pools"]["a"]["nodes"]["a2"]["home_weight"] == 200
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
    a = view(r)["a"]
    assert (a["routed"], a["at_home"]) == (60, stayed)
    # a weight change moves the home: judged against the weights in force (the gateway logs
    # the home on the ring of the weights in force)
    k, p, _ = session("w")
    heavy = {**BASE, "a1": 1000}
    r.delete("kvgate:log")
    home = pool_ring(POLICY, "a", heavy).home(p)
    add(r, node=home, key=k, point=p, home=home)
    assert view(r)["a"]["at_home"] == 1


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
    assert traffic_view(text_client, POLICY)[0]["at_home"] == 1
    dead = redis.Redis(port=_free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.RedisError):
        traffic_view(dead, POLICY)
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
        got = {v["pool"]: v for v in traffic_view(limited, POLICY)}
        assert got == expected and got["a"]["at_home"] == 3 and got["a"]["failovers"] == 1
    finally:
        r.acl_deluser("noscript")


# ---------------------------------------------------------------- TrafficTracker
POLICY_B_GONE = parse_policy({"version": 1, "pools": [
    {"name": "a", "models": ["m"], "nodes": [  # a3 left, a4 joined
        {"id": "a1", "url": "http://127.0.0.1:9001"},
        {"id": "a2", "url": "http://127.0.0.1:9002", "weight": 2},
        {"id": "a4", "url": "http://127.0.0.1:9004"},
    ]},
    {"name": "c", "models": ["mc"], "nodes": [{"id": "c1", "url": "http://127.0.0.1:9201"}]},
]})


def mixed(r: redis.Redis, tag: str, ts: float | None = None) -> None:
    """11 entries of every sort (8 of pool a): at home, failed over, HITs, a 502, an
    old-format entry, another pool, a pool not in the policy, one that started before the
    window."""
    k1, p1, h1 = session(tag + "1")
    k2, p2, h2 = session(tag + "2")
    add(r, node=h1, key=k1, point=p1, n=3, ts=ts)
    add(r, node="cache", cache="HIT", key=k1, point=p1, tries=0, ts=ts)
    add(r, node=other_than(h2), key=k2, point=p2, tries=2, cache="MISS", n=2, ts=ts)
    add(r, node="", status=502, key=k2, point=p2, tries=2, ts=ts)
    add(r, node=h1, key=k1, cache="MISS", old=True, ts=ts)
    add(r, pool="b", node="b1", kind="prefix", ts=ts)
    add(r, pool="gone", node="x", key=k1, point=p1, ts=ts)
    add(r, node=h1, key=k1, point=p1, ts=time.time() - 2000)


class PageSpy:
    """Records the pages read (``traffic._page`` calls): (first, last, count, reverse, rows)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str, int, bool, int]] = []
        real = traffic._page

        def spy(r, first, last, count=traffic.PAGE, reverse=True):
            rows = real(r, first, last, count, reverse)
            self.calls.append((first, last, count, reverse, len(rows)))
            return rows

        monkeypatch.setattr(traffic, "_page", spy)

    def rows(self) -> int:
        n = sum(c[4] for c in self.calls)
        self.calls.clear()
        return n


def tracked(t: TrafficTracker, policy=POLICY, **kw) -> dict[str, dict]:
    return {v["pool"]: v for v in t.view(policy, **kw)}


def test_tracker_reads_only_new_entries_and_matches_traffic_view(r: redis.Redis, monkeypatch) -> None:
    spy = PageSpy(monkeypatch)
    t = TrafficTracker()
    t.update(r, POLICY)  # no stream yet: nothing read, the next update backfills
    assert spy.calls == [] and t.stats()["cursor"] is None and tracked(t)["a"]["requests"] == 0
    mixed(r, "x")
    t.update(r, POLICY)
    assert [c[3] for c in spy.calls] == [True]  # the backfill: newest first
    assert spy.rows() == 11
    assert tracked(t) == view(r)
    spy.calls.clear()  # (traffic_view's pages)
    cursor = t.stats()["cursor"]
    mixed(r, "y")
    k, p, h = session("x1")
    add(r, node=h, key=k, point=p, n=4)
    t.update(r, POLICY)
    # oldest first, from the id after the last one read: only the 15 new entries
    assert [(c[0], c[3]) for c in spy.calls] == [(traffic._after(traffic._sid(cursor)), False)]
    assert spy.rows() == 15
    assert tracked(t) == view(r)
    spy.calls.clear()
    a = tracked(t)["a"]
    assert a["requests"] == 2 * 8 + 4 and a["hot_keys"][0]["key"] == k and a["hot_keys"][0]["requests"] == 8
    t.update(r, POLICY)  # nothing new: nothing read
    assert spy.calls == [] and tracked(t) == view(r)
    s = t.stats()
    assert (s["updates"], s["entries_read"], s["lagging"], s["gaps"]) == (4, 26, False, 0)


def test_tracker_steps_are_capped_and_catch_up(r: redis.Redis, redis_server: int, monkeypatch) -> None:
    monkeypatch.setattr(traffic, "PAGE", 4)
    t = TrafficTracker(max_step=10)
    mixed(r, "s")
    t.update(r, POLICY)
    for i in range(25):
        k, p, h = session(f"lag{i}")
        add(r, node=h, key=k, point=p)
    t.update(r, POLICY)
    assert t.lagging and t.stats()["entries_read"] == 11 + 10
    assert tracked(t)["a"]["requests"] == 8 + 10
    t.update(r, POLICY)
    assert t.lagging and tracked(t)["a"]["requests"] == 8 + 20
    t.update(r, POLICY)
    assert not t.lagging and tracked(t) == view(r)
    # a client that decodes, and no scripting: the same figures
    text_client = redis.Redis(port=redis_server, decode_responses=True)
    t2 = TrafficTracker(max_step=10)
    t2.update(text_client, POLICY)
    assert tracked(t2) == view(r)


def test_tracker_without_scripting(r: redis.Redis, redis_server: int) -> None:
    r.acl_setuser("noscript2", enabled=True, nopass=True, commands=["+@all", "-eval", "-evalsha"], keys=["*"])
    try:
        limited = redis.Redis(port=redis_server, username="noscript2", password="x")
        t = TrafficTracker()
        mixed(r, "n")
        t.update(limited, POLICY)
        mixed(r, "m")
        t.update(limited, POLICY)
        assert tracked(t) == view(r) and tracked(t)["a"]["requests"] == 16
    finally:
        r.acl_deluser("noscript2")


def test_tracker_window_expiry_by_bucket(r: redis.Redis) -> None:
    t0 = (int(time.time()) // 60) * 60  # a bucket boundary (15 s) in the last minute
    k1, p1, h1 = session("e1")
    k2, p2, h2 = session("e2")
    add(r, node=h1, key=k1, point=p1, ts=t0 - 50, n=2)  # bucket [t0 - 60, t0 - 45)
    add(r, node=h2, key=k2, point=p2, ts=t0 - 5)  # bucket [t0 - 15, t0)
    add(r, node=h2, key=k1, point=p1, ts=t0 - 70)  # before the window when read
    t = TrafficTracker(window_s=60, bucket_s=15)
    t.update(r, POLICY, now=t0)
    assert tracked(t, now=t0)["a"]["requests"] == 3
    # the edge moves by whole buckets: t0 - 50 is kept while part of its bucket is in the window
    assert tracked(t, now=t0 + 14)["a"]["requests"] == 3
    a = tracked(t, now=t0 + 15)["a"]
    assert a["requests"] == 1 and [k["key"] for k in a["hot_keys"]] == [k2]
    assert t.stats()["buckets"] == 1 and t.stats()["window_keys"] == 1
    # an update later on drops what expired too, and takes only entries in its window
    add(r, node=h1, key=k1, point=p1, ts=t0 + 50)
    add(r, node=h1, key=k1, point=p1, ts=t0 - 10)  # logged late, before this update's window
    t.update(r, POLICY, now=t0 + 60)
    a = tracked(t, now=t0 + 60)["a"]
    assert a["requests"] == 1 and a["hot_keys"][0]["key"] == k1
    assert t.stats()["buckets"] == 1 and t.stats()["window_keys"] == 1
    assert tracked(t, now=t0 + 120)["a"] == {**a, "requests": 0, "cache": {"HIT": 0, "MISS": 0, "BYPASS": 0},
                                             "cache_ratio": {"HIT": None, "MISS": None, "BYPASS": None},
                                             "routed": 0, "at_home": 0, "affinity_ratio": None, "hot_keys": []}
    assert t.stats()["buckets"] == 0 and t.stats()["window_keys"] == 0


def test_tracker_truncated_backfill(r: redis.Redis) -> None:
    now = time.time()
    for i in range(30):
        add(r, node="a1", ts=now - 30 + i, point=5)
    t = TrafficTracker(max_backfill=20)
    t.update(r, POLICY, now=now + 1)
    a = tracked(t, now=now + 1)["a"]
    assert a["truncated"] is True and a["requests"] == 20 and 10 < a["covered_s"] < 30
    assert a == view(r, max_entries=20, now=now + 1)["a"]
    add(r, node="a1", ts=now + 2, point=5)
    t.update(r, POLICY, now=now + 3)
    assert tracked(t, now=now + 3)["a"]["requests"] == 21
    # once the window starts after the oldest entry taken, nothing is missing any more
    later = tracked(t, now=now + 900)["a"]
    assert later["truncated"] is False and later["covered_s"] == 900


def test_tracker_stream_trimmed_deleted_or_replaced(r: redis.Redis) -> None:
    t = TrafficTracker()
    mixed(r, "t")
    t.update(r, POLICY)
    before = tracked(t)
    r.xtrim("kvgate:log", maxlen=0)  # entries trimmed before they were read
    k, p, h = session("t9")
    add(r, node="cache", cache="HIT", tries=0, key=k, point=p)
    r.xtrim("kvgate:log", maxlen=0)
    add(r, node=h, key=k, point=p, n=2)
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert t.gaps == 1 and a["requests"] == before["a"]["requests"] + 2 and a["cache"]["HIT"] == 1
    r.delete("kvgate:log")  # the stream is gone: nothing to read, the figures stay
    t.update(r, POLICY)
    assert tracked(t)["a"] == a and t.gaps == 1
    # back, with newer ids: read from its start. A stream made anew in the same millisecond
    # as the last id read would get an id at or below it (Redis starts at <ms>-0): that is the
    # "older ids" case below, so let the clock move on first
    time.sleep(0.003)
    add(r, node=h, key=k, point=p)
    t.update(r, POLICY)
    assert tracked(t)["a"]["requests"] == a["requests"] + 1 and t.gaps == 2
    # replaced by a stream whose ids are older than the last one read (a restored
    # snapshot): what it holds counts as read, reading goes on after its last id
    r.delete("kvgate:log")
    old_id = int((time.time() - 60) * 1000)
    r.xadd("kvgate:log", {"ts": f"{time.time() - 60:.3f}", "pool": "a", "node": h, "status": "200",
                          "cache": "BYPASS", "kind": "session", "key": k, "point": str(p), "tries": "1",
                          "home": h}, id=f"{old_id}-0")
    t.update(r, POLICY)
    assert tracked(t)["a"]["requests"] == a["requests"] + 1 and t.gaps == 3
    assert t.stats()["cursor"] == f"{old_id}-0"
    add(r, node=h, key=k, point=p, n=2)
    t.update(r, POLICY)
    assert tracked(t)["a"]["requests"] == a["requests"] + 3 and t.gaps == 3
    # trimmed to nothing (the stream stays, empty): one gap, then up to date
    add(r, node=h, key=k, point=p, n=2)
    r.xtrim("kvgate:log", maxlen=0)
    t.update(r, POLICY)
    assert t.gaps == 4 and not t.lagging and t.stats()["cursor"] == r.xinfo_stream("kvgate:log")[
        "last-generated-id"].decode()
    t.update(r, POLICY)
    assert t.gaps == 4 and tracked(t)["a"]["requests"] == a["requests"] + 3


def test_tracker_key_cap_folds_the_tail(r: redis.Redis) -> None:
    ts = (int(time.time()) // 60) * 60 + 1  # one bucket
    keys = [session(f"cap{i}") for i in range(8)]
    for i, (k, p, h) in enumerate(keys):
        add(r, node=h, key=k, point=p, n=8 - i, ts=ts)  # 8, 7, ... 1 requests
    t = TrafficTracker(max_keys=5)
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert [k["requests"] for k in a["hot_keys"]] == [8, 7, 6, 5, 4]
    assert a["hot_keys"][0]["share"] == 8 / 36 and a["requests"] == a["routed"] == a["at_home"] == 36
    assert t.stats()["folded"] == 3 + 2 + 1 and t.stats()["bucket_keys"] == t.stats()["window_keys"] == 5
    # a new key with more requests than the 5th enters; the 5th is folded (its 4 requests stay in the totals)
    k, p, h = session("cap-new")
    add(r, node=h, key=k, point=p, n=10, ts=ts)
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert [x["requests"] for x in a["hot_keys"]] == [10, 8, 7, 6, 5] and a["hot_keys"][0]["key"] == k
    assert a["hot_keys"][0]["share"] == 10 / 46 and t.stats()["folded"] == 10
    assert t.stats()["bucket_keys"] == t.stats()["window_keys"] == 5


def test_tracker_policy_change(r: redis.Redis) -> None:
    t = TrafficTracker()
    mixed(r, "p")
    t.update(r, POLICY)
    before = tracked(t)
    assert before["b"]["requests"] == 1
    k, p, _ = session("p1")
    ring2 = pool_ring(POLICY_B_GONE, "a", {})
    add(r, node=ring2.home(p), key=k, point=p, n=2, home=ring2.home(p))
    add(r, pool="b", node="b1", kind="prefix")  # b left the policy: ignored
    add(r, pool="c", node="c1", key=k, point=p)
    t.update(r, POLICY_B_GONE)
    after = tracked(t, policy=POLICY_B_GONE)
    assert list(after) == ["a", "c"]
    a = after["a"]
    # a keeps its buckets: the old entries were judged on the old ring, the new on the new one
    assert a["requests"] == before["a"]["requests"] + 2
    assert a["at_home"] == before["a"]["at_home"] + 2 and a["routed"] == before["a"]["routed"] + 2
    assert after["c"]["requests"] == 1 and after["c"]["at_home"] == 1
    assert tracked(t)["b"]["requests"] == 0  # b's buckets were dropped


def test_tracker_home_is_judged_at_the_update(r: redis.Redis) -> None:
    """Entries keep the judgement of the update that read them: a later weight change moves
    keys' homes for the entries read after it only."""
    heavy = {**BASE, "a1": 1000}
    ring_heavy = pool_ring(POLICY, "a", heavy)
    moved = [s for s in (session(f"h{i}") for i in range(200)) if ring_heavy.home(s[1]) != s[2]][:5]
    assert len(moved) == 5
    t = TrafficTracker()
    for k, p, h in moved:
        add(r, node=h, key=k, point=p)
    t.update(r, POLICY)
    for k, p, _ in moved:
        add(r, node=ring_heavy.home(p), key=k, point=p, home=ring_heavy.home(p))
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert (a["routed"], a["at_home"]) == (10, 10)
    # issue 10: traffic_view reads the logged homes too, so it keeps each entry's judgement
    # (it judged all on the weights given when it rebuilt the ring itself: 5)
    assert view(r)["a"]["at_home"] == 10
    assert {x["home"] for x in a["hot_keys"]} == {ring_heavy.home(p) for _, p, _ in moved}  # the newest


def test_tracker_failed_update_changes_nothing(r: redis.Redis, monkeypatch) -> None:
    t = TrafficTracker()
    mixed(r, "f")
    t.update(r, POLICY)
    before, stats = tracked(t), t.stats()
    dead = redis.Redis(port=_free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.RedisError):
        t.update(dead, POLICY)
    assert tracked(t) == before and t.stats() == stats
    # Redis failing after a page was read and aggregated: still nothing changes
    monkeypatch.setattr(traffic, "PAGE", 3)
    real = traffic._page
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise redis.ConnectionError("Connection reset by peer")
        return real(*args, **kw)

    monkeypatch.setattr(traffic, "_page", failing)
    mixed(r, "g")
    with pytest.raises(redis.ConnectionError):
        t.update(r, POLICY)
    assert tracked(t) == before and t.stats() == stats
    t.update(r, POLICY)  # the same entries again, once
    assert tracked(t) == view(r) and t.stats()["entries_read"] == 22
    # a first update that fails leaves the tracker to backfill next time
    t2 = TrafficTracker()
    with pytest.raises(redis.RedisError):
        t2.update(dead, POLICY)
    assert t2.stats()["cursor"] is None and t2.stats()["updates"] == 0


def test_tracker_starts_over_after_a_pause_longer_than_the_window(r: redis.Redis, monkeypatch) -> None:
    now = time.time()
    k, p, h = session("w9")
    for i in range(3):  # logged 5 minutes ago (the stream ids say so too)
        r.xadd("kvgate:log", {"ts": f"{now - 300:.3f}", "pool": "a", "node": h, "status": "200", "cache": "BYPASS",
                              "kind": "session", "key": k, "point": str(p), "tries": "1", "home": h},
               id=f"{int((now - 300) * 1000)}-{i}")
    t = TrafficTracker(window_s=60)
    t.update(r, POLICY, now=now - 290)
    assert tracked(t, now=now - 290)["a"]["requests"] == 3
    spy = PageSpy(monkeypatch)
    add(r, node=h, key=k, point=p, ts=now)
    t.update(r, POLICY, now=now + 1)
    # the last id read is older than the window: a backfill (newest first), not the backlog
    assert [c[3] for c in spy.calls] == [True]
    assert tracked(t, now=now + 1)["a"]["requests"] == 1 and t.stats()["buckets"] == 1


def test_tracker_concurrent_updates_count_once(r: redis.Redis, redis_server: int) -> None:
    import threading

    t = TrafficTracker()
    mixed(r, "c")
    t.update(r, POLICY)
    for i in range(300):
        k, p, h = session(f"c{i % 7}")
        add(r, node=h, key=k, point=p)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            t.update(redis.Redis(port=redis_server), POLICY)
            t.view(POLICY)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    assert tracked(t) == view(r) and t.stats()["entries_read"] == 11 + 300


def test_a_field_holding_the_packing_separators_is_emptied(r: redis.Redis) -> None:
    k, p, h = session("sep")
    add(r, node=h, key=k, point=p, kind="x\x1fy\x1ez")
    add(r, node=h, key=k, point=p, kind="session")
    a = view(r)["a"]
    assert (a["requests"], a["at_home"]) == (2, 2) and a["hot_keys"][0]["kind"] == "session"
    add(r, node=h, key=k, point=p, kind="\x1e")  # newest: its kind is emptied
    assert view(r)["a"]["hot_keys"][0]["kind"] == "" and view(r)["a"]["requests"] == 3


def test_an_entry_with_a_non_finite_ts_counts_at_its_stream_time(r: redis.Redis) -> None:
    """A corrupt ``ts`` (nan, inf, 1e400) must not break the page for good: the entry's
    stream id (its arrival, ms) stands in for it."""
    key, point, home = session("nan")
    for bad in ("nan", "inf", "1e400", "-inf"):
        r.xadd("kvgate:log", {"ts": bad, "pool": "a", "node": home, "status": "200", "cache": "MISS",
                              "kind": "session", "fp": "", "key": key, "ms": "5", "point": str(point), "tries": "1",
                              "home": home})
    t = TrafficTracker(window_s=900)
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert a["requests"] == 4 and a["at_home"] == 4
    assert view(r)["a"]["requests"] == 4


def test_entries_without_a_logged_home_are_unknown(r: redis.Redis) -> None:
    """Issue 10: the figures come from the logged ``node`` and ``home``. An entry with a point
    but no ``home`` (written by a gateway before the field) is unknown: counted in requests and
    cache, not in routed/at_home; no ring is rebuilt for it. A HIT logs no home: the hot key's
    home is the one logged by its other entries."""
    k, p, h = session("unknown")
    add(r, node=h, key=k, point=p, n=3, no_home=True)  # before the field
    add(r, node=h, key=k, point=p, n=2)  # logged with its home
    add(r, node="cache", cache="HIT", key=k, point=p, tries=0)  # newest: a HIT, no home
    a = view(r)["a"]
    assert a["requests"] == 6 and a["cache"]["HIT"] == 1
    assert (a["routed"], a["at_home"]) == (2, 2)
    (hot,) = a["hot_keys"]
    assert hot["requests"] == 6 and hot["home"] == h and hot["nodes"] == {h: 5, "cache": 1}
    # the same through a tracker reading oldest first
    t = TrafficTracker()
    t.update(r, POLICY)
    add(r, node=other_than(h), key=k, point=p, home=h, tries=2)  # failed over: away from home
    add(r, node="cache", cache="HIT", key=k, point=p, tries=0)
    t.update(r, POLICY)
    a = tracked(t)["a"]
    assert (a["routed"], a["at_home"]) == (3, 2) and a["hot_keys"][0]["home"] == h
