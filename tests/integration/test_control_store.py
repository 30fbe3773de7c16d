"""The control plane's Redis state (:mod:`kvgate.control.store`) against a real redis-server
on a free port: node records, reports, pools, the events stream (newest first, filters,
paging, cap), policy versions (newest first, cap) and behaviour with Redis gone."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from gwfixtures import RedisServer, _start_redis, free_port
from kvgate.control.store import PREFIX, Store, StoreError

pytestmark = pytest.mark.integration
RedisProc = RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    server = _start_redis(tmp_path_factory.mktemp("store"))
    yield server
    server.stop()


@pytest.fixture
def store(redis_server: RedisProc) -> Store:
    s = Store(redis_server.url)
    s.r.flushdb()
    return s


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


# ------------------------------------------------------------------ nodes, reports, pools
def test_node_put_get_delete(store: Store) -> None:
    assert store.nodes() == {}
    a = {"id": "a", "state": "active", "weights": [1, 2], "health": {"fails": 0}}
    b = {"id": "b-2", "state": "drained", "drain": None}
    store.put_node(a)
    store.put_node(b)
    assert store.nodes() == {"a": a, "b-2": b}
    store.put_node({**a, "state": "draining"})  # overwrite
    assert store.nodes()["a"]["state"] == "draining"
    store.put_report("a", {"engine": {"waiting": 3}}, received_at=123.5)
    store.delete_node("a")
    assert store.nodes() == {"b-2": b}
    assert store.reports(["a", "b-2"]) == {}  # the report went with the node
    store.delete_node("nosuch")  # no error


def test_many_nodes_are_all_listed(store: Store) -> None:
    for i in range(1200):  # more than one SCAN page
        store.put_node({"id": f"n{i}", "state": "active"})
    nodes = store.nodes()
    assert len(nodes) == 1200 and nodes["n1199"] == {"id": "n1199", "state": "active"}


def test_reports(store: Store) -> None:
    assert store.reports([]) == {}
    store.put_report("a", {"engine": {"waiting": 3}}, received_at=100.0)
    store.put_report("a", {"engine": {"waiting": 4}}, received_at=101.0)
    assert store.reports(["a", "b"]) == {"a": {"received_at": 101.0, "report": {"engine": {"waiting": 4}}}}
    ttl = store.r.ttl(PREFIX + "report:a")
    assert 0 < ttl <= 24 * 3600


def test_pools(store: Store) -> None:
    assert store.pools([]) == {}
    assert store.pools(["p"]) == {}
    store.put_pool("p", {"degraded": True, "since": 5.0})
    assert store.pools(["p", "q"]) == {"p": {"degraded": True, "since": 5.0}}


# ------------------------------------------------------------------ events
def test_events_newest_first_with_fields(store: Store) -> None:
    assert store.events() == []
    first = store.add_event("state", "a: active → draining", node="a", pool="p", from_state="active")
    second = store.add_event("reload", "gateway config reloaded", result="reloaded")
    assert first["id"] and second["id"] and first["id"] != second["id"]
    evs = store.events()
    assert [e["id"] for e in evs] == [second["id"], first["id"]]
    assert evs[1] == {"id": first["id"], "ts": first["ts"], "kind": "state", "message": "a: active → draining",
                      "node": "a", "pool": "p", "data": {"from_state": "active"}}
    assert evs[0]["node"] is None and evs[0]["data"] == {"result": "reloaded"}


def test_events_filters_and_limit(store: Store) -> None:
    kinds = ["state", "reload", "reload_failed", "warmup", "policy_rejected"]
    for i in range(50):
        store.add_event(kinds[i % 5], f"event {i}", node=f"n{i % 3}", i=i)
    evs = store.events(limit=1000)
    assert [e["data"]["i"] for e in evs] == list(range(49, -1, -1))
    assert [e["data"]["i"] for e in store.events(limit=3)] == [49, 48, 47]
    by_node = store.events(limit=1000, node="n1")
    assert [e["data"]["i"] for e in by_node] == [i for i in range(49, -1, -1) if i % 3 == 1]
    # kind is a prefix: reload matches reload and reload_failed, nothing else
    reload = store.events(limit=1000, kind="reload")
    assert {e["kind"] for e in reload} == {"reload", "reload_failed"} and len(reload) == 20
    assert {e["kind"] for e in store.events(limit=1000, kind="reload_failed")} == {"reload_failed"}
    both = store.events(limit=1000, node="n0", kind="state")
    assert [e["data"]["i"] for e in both] == [i for i in range(49, -1, -1) if i % 5 == 0 and i % 3 == 0]
    assert store.events(node="nosuch") == []


def test_events_paging_with_before(store: Store) -> None:
    for i in range(25):
        store.add_event("state" if i % 2 else "reload", f"event {i}", node="a" if i % 2 else "b", i=i)
    seen: list[int] = []
    before = None
    while True:
        page = store.events(limit=7, before=before)
        if not page:
            break
        assert len(page) <= 7
        seen += [e["data"]["i"] for e in page]
        before = page[-1]["id"]
    assert seen == list(range(24, -1, -1))  # every event once, in order, no overlap
    # paging a filtered view
    page1 = store.events(limit=4, node="a")
    page2 = store.events(limit=4, node="a", before=page1[-1]["id"])
    assert [e["data"]["i"] for e in page1 + page2] == [23, 21, 19, 17, 15, 13, 11, 9]


def test_sparse_filter_reads_past_one_batch(store: Store) -> None:
    for i in range(1200):  # the store reads the stream 500 entries at a time
        store.add_event("tick", f"e{i}", node="rare" if i % 100 == 0 else "common", i=i)
    rare = store.events(limit=100, node="rare")
    assert [e["data"]["i"] for e in rare] == list(range(1100, -1, -100))


def test_events_stream_is_capped(store: Store) -> None:
    for i in range(1000):
        store.add_event("tick", f"e{i}", keep=100, i=i)
    length = store.r.xlen(PREFIX + "events")
    # XADD MAXLEN ~ trims whole stream nodes (100 entries each): at least 100 kept, never much more
    assert 100 <= length <= 200, length
    evs = store.events(limit=10000)
    assert len(evs) == length
    assert evs[0]["data"]["i"] == 999  # the oldest were dropped, not the newest


# ------------------------------------------------------------------ versions
def test_versions_numbered_newest_first_and_capped(store: Store) -> None:
    assert store.versions() == [] and store.latest_version() is None
    v1 = store.add_version("a: 1\n", "d1", "test", keep=3)
    assert v1["version"] == 1 and v1["yaml"] == "a: 1\n" and v1["digest"] == "d1" and v1["source"] == "test"
    for i in range(2, 7):
        store.add_version(f"a: {i}\n", f"d{i}", "test", keep=3)
    versions = store.versions()
    assert [v["version"] for v in versions] == [6, 5, 4]  # newest first, only `keep` of them
    assert [v["yaml"] for v in versions] == ["a: 6\n", "a: 5\n", "a: 4\n"]
    assert store.latest_version()["version"] == 6
    # numbers are never reused after trimming
    assert store.add_version("a: 7\n", "d7", "test", keep=3)["version"] == 7
    assert [v["version"] for v in store.versions()] == [7, 6, 5]


# ------------------------------------------------------------------ Redis down
def test_add_event_never_raises_when_redis_is_unreachable() -> None:
    s = Store(dead_url(), timeout_s=0.5)
    ev = s.add_event("state", "a: x → y", node="a", k=1)
    assert ev["id"] is None and ev["kind"] == "state" and ev["node"] == "a" and ev["data"] == {"k": 1}
    assert s.ping() is False


def test_other_calls_raise_store_error_when_redis_is_unreachable() -> None:
    s = Store(dead_url(), timeout_s=0.5)
    for call in (s.nodes, s.versions, s.latest_version, s.events, lambda: s.put_node({"id": "a"}),
                 lambda: s.add_version("x", "d", "t"), lambda: s.reports(["a"]), lambda: s.put_pool("p", {}),
                 lambda: s.delete_node("a"), lambda: s.put_report("a", {}, 1.0), lambda: s.pools(["p"])):
        with pytest.raises(StoreError, match=r"redis redis://127\.0\.0\.1:\d+/0: "):
            call()


def test_store_survives_redis_stopping(tmp_path: Path) -> None:
    server = _start_redis(tmp_path)
    try:
        s = Store(server.url, timeout_s=0.5)
        assert s.add_event("state", "before")["id"]
        s.put_node({"id": "a", "state": "active"})
    finally:
        server.stop()
    assert s.add_event("state", "after")["id"] is None  # no exception
    with pytest.raises(StoreError):
        s.nodes()
    assert s.ping() is False
