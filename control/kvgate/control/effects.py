"""What the fleet's changes (:mod:`kvgate.fleet.changes`) do outside the steps: node and pool
records to the plane's memory and the store, events to the event log, counts and gauges to
the ``kvgate_control_*`` metrics, passive-health windows reset, warm-ups started."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..fleet import states as st
from ..fleet.changes import Change, Checked, Event, Inflight, ResetPassive, Save, SavePool, StartWarmup, Transition
from ..fleet.events import EventKind
from .store import StoreError

if TYPE_CHECKING:
    from ..fleet.records import NodeRecord
    from .plane import ControlPlane

log = logging.getLogger("kvgate.control")


def apply_changes(plane: ControlPlane, changes: list[Change]) -> None:
    """Apply ``changes`` in order to ``plane`` (the caller holds ``plane.changing()``).

    A :class:`Transition` is checked against the state machine first (raises
    :class:`~kvgate.fleet.states.InvalidTransition`), then stored, counted
    (``kvgate_control_node_transitions_total``) and recorded as a ``state`` event. Store errors
    are logged, never raised: memory stays authoritative and the next change writes again."""
    # stored Saves are written together (one round trip: a probe round saves every node), in
    # order before anything else that writes to the store or reads it back
    pending: dict[str, NodeRecord] = {}

    def flush() -> None:
        if pending:
            plane.put_records(list(pending.values()))
            pending.clear()

    for c in changes:
        if isinstance(c, Save):
            plane.nodes[c.record.id] = c.record
            if c.stored:
                pending.pop(c.record.id, None)  # the latest record of a node is the one written
                pending[c.record.id] = c.record
            continue
        if not isinstance(c, (Checked, ResetPassive, Inflight)):
            flush()
        if isinstance(c, Transition):
            rec = c.record
            st.check(rec.id, c.from_state, rec.state, c.action)
            plane.nodes[rec.id] = rec
            plane.metrics.transitions.labels(rec.id, c.from_state, rec.state).inc()
            plane.put_record(rec)
            plane.event(EventKind.STATE, f"{rec.id}: {c.from_state} → {rec.state} ({rec.reason})", node=rec.id,
                        pool=rec.pool, from_state=c.from_state, to_state=rec.state, reason=rec.reason)
        elif isinstance(c, Event):
            plane.event(c.kind, c.message, c.node, c.pool, **c.data)
        elif isinstance(c, SavePool):
            plane.pools[c.name] = c.state
            plane.metrics.degraded.labels(c.name).set(1 if c.state.degraded else 0)
            if c.switched_to:
                plane.metrics.degrade_switches.labels(c.name, c.switched_to).inc()
            if c.stored:
                try:
                    plane.store.put_pool(c.name, c.state.to_json())
                except StoreError as exc:
                    log.warning("%s", exc)
        elif isinstance(c, Checked):
            plane.metrics.health_checks.labels(c.node, "pass" if c.passed else "fail").inc()
        elif isinstance(c, ResetPassive):
            plane.passive.reset(c.node)
        elif isinstance(c, StartWarmup):
            plane.warmups.launch(c.node, c.reason)
        elif isinstance(c, Inflight):
            plane.metrics.inflight.labels(c.node).set(c.value)
    flush()
