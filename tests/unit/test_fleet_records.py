"""Typed fleet records: the JSON the store has always held loads and is written back with the
same field names (a running fleet's Redis data survives the upgrade), unknown fields survive,
and the event kinds keep their stored strings."""

from __future__ import annotations

import json

from kvgate.fleet.events import EventKind
from kvgate.fleet.records import Drain, NodeRecord, PoolState, Ramp, node_records, pool_states

# a record as the control plane of issue 9 wrote it (plane._adopt, a drain's first round, a ramp)
STORED = {
    "id": "n1", "pool": "default", "url": "http://127.0.0.1:9001", "state": "draining", "since": 1700000000.5,
    "reason": "drain requested by operator", "base_weight": 2, "target_weight": 180,
    "health": {"fails": 0, "passes": 12, "last_error": None, "last_check": 1700000001.0,
               "passive": {"answers": 40.0, "errors": 0.0, "seconds": 30.0}},
    "ramp": None,
    "drain": {"started": 1700000000.5, "deadline": 1700000300.5, "zero_checks": 1, "inflight_gateway": 0.0,
              "inflight_engine": 2.0, "timed_out": False, "engine_figures": None,
              "decided_on": "gateway and engine", "gateway_stuck": None},
    "warmup": {"status": "ok", "started_at": 1699999990.0, "result": {"sent": 3}, "progress": [3, 3]},
    "engine_start_time": 1699990000.0, "resume_state": None, "has_agent": True, "last_weight_change": None,
    "computed_weight": 180, "engine_start_seen_at": 1700000001.0,
}


def test_stored_node_record_round_trips() -> None:
    rec = NodeRecord.from_json(json.loads(json.dumps(STORED)))
    assert rec.state == "draining" and rec.drain is not None and rec.drain.inflight_engine == 2.0
    assert rec.health.passes == 12 and rec.warmup is not None and rec.warmup.progress == [3, 3]
    assert rec.to_json() == STORED
    assert json.loads(json.dumps(rec.to_json(), sort_keys=True)) == STORED


def test_a_new_record_is_stored_as_before() -> None:
    rec = NodeRecord(id="n2", pool="p", url="http://h:1", state="joining", since=5.0, reason="added to the policy",
                     base_weight=1)
    assert rec.to_json() == {
        "id": "n2", "pool": "p", "url": "http://h:1", "state": "joining", "since": 5.0,
        "reason": "added to the policy", "base_weight": 1, "target_weight": None,
        "health": {"fails": 0, "passes": 0, "last_error": None, "last_check": None},
        "ramp": None, "drain": None, "warmup": None, "engine_start_time": None, "resume_state": None,
        "has_agent": False, "last_weight_change": None}


def test_old_and_unknown_fields() -> None:
    # a minimal old record loads with defaults; a field of a newer version is kept as it was
    rec = NodeRecord.from_json({"id": "a", "state": "active", "future": {"x": 1},
                                "ramp": {"step": 1, "since": 2.0, "held": None, "baseline": [3, 1], "new": 7}})
    assert rec.base_weight == 1 and rec.health.fails == 0 and rec.ramp == Ramp(1, 2.0, None, (3.0, 1.0), {"new": 7})
    out = rec.to_json()
    assert out["future"] == {"x": 1} and out["ramp"]["new"] == 7 and out["ramp"]["baseline"] == [3.0, 1.0]
    # a drain before its first round has none of the round's fields
    d = Drain(started=1.0, deadline=2.0)
    assert set(d.to_json()) == {"started", "deadline", "zero_checks", "inflight_gateway", "inflight_engine",
                                "timed_out"}
    assert Drain.from_json({**d.to_json(), "gateway_stuck": [3, 4], "decided_on": "gateway"}).gateway_stuck == (3.0, 4.0)


def test_evolve_copies() -> None:
    rec = NodeRecord.from_json(STORED)
    assert rec.serving is False and rec.evolve(state="active").serving is True and rec.state == "draining"


def test_pool_state_json_and_coercion() -> None:
    stored = {"degraded": True, "since": 5.0, "above_since": None, "below_since": 7.0, "last_weight_change": None,
              "mean_waiting": 3.5}
    assert PoolState.from_json(stored).to_json() == stored
    assert PoolState.from_json(None) == PoolState()
    assert pool_states({"p": {"degraded": True}})["p"].degraded is True
    assert node_records({"x": {"state": "active"}})["x"].id == "x"


def test_event_kinds_keep_their_stored_strings() -> None:
    assert {k.value for k in EventKind} == {
        "state", "node_added", "node_removed", "policy_applied", "policy_rejected", "cache_invalidated", "apikey_created", "apikey_revoked",
        "batch_cancelled", "reload", "reload_failed", "runtime_pushed", "engine_restarted", "store_back", "failover",
        "eject_skipped", "warmup", "ramp", "ramp_held", "degrade", "weight", "drain_failed", "gateway_lost",
        "gateway_back"}
    assert json.dumps({"kind": EventKind.RUNTIME_PUSHED}) == '{"kind": "runtime_pushed"}'
    # the store's prefix filter: a pushed runtime is not a reload
    assert not EventKind.RUNTIME_PUSHED.startswith("reload") and EventKind.RELOAD_FAILED.startswith("reload")
