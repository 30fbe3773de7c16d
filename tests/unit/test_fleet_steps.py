"""The drain, ramp and overload steps (:mod:`kvgate.fleet`) alone: records and inputs in, a list
of changes out; no Redis, nginx or threads."""

from __future__ import annotations

from kvgate.fleet.changes import Event, Inflight, Save, SavePool, Transition
from kvgate.fleet.drain import LEAKED_COUNT_S, DrainInputs, drain_step, new_drain
from kvgate.fleet.overload import overload_step
from kvgate.fleet.ramp import Counts, new_ramp, ramp_step
from kvgate.fleet.records import NodeRecord, PoolState, Ramp
from kvgate.policy.loader import parse_policy

T0 = 1000.0


def policy(**extra):
    return parse_policy({"version": 1, "pools": [{"name": "p", "models": ["m"], "nodes": [
        {"id": "a", "url": "http://127.0.0.1:9001"}, {"id": "b", "url": "http://127.0.0.1:9002"},
    ], "overload": {"high_queue": 8, "low_queue": 2, "for_s": 5}}], **extra})


def node(node_id: str = "a", state: str = "active", **kw) -> NodeRecord:
    return NodeRecord(id=node_id, pool="p", url="http://x", state=state, since=T0, **kw)


def of(changes, cls):
    return [c for c in changes if isinstance(c, cls)]


# ------------------------------------------------------------------ drain
def draining(started: float = T0, **drain) -> dict[str, NodeRecord]:
    d = new_drain(started, policy())
    return {"a": node(state="draining", drain=d.__class__(**{**d.__dict__, **drain}))}


def test_drain_needs_two_idle_checks_after_a_second() -> None:
    p = policy()
    idle = DrainInputs({"a": 0.0}, {"a": (0.0, None)})
    # within the first second: not counted
    early = drain_step(draining(), idle, p, T0 + 0.5)
    assert of(early, Save)[0].record.drain.zero_checks == 0 and early[0] == Inflight("a", 0.0)
    first = drain_step(draining(), idle, p, T0 + 2)
    rec = of(first, Save)[0].record
    assert rec.state == "draining" and rec.drain.zero_checks == 1 and rec.drain.decided_on == "gateway and engine"
    second = drain_step({"a": rec}, idle, p, T0 + 3)
    t = of(second, Transition)[0]
    assert (t.from_state, t.record.state, t.record.reason) == ("draining", "drained", "no request in flight after 3.0s")
    # something in flight resets the count; a node whose engine was not scraped is not judged
    busy = drain_step({"a": rec}, DrainInputs({"a": 2.0}, {"a": (1.0, None)}), p, T0 + 3)
    assert of(busy, Save)[0].record.drain.zero_checks == 0 and busy[0] == Inflight("a", 2.0)
    assert drain_step({"a": rec}, DrainInputs({"a": 0.0}, {}), p, T0 + 3) == []


def test_drain_on_the_gateway_alone_and_unknown_figures() -> None:
    p = policy()
    unavailable = DrainInputs({"a": 0.0}, {"a": (None, "501 from /metrics")})
    rec = of(drain_step(draining(), unavailable, p, T0 + 2), Save)[0].record
    assert rec.drain.decided_on == "gateway" and rec.drain.engine_figures == "unavailable: 501 from /metrics"
    t = of(drain_step({"a": rec}, unavailable, p, T0 + 3), Transition)[0]
    assert "decided on the gateway's in-flight count" in t.record.reason
    # unknown (None, None) and an unreadable gateway are never idle
    for inputs in (DrainInputs({"a": 0.0}, {"a": (None, None)}), DrainInputs(None, {"a": (0.0, None)})):
        assert of(drain_step(draining(zero_checks=1), inputs, p, T0 + 5), Save)[0].record.drain.zero_checks == 0


def test_drain_leaked_count_and_timeout() -> None:
    p = policy()
    stuck = DrainInputs({"a": 3.0}, {"a": (0.0, None)})
    rec = of(drain_step(draining(), stuck, p, T0 + 2), Save)[0].record
    assert rec.drain.gateway_stuck == (3.0, T0 + 2)
    t = of(drain_step({"a": rec}, stuck, p, T0 + 2 + LEAKED_COUNT_S), Transition)[0]
    assert t.record.state == "drained" and "leaked by a crashed nginx worker" in t.record.reason
    # the count moved: the leak clock starts again
    moved = of(drain_step({"a": rec}, DrainInputs({"a": 2.0}, {"a": (0.0, None)}), p, T0 + 20), Save)[0]
    assert moved.record.drain.gateway_stuck == (2.0, T0 + 20)
    late = drain_step(draining(), DrainInputs({"a": 5.0}, {"a": (4.0, None)}), p, T0 + 600)
    t = of(late, Transition)[0]
    assert t.record.drain.timed_out and t.record.reason.startswith("drain timeout after 600s with 5 request(s)")


# ------------------------------------------------------------------- ramp
def ramping(step: int = 0, since: float = T0, baseline=(0.0, 0.0), held=None) -> dict[str, NodeRecord]:
    return {"a": node(state="ramping", ramp=Ramp(step, since, held, baseline))}


def report(waiting: float) -> dict:
    return {"received_at": T0 + 10, "report": {"engine": {"waiting": waiting}}}


def test_ramp_steps_then_active() -> None:
    p = policy()  # steps 0.1, 0.25, 0.5, 1.0 every 10 s
    counts = Counts({"a": 50.0}, {"a": 0.0})
    assert ramp_step(ramping(), counts, {}, p, T0 + 5) == []  # not yet
    out = ramp_step(ramping(), counts, {}, p, T0 + 10)
    rec = of(out, Save)[0].record
    assert rec.ramp == Ramp(1, T0 + 10, None, (50.0, 0.0))
    ev = of(out, Event)[0]
    assert (ev.kind, ev.message, ev.data) == ("ramp", "a: ramp step 2/4: 25% of its weight",
                                              {"step": 1, "fraction": 0.25})
    t = of(ramp_step(ramping(step=2), counts, {}, p, T0 + 10), Transition)[0]
    assert (t.record.state, t.record.ramp, t.record.reason) == ("active", None, "ramp complete")
    assert new_ramp(T0, counts, "a") == Ramp(0, T0, None, (50.0, 0.0))


def test_ramp_holds_on_errors_and_queue_once_per_reason() -> None:
    p = policy()
    errors = Counts({"a": 100.0}, {"a": 10.0})  # 10 % of the answers since the baseline
    out = ramp_step(ramping(), errors, {}, p, T0 + 10)
    assert of(out, Save)[0].record.ramp.held == "error rate 10.0% > 5.0%"
    assert of(out, Event)[0].message == "a: ramp held at 10%: error rate 10.0% > 5.0%"
    # same reason again: no new event, nothing to store
    assert ramp_step(ramping(held="error rate 10.0% > 5.0%"), errors, {}, p, T0 + 10) == []
    queue = ramp_step(ramping(), Counts({}, {}), {"a": report(20)}, p, T0 + 10)
    assert of(queue, Save)[0].record.ramp.held == "20 waiting > 16"
    # a stale report does not hold it
    stale = {"a": {"received_at": T0 - 60, "report": {"engine": {"waiting": 20}}}}
    assert of(ramp_step(ramping(), Counts({}, {}), stale, p, T0 + 10), Save)[0].record.ramp.step == 1


# --------------------------------------------------------------- overload
def test_overload_degrades_after_for_s_and_restores() -> None:
    p = policy()
    recs = {"a": node("a"), "b": node("b")}
    high = {"a": report(10), "b": report(12)}
    first = overload_step(recs, {"p": PoolState()}, high, p, T0 + 10)
    assert first == [SavePool("p", PoolState(above_since=T0 + 10, mean_waiting=11.0), stored=False)]
    switched = overload_step(recs, {"p": first[0].state}, high, p, T0 + 15)
    ev, save = switched
    assert ev.kind == "degrade" and ev.data == {"to": "least_conn", "mean_waiting": 11.0}
    assert ev.message == "pool p: mean queue 11.0 > 8 for 5s; switched to least_conn"
    assert save.stored and save.switched_to == "least_conn" and save.state.degraded and save.state.since == T0 + 15
    low = {"a": {"received_at": T0 + 30, "report": {"engine": {"waiting": 0}}}}
    below = overload_step(recs, {"p": save.state}, low, p, T0 + 30)[0].state
    back = overload_step(recs, {"p": below}, low, p, T0 + 35)
    assert back[0].data["to"] == "chash_bounded" and back[1].switched_to == "chash_bounded" and not back[1].state.degraded
    # only serving nodes count
    recs["b"] = node("b", state="draining")
    assert overload_step(recs, {"p": PoolState()}, high, p, T0 + 10)[0].state.mean_waiting == 10.0


def test_overload_disabled_ends_a_degrade() -> None:
    p = parse_policy({"version": 1, "pools": [{"name": "p", "models": ["m"], "nodes": [
        {"id": "a", "url": "http://127.0.0.1:9001"}], "overload": {"enabled": False}}]})
    out = overload_step({"a": node()}, {"p": PoolState(degraded=True)}, {}, p, T0)
    assert out == [SavePool("p", PoolState(degraded=False, since=T0, mean_waiting=0.0), stored=True)]
