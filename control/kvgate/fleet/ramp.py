"""The ramp step: a ramping node's error rate and queue → its next step, a hold, or ``active``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..policy.model import Policy
from . import states as st
from .changes import Change, Save, event, transition
from .events import EventKind
from .records import NodeRecord, Ramp, fresh_report


@dataclass(frozen=True)
class Counts:
    """The gateway's cumulative answers and 5xx answers per node (``kvgate_requests_total``),
    as in its last ``/metrics`` scrape (empty when it could not be read)."""

    requests: Mapping[str, float]
    errors: Mapping[str, float]

    def of(self, node_id: str) -> tuple[float, float]:
        """``(answers, 5xx)`` of one node (0 when the gateway has none)."""
        return (self.requests.get(node_id, 0.0), self.errors.get(node_id, 0.0))


def new_ramp(now: float, counts: Counts, node_id: str) -> Ramp:
    """The ramp record of a node that starts ramping now, at step 0."""
    return Ramp(step=0, since=now, held=None, baseline=counts.of(node_id))


def ramp_step(records: Mapping[str, NodeRecord], counts: Counts, reports: Mapping[str, dict[str, Any]],
              policy: Policy, now: float) -> list[Change]:
    """Advance ramps: every ``ramp.step_interval_s`` a ramping node moves to the next of
    ``ramp.steps`` unless its 5xx share since its step began is above ``ramp.max_error_rate`` or
    its engine's queue (fresh report's ``waiting``) is above ``ramp.max_queue``; then it is held
    (an event ``ramp_held`` when the reason changes). The last step is ``active``.

    ``counts``: the gateway's answers per node; ``reports``: the stored report entries."""
    rc = policy.ramp
    out: list[Change] = []
    for rec in records.values():
        if rec.state != st.RAMPING or rec.ramp is None:
            continue
        ramp = rec.ramp
        if now - ramp.since < rc.step_interval_s:
            continue
        total, errors = counts.of(rec.id)
        b_total, b_errors = ramp.baseline or (0.0, 0.0)
        answered = total - b_total
        error_rate = (errors - b_errors) / answered if answered > 0 else 0.0
        waiting = ((fresh_report(reports.get(rec.id), now, policy) or {}).get("engine") or {}).get("waiting") or 0
        held = None
        if error_rate > rc.max_error_rate:
            held = f"error rate {error_rate:.1%} > {rc.max_error_rate:.1%}"
        elif waiting > rc.max_queue:
            held = f"{waiting:.0f} waiting > {rc.max_queue:.0f}"
        if held:
            if ramp.held != held:
                out.append(Save(rec.evolve(ramp=Ramp(ramp.step, ramp.since, held, ramp.baseline, ramp.extra))))
                out.append(event(EventKind.RAMP_HELD, f"{rec.id}: ramp held at "
                                 f"{rc.steps[min(ramp.step, len(rc.steps) - 1)]:.0%}: {held}",
                                 node=rec.id, pool=rec.pool))
            continue
        step = ramp.step + 1
        if step >= len(rc.steps) - 1:
            out.append(transition(rec, st.ACTIVE, "ramp complete", now, ramp=None))
        else:
            out.append(Save(rec.evolve(ramp=Ramp(step, now, None, counts.of(rec.id)))))
            out.append(event(EventKind.RAMP, f"{rec.id}: ramp step {step + 1}/{len(rc.steps)}: "
                             f"{rc.steps[step]:.0%} of its weight", node=rec.id, pool=rec.pool, step=step,
                             fraction=rc.steps[step]))
    return out
