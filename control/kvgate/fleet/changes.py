"""What a step decides, as data: the orchestrator (:class:`kvgate.control.plane.ControlPlane`)
applies each change in order — records to memory and the store, events to the event log,
counts to the ``kvgate_control_*`` metrics, warm-ups to their threads.

A step returns ``list[Change]``; it never writes anything itself. Records inside changes are
the new values (copies): the orchestrator replaces the old ones with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from .events import EventKind
from .records import NodeRecord, PoolState


@dataclass(frozen=True)
class Save:
    """Replace the node's record with ``record`` in memory and, unless ``stored`` is False, in
    the store (figures that change every round wait for the record's next stored change)."""

    record: NodeRecord
    stored: bool = True


@dataclass(frozen=True)
class Transition:
    """Move a node to ``record.state``: ``record`` is the new record (state, since and reason
    already set, see :func:`transition`). The orchestrator checks the move against
    :data:`kvgate.fleet.states.TRANSITIONS`, stores the record, counts
    ``kvgate_control_node_transitions_total`` and records a ``state`` event."""

    record: NodeRecord
    from_state: str
    action: str | None = None


@dataclass(frozen=True)
class Event:
    """Record an event (:meth:`kvgate.control.store.Store.add_event`)."""

    kind: EventKind
    message: str
    node: str | None = None
    pool: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SavePool:
    """Store a pool's state; ``switched_to``: the balancer an overload switch put in force
    (counted as ``kvgate_control_degrade_switches_total{to}``), None for other changes."""

    name: str
    state: PoolState
    stored: bool = True
    """False: memory only (e.g. the round's mean queue, not worth a store write)."""
    switched_to: str | None = None


@dataclass(frozen=True)
class Checked:
    """A health check ran on ``node`` (``kvgate_control_health_checks_total{result}``)."""

    node: str
    passed: bool


@dataclass(frozen=True)
class ResetPassive:
    """Forget the node's passive-health window (it was ejected, or came back)."""

    node: str


@dataclass(frozen=True)
class StartWarmup:
    """Launch the node's warm-up (in a thread) unless one runs already."""

    node: str
    reason: str | None = None


@dataclass(frozen=True)
class Inflight:
    """The node's in-flight figure (``kvgate_control_node_inflight``): the larger known count."""

    node: str
    value: float


Change = Union[Save, Transition, Event, SavePool, Checked, ResetPassive, StartWarmup, Inflight]


def transition(rec: NodeRecord, to: str, reason: str, now: float, action: str | None = None,
               **fields: Any) -> Transition:
    """A :class:`Transition` of ``rec`` to ``to`` at ``now`` for ``reason``, with other fields
    of the new record in ``fields``."""
    return Transition(rec.evolve(state=to, since=now, reason=reason, **fields), rec.state, action)


def event(kind: EventKind, message: str, node: str | None = None, pool: str | None = None, **data: Any) -> Event:
    """An :class:`Event` with its data as keyword arguments."""
    return Event(kind, message, node, pool, data)
