"""The health step (:func:`kvgate.fleet.health.health_step`) and what comes around it — recovery,
engine restarts, the report grace, a finished warm-up — as pure functions over records."""

from __future__ import annotations

from kvgate.control.warmup import WarmupResult
from kvgate.control.warmups import finished_changes
from kvgate.fleet.changes import Checked, Event, ResetPassive, Save, StartWarmup, Transition
from kvgate.fleet.health import (HealthInputs, PassiveWindows, StoreWatch, engine_start_changes, health_step,
                                 in_report_grace, report_window, store_back_event)
from kvgate.fleet.ramp import Counts
from kvgate.fleet.records import Health, NodeRecord, Ramp
from kvgate.policy.loader import parse_policy

T0 = 1000.0
POLICY = parse_policy({"version": 1, "pools": [{"name": "p", "models": ["m"], "nodes": [
    {"id": f"n{i}", "url": f"http://127.0.0.1:900{i}"} for i in range(1, 4)]}]})
# eject_after 3, recover_after 2, missing_reports 3 × report_interval_s 2, passive 50 % of ≥ 20


def fleet(**states: str) -> dict[str, NodeRecord]:
    return {n: NodeRecord(id=n, pool="p", url="http://x", state=s, since=T0) for n, s in states.items()}


def inputs(probes: dict, reports: dict | None = None, grace: bool = False, passive: PassiveWindows | None = None):
    return HealthInputs(probes, reports or {}, True, grace, True, passive or PassiveWindows())


def of(changes, cls):
    return [c for c in changes if isinstance(c, cls)]


def test_three_failed_checks_eject_an_active_node() -> None:
    recs = fleet(n1="active", n2="active", n3="active")
    recs["n1"] = recs["n1"].evolve(health=Health(fails=2), engine_start_time=5.0)
    out = health_step(recs, inputs({"n1": "health probe failed: ConnectTimeout", "n2": None}), POLICY, T0 + 1)
    assert of(out, Checked) == [Checked("n1", False), Checked("n2", True)]
    assert ResetPassive("n1") in out
    t = of(out, Transition)[0]
    assert (t.from_state, t.record.state, t.record.resume_state, t.record.engine_start_time_at_eject) == (
        "active", "ejected", "active", 5.0)
    assert t.record.reason == "3 failed health checks: health probe failed: ConnectTimeout"
    assert t.record.health.fails == 3 and t.record.health.last_check == T0 + 1
    # n2 passed: stored with its count, n3 was not probed this round
    assert [s.record.health.passes for s in of(out, Save)] == [1]
    assert not [c for c in out if getattr(c, "node", None) == "n3"]


def test_the_last_serving_node_is_kept() -> None:
    recs = fleet(n1="active", n2="draining", n3="ejected")
    recs["n1"] = recs["n1"].evolve(health=Health(fails=2))
    out = health_step(recs, inputs({"n1": "health probe answered HTTP 500"}), POLICY, T0)
    assert not of(out, Transition)
    ev = of(out, Event)[0]
    assert ev.kind == "eject_skipped" and "the last serving node of pool p" in ev.message


def test_an_ejection_earlier_in_the_round_counts_for_the_next_node() -> None:
    recs = fleet(n1="active", n2="active", n3="drained")
    for n in ("n1", "n2"):
        recs[n] = recs[n].evolve(health=Health(fails=2))
    out = health_step(recs, inputs({"n1": "down", "n2": "down"}), POLICY, T0)
    assert [t.record.id for t in of(out, Transition)] == ["n1"]
    assert of(out, Event)[0].node == "n2"


def test_passive_health_is_capped_at_its_share_of_the_pool() -> None:
    w = PassiveWindows()
    for node_id in ("n1", "n2"):
        w.add(T0, [node_id], {node_id: 0}, {node_id: 0}, 30)
        w.add(T0 + 10, [node_id], {node_id: 40}, {node_id: 40}, 30)
    recs = fleet(n1="active", n2="active", n3="ejected")  # 1 of 3 ejected: max(1, int(3 × 0.5)) = 1
    for n in ("n1", "n2"):
        recs[n] = recs[n].evolve(health=Health(fails=2))
    out = health_step(recs, inputs({"n1": None, "n2": None}, passive=w), POLICY, T0 + 10)
    assert not of(out, Transition) and of(out, Checked) == [Checked("n1", False), Checked("n2", False)]
    skipped = of(out, Event)
    assert len(skipped) == 2 and "max_ejected_share 0.5" in skipped[0].message
    assert "gateway: 5xx share 100% of 40 answers" in of(out, Save)[0].record.health.last_error


def test_agent_reports_missing_or_unhealthy() -> None:
    recs = fleet(n1="active", n2="active", n3="active")
    recs = {k: v.evolve(has_agent=True) for k, v in recs.items()}
    reports = {"n2": {"received_at": T0 - 100, "report": {}},
               "n3": {"received_at": T0, "report": {"engine": {"healthy": False, "error": "HTTP 503"}}}}
    out = health_step(recs, inputs({"n1": None, "n2": None, "n3": None}, reports), POLICY, T0)
    errors = {s.record.id: s.record.health.last_error for s in of(out, Save)}
    assert errors == {"n1": "no agent report", "n2": "no agent report for 100s", "n3": "agent: engine HTTP 503"}
    # in the report grace a missing report is unknown; an unreadable store is not judged either
    graced = health_step(recs, inputs({"n1": None, "n2": None}, reports, grace=True), POLICY, T0)
    assert of(graced, Checked) == [Checked("n1", True), Checked("n2", True)]
    unread = health_step(recs, HealthInputs({"n1": None}, {}, False, False, True, PassiveWindows()), POLICY, T0)
    assert of(unread, Checked) == [Checked("n1", True)]


def test_joining_warms_on_its_first_pass_and_ejected_recovers() -> None:
    recs = fleet(n1="joining", n2="ejected", n3="ejected")
    same = dict(health=Health(passes=1), resume_state="ramping", engine_start_time=7.0,
                engine_start_time_at_eject=7.0, engine_start_seen_at=T0 + 1, ramp=Ramp(2, T0 - 50))
    recs["n2"] = recs["n2"].evolve(**same)
    recs["n3"] = recs["n3"].evolve(**{**same, "engine_start_time": 9.0})
    out = health_step(recs, inputs({"n1": None, "n2": None, "n3": None}), POLICY, T0 + 5)
    moves = {t.record.id: (t.record.state, t.record.reason) for t in of(out, Transition)}
    assert moves["n1"] == ("warming", "passed its health check")
    assert moves["n2"] == ("ramping", "recovered after 2 passed checks; same engine process, cache kept")
    assert moves["n3"] == ("warming", "recovered after 2 passed checks (engine restarted, cache is empty)")
    assert next(t for t in of(out, Transition) if t.record.id == "n2").record.ramp.since == T0 + 5
    assert of(out, StartWarmup) == [StartWarmup("n1"), StartWarmup("n3")]
    assert ResetPassive("n2") in out and ResetPassive("n3") in out


def test_recovery_waits_for_a_report_since_the_ejection() -> None:
    rec = fleet(n1="ejected")["n1"].evolve(health=Health(passes=1), has_agent=True, resume_state="active",
                                          engine_start_time=7.0, engine_start_time_at_eject=7.0,
                                          engine_start_seen_at=T0 - 10)
    out = health_step({"n1": rec}, inputs({"n1": None}, grace=True), POLICY, T0)
    assert not of(out, Transition) and of(out, Save)[0].record.health.passes == 2
    # after missing_reports × report_interval_s (6 s = 3 more checks at 2 s) it cannot tell: warming
    later = rec.evolve(health=Health(passes=5))
    t = of(health_step({"n1": later}, inputs({"n1": None}, grace=True), POLICY, T0), Transition)[0]
    assert t.record.state == "warming" and "cannot tell whether the engine kept its cache" in t.record.reason


def test_engine_start_from_reports() -> None:
    rec = fleet(n1="active")["n1"]
    first = engine_start_changes(rec, {"engine": {"start_time": 5.0}}, T0)
    assert first == [Save(rec.evolve(engine_start_time=5.0, engine_start_seen_at=T0), stored=True)]
    rec = first[0].record
    same = engine_start_changes(rec, {"engine": {"start_time": 5.0}}, T0 + 2)
    assert len(same) == 1 and not same[0].stored and same[0].record.engine_start_seen_at == T0 + 2
    restarted = engine_start_changes(rec, {"engine": {"start_time": 6.0}}, T0 + 4)
    assert restarted[0].kind == "engine_restarted" and restarted[1].stored
    assert engine_start_changes(rec, {"engine": {}}, T0) == []


def test_report_grace_and_store_returns() -> None:
    assert report_window(POLICY) == 3 * 2.0 + 10.0  # missing reports + the agents' longest backoff
    assert in_report_grace(T0 + 16, T0, 0.0, POLICY) and not in_report_grace(T0 + 17, T0, 0.0, POLICY)
    w = StoreWatch()
    w.started_at = T0 - 100
    assert w.observe(True, "i1", T0) is None and not w.in_grace(T0, POLICY)
    assert w.observe(False, None, T0 + 1) is None
    back = w.observe(True, "i1", T0 + 5)
    assert back == {"down_s": 4.0, "emptied": False} and w.back_at == T0 + 5 and w.in_grace(T0 + 6, POLICY)
    assert w.observe(True, "i2", T0 + 7) == {"down_s": None, "emptied": True}
    ev = store_back_event({"down_s": 4.0, "emptied": True}, POLICY)
    assert ev.kind == "store_back" and ev.message.startswith("Redis is back after 4s, emptied")


def test_a_finished_warmup_ramps_a_warming_node() -> None:
    rec = fleet(n1="warming")["n1"]
    ok = WarmupResult(prompts=2, sent=3, started_at=T0)
    changes, retry = finished_changes(rec, ok, [0.1, 1.0], Counts({"n1": 4.0}, {}), T0 + 9)
    assert not retry and changes[0].kind == "warmup" and changes[0].message.startswith("n1: warm-up ok: 3/3")
    t = changes[1]
    assert isinstance(t, Transition) and t.record.state == "ramping" and t.record.ramp == Ramp(0, T0 + 9, None, (4.0, 0.0))
    assert t.record.reason == "warm-up ok; ramping at 10% of its weight" and t.record.warmup.status == "ok"
    failed = WarmupResult(prompts=2, failed=3)
    changes, retry = finished_changes(rec.evolve(health=Health(passes=4)), failed, [0.1], Counts({}, {}), T0)
    assert retry and changes[1].record.state == "warming" and changes[1].record.health.passes == 0
    changes, retry = finished_changes(fleet(n1="drained")["n1"], ok, [0.1], Counts({}, {}), T0)
    assert not retry and changes[1] == Save(changes[1].record) and changes[1].record.state == "drained"
