"""The pure parts of policy versions (:mod:`kvgate.control.versions`): which removed nodes still
have work, the 409 text that names them, and the fields a running control plane cannot change."""

from __future__ import annotations

import pytest

from kvgate.control.versions import check_restart_fields, removal_refusal, removal_work, work_text
from kvgate.fleet.records import NodeRecord
from kvgate.policy import PolicyError
from kvgate.policy.loader import parse_policy


def policy(*node_ids: str, **extra):
    return parse_policy({"version": 1, "pools": [{"name": "p", "models": ["m"], "nodes": [
        {"id": n, "url": f"http://127.0.0.1:{9001 + i}"} for i, n in enumerate(node_ids)]}], **extra})


NODES = {n: NodeRecord(id=n, pool="p", state=s) for n, s in
         (("n1", "active"), ("n2", "active"), ("n3", "draining"), ("n4", "drained"))}


def test_removed_nodes_with_work() -> None:
    keep_n1 = policy("n1")
    figures = {"gateway": {"ok": True, "inflight": {"n2": 10.0}}, "engine": {"n2": (9.0, None), "n4": (0.0, None)}}
    busy = removal_work(NODES, keep_n1, figures)
    # n2 has requests in flight (the larger count); n3 has not confirmed its drain; n4 is idle
    assert busy == [
        {"id": "n2", "state": "active", "inflight": 10, "inflight_gateway": 10.0, "inflight_engine": 9.0},
        {"id": "n3", "state": "draining", "inflight": 0, "inflight_gateway": 0.0, "inflight_engine": None}]
    assert work_text(busy[0]) == "active, 10 request(s) in flight: 10 at the gateway, 9 at the engine"
    # counts that could not be read are not held against a node; nothing read: judged on the state
    unread = removal_work(NODES, keep_n1, {"gateway": {"ok": False}, "engine": {}})
    assert [b["id"] for b in unread] == ["n3"] and unread[0]["inflight_gateway"] is None
    assert [b["id"] for b in removal_work(NODES, keep_n1, None)] == ["n3"]
    assert removal_work(NODES, policy("n1", "n2", "n3", "n4"), figures) == []


def test_refusal_names_each_node_and_the_ways_out() -> None:
    one = removal_refusal([{"id": "n2", "state": "active", "inflight": 3, "inflight_gateway": 3.0,
                            "inflight_engine": None}])
    assert one.startswith("node n2 (active, 3 request(s) in flight: 3 at the gateway, ? at the engine) still has "
                          "work; drain it first")
    assert "`kvgate drain n2 --wait`" in one and "`kvgate apply --force`" in one
    two = removal_refusal([{"id": i, "state": "draining", "inflight": 0, "inflight_gateway": None,
                            "inflight_engine": None} for i in ("n2", "n3")])
    assert two.startswith("nodes n2 (") and "still have work; drain them first" in two
    assert "`kvgate drain n2 --wait`; `kvgate drain n3 --wait`" in two


def test_restart_fields_are_refused() -> None:
    running = policy("n1")
    check_restart_fields(running, policy("n1", "n2"))
    with pytest.raises(PolicyError) as err:
        check_restart_fields(running, policy("n1", control={"listen": "127.0.0.1:9191"},
                                             redis={"url": "redis://127.0.0.1:6391/0"}))
    assert [i.path for i in err.value.issues] == ["control.listen", "redis.url"]
    assert "kvgate up" in err.value.issues[0].reason
