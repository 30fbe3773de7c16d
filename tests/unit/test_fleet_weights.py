"""The weight step and the weight arithmetic (:mod:`kvgate.fleet.weights`): targets follow
capacity × load, damped; 0 means down; serving weights keep a drained node's place on the ring."""

from __future__ import annotations

from kvgate.fleet.changes import Event, Save, SavePool
from kvgate.fleet.records import NodeRecord, PoolState, Ramp
from kvgate.fleet.runtime import runtime_for
from kvgate.fleet.weights import DOWN, WEIGHT_SCALE, node_weight, serving_weights, target_of, weights_step
from kvgate.policy.loader import parse_policy

NOW = 1000.0


def policy(dynamic: bool = True, **weights):
    return parse_policy({"version": 1, "pools": [{"name": "p1", "models": ["m1"], "nodes": [
        {"id": "a", "url": "http://127.0.0.1:9001", "weight": 2},
        {"id": "b", "url": "http://127.0.0.1:9002"},
    ]}], "ramp": {"steps": [0.25, 0.5, 1.0]}, "weights": {"dynamic": dynamic, **weights}})


def recs(**targets: int | None) -> dict[str, NodeRecord]:
    base = {"a": 2, "b": 1}
    return {n: NodeRecord(id=n, pool="p1", state="active", base_weight=base[n], target_weight=t)
            for n, t in targets.items()}


def report(waiting: float, age: float = 0.0) -> dict:
    return {"received_at": NOW - age, "report": {"engine": {"waiting": waiting, "kv_cache_usage": 0.0}}}


def test_first_targets_are_set_without_damping_and_not_stored() -> None:
    pools = {"p1": PoolState()}
    out = weights_step(recs(a=None, b=None), pools, {}, policy(), NOW)
    assert out == [Save(recs(a=None)["a"].evolve(target_weight=200, computed_weight=200), stored=False),
                   Save(recs(b=None)["b"].evolve(target_weight=100, computed_weight=100), stored=False)]


def test_a_loaded_node_loses_weight_once_past_the_threshold() -> None:
    p = policy()
    # b waits 16 (queue_high): factor min_factor 0.25 → 25; stored, with an event and the pool's change time
    out = weights_step(recs(a=200, b=100), {"p1": PoolState()}, {"a": report(0), "b": report(16)}, p, NOW)
    saves = [c for c in out if isinstance(c, Save)]
    assert [(s.record.id, s.record.target_weight, s.stored) for s in saves] == [("a", 200, False), ("b", 25, True)]
    assert saves[1].record.last_weight_change == NOW
    ev = next(c for c in out if isinstance(c, Event))
    assert (ev.kind, ev.node, ev.data) == ("weight", "b", {"old": 100, "new": 25})
    assert ev.message == "b: target weight 100 → 25 (capacity × load)"
    assert out[-1] == SavePool("p1", PoolState(last_weight_change=NOW), stored=False)
    # within min_interval_s of the pool's last change: computed, not applied
    again = weights_step(recs(a=200, b=100), {"p1": PoolState(last_weight_change=NOW - 1)},
                         {"b": report(16)}, p, NOW)
    assert not [c for c in again if isinstance(c, Event)]
    assert [c.record.target_weight for c in again if isinstance(c, Save) and c.record.id == "b"] == [100]
    # a stale report counts as none (factor 1): nothing moves
    stale = weights_step(recs(a=200, b=100), {"p1": PoolState()}, {"b": report(16, age=60)}, p, NOW)
    assert not [c for c in stale if isinstance(c, Event)]


def test_static_weights_and_unreadable_reports() -> None:
    out = weights_step(recs(a=150, b=100), {"p1": PoolState()}, {"b": report(16)}, policy(dynamic=False), NOW)
    # a back to its base (stored, with an event); b's computed figure kept in memory
    assert [(c.record.id, c.record.target_weight, c.stored) for c in out if isinstance(c, Save)] == [
        ("b", 100, False), ("a", 200, True)]
    # reports None (Redis down): only missing targets are set
    assert weights_step(recs(a=150, b=None), {"p1": PoolState()}, None, policy(), NOW) == [
        Save(recs(b=None)["b"].evolve(target_weight=100), stored=False)]


def test_zero_means_down_and_ramp_shares() -> None:
    assert WEIGHT_SCALE == 100 and DOWN == 0
    steps = [0.25, 0.5, 1.0]
    a = recs(a=180)["a"]
    assert node_weight(a, 2, steps, fresh_fleet=False) == 180
    assert node_weight(a.evolve(state="ramping", ramp=Ramp(step=1)), 2, steps, False) == 90
    assert node_weight(a.evolve(state="ramping", ramp=Ramp(step=7)), 2, steps, False) == 180
    for state in ("joining", "warming", "draining", "drained", "ejected"):
        assert node_weight(a.evolve(state=state), 2, steps, False) == DOWN
    assert node_weight(None, 2, steps, fresh_fleet=True) == 200 and node_weight(None, 2, steps, False) == DOWN
    # a base weight changed in the policy beats a stale target
    assert target_of(a, 3) == 300 and target_of(a.evolve(target_weight=None), 2) == 200


def test_serving_weights_keep_a_down_node_at_its_target() -> None:
    p = policy()
    r = recs(a=180, b=90)
    assert serving_weights(p, {"a": 180, "b": 0}, r) == {"a": 180, "b": 90}
    assert serving_weights(p, {}, {}) == {"a": 200, "b": 100}


def test_runtime_for_typed_and_stored_records_alike() -> None:
    p = policy()
    r = recs(a=180, b=90)
    r["b"] = r["b"].evolve(state="draining")
    typed = runtime_for(p, r, {"p1": PoolState(degraded=True)}, namespace_floor=4)
    stored = runtime_for(p, {k: v.to_json() for k, v in r.items()}, {"p1": {"degraded": True}}, namespace_floor=4)
    assert typed == stored and dict(typed.weights) == {"a": 180, "b": 0}
    assert dict(typed.balancers) == {"p1": "least_conn"} and typed.namespace_version == 4
    assert runtime_for(p, r, {}, namespace_floor=0).namespace_version is None
