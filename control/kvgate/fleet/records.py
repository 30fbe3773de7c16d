"""Typed node and pool records, and their JSON as the store keeps it (``kvgate:control:node:<id>``,
``kvgate:control:pool:<name>``, :mod:`kvgate.control.store`).

The JSON field names are the ones the control plane has always stored, so the records of a
running fleet load as they are; a field this version does not know is kept (``extra``) and
written back unchanged, a field an older record lacks takes its default. Steps never change
a record in place: they return changed copies (:meth:`NodeRecord.evolve`) inside changes
(:mod:`kvgate.fleet.changes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..policy.model import Policy
from . import states as st


def _known(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name != "extra"}


def _split(cls: type, data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    names = _known(cls)
    return ({k: v for k, v in data.items() if k in names}, {k: v for k, v in data.items() if k not in names})


@dataclass
class Health:
    """Health checks in a row (``fails``/``passes``), the last failure's reason, when the last
    check ran (unix s), and the passive-health figures of the last round
    (``{"answers", "errors", "seconds"}`` or None, :class:`kvgate.fleet.health.PassiveWindows`)."""

    fails: int = 0
    passes: int = 0
    last_error: str | None = None
    last_check: float | None = None
    passive: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "fails": self.fails, "passes": self.passes, "last_error": self.last_error,
               "last_check": self.last_check}
        if self.last_check is not None:  # set by every check, with last_check
            out["passive"] = self.passive
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Health:
        known, extra = _split(cls, data or {})
        return cls(**known, extra=extra)


@dataclass
class Ramp:
    """A ramping node's step (index into ``ramp.steps``), since when (unix s), why it is held
    (None: not held) and the gateway's ``(answers, 5xx)`` counts for it when the step began."""

    step: int = 0
    since: float = 0.0
    held: str | None = None
    baseline: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "step": self.step, "since": self.since, "held": self.held,
                "baseline": list(self.baseline) if self.baseline is not None else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Ramp | None:
        if data is None:
            return None
        known, extra = _split(cls, data)
        if known.get("baseline") is not None:
            known["baseline"] = (float(known["baseline"][0]), float(known["baseline"][1]))
        return cls(**known, extra=extra)


@dataclass
class Drain:
    """A drain in progress (or finished): when it started and must end (unix s), idle checks in a
    row, the last in-flight counts (gateway's ``kvgate_upstream_inflight``, engine's running +
    waiting; None = unknown), whether it timed out, why engine figures are unavailable, what
    decided it (``"gateway"`` or ``"gateway and engine"``) and ``[count, since]`` while the
    gateway's count stands still above 0 with an idle engine (a leaked count)."""

    started: float = 0.0
    deadline: float = 0.0
    zero_checks: int = 0
    inflight_gateway: float | None = None
    inflight_engine: float | None = None
    timed_out: bool = False
    engine_figures: str | None = None
    decided_on: str | None = None
    gateway_stuck: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "started": self.started, "deadline": self.deadline, "zero_checks": self.zero_checks,
               "inflight_gateway": self.inflight_gateway, "inflight_engine": self.inflight_engine,
               "timed_out": self.timed_out}
        if self.decided_on is not None:  # set on the drain's first round, with the other two
            out.update(engine_figures=self.engine_figures, decided_on=self.decided_on,
                       gateway_stuck=list(self.gateway_stuck) if self.gateway_stuck is not None else None)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Drain | None:
        if data is None:
            return None
        known, extra = _split(cls, data)
        if known.get("gateway_stuck") is not None:
            known["gateway_stuck"] = (float(known["gateway_stuck"][0]), float(known["gateway_stuck"][1]))
        return cls(**known, extra=extra)


@dataclass
class Warmup:
    """The node's last warm-up: ``status`` running / ok / partial / failed / interrupted, when it
    started (unix s), its result (:meth:`kvgate.control.warmup.WarmupResult.as_dict`) and
    ``[done, total]`` requests (updated by the warm-up thread while it runs)."""

    status: str = "running"
    started_at: float | None = None
    result: dict[str, Any] | None = None
    progress: list[int] = field(default_factory=lambda: [0, 0])
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "status": self.status, "started_at": self.started_at, "result": self.result,
                "progress": list(self.progress)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Warmup | None:
        if data is None:
            return None
        known, extra = _split(cls, data)
        return cls(**known, extra=extra)


_OPTIONAL = ("computed_weight", "engine_start_seen_at", "engine_start_time_at_eject")
"""Top-level fields a record gets only later (written only once set, as before)."""


@dataclass
class NodeRecord:
    """One node's control-plane state.

    Weights are nginx ``weight=`` units (:data:`kvgate.fleet.weights.WEIGHT_SCALE` per 1.0 of
    base weight); times are unix seconds. ``target_weight`` None: not computed yet (the base
    weight then). ``resume_state``: the state an ejected node had; ``engine_start_time``: the
    engine's process start from its agent's last report (``engine_start_seen_at`` when it was
    seen, ``engine_start_time_at_eject`` the one at its ejection), which tells an engine that kept
    its prefix cache from a restarted one.
    """

    id: str
    pool: str = ""
    url: str = ""
    state: str = st.JOINING
    since: float | None = None
    reason: str = ""
    base_weight: int = 1
    target_weight: int | None = None
    health: Health = field(default_factory=Health)
    ramp: Ramp | None = None
    drain: Drain | None = None
    warmup: Warmup | None = None
    engine_start_time: float | None = None
    resume_state: str | None = None
    has_agent: bool = False
    last_weight_change: float | None = None
    computed_weight: int | None = None
    engine_start_seen_at: float | None = None
    engine_start_time_at_eject: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def serving(self) -> bool:
        """In the ring with a non-zero weight (``ramping`` or ``active``)."""
        return self.state in st.SERVING

    def evolve(self, **changes: Any) -> NodeRecord:
        """A copy with ``changes`` (the sub-records are shared unless replaced: never change them in place)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The stored shape (``json.dumps``-able), field names as they always were."""
        out: dict[str, Any] = {
            **self.extra, "id": self.id, "pool": self.pool, "url": self.url, "state": self.state,
            "since": self.since, "reason": self.reason, "base_weight": self.base_weight,
            "target_weight": self.target_weight, "health": self.health.to_json(),
            "ramp": self.ramp.to_json() if self.ramp else None,
            "drain": self.drain.to_json() if self.drain else None,
            "warmup": self.warmup.to_json() if self.warmup else None,
            "engine_start_time": self.engine_start_time, "resume_state": self.resume_state,
            "has_agent": self.has_agent, "last_weight_change": self.last_weight_change}
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeRecord:
        """A record from its stored JSON (any version: missing fields take their defaults).
        Raises KeyError without ``id``."""
        known, extra = _split(cls, data)
        known["health"] = Health.from_json(known.get("health"))
        known["ramp"] = Ramp.from_json(known.get("ramp"))
        known["drain"] = Drain.from_json(known.get("drain"))
        known["warmup"] = Warmup.from_json(known.get("warmup"))
        return cls(**known, extra=extra)


@dataclass
class PoolState:
    """A pool's runtime state: overload degrade in force (``least_conn``) since ``since``, when
    the mean queue went above ``overload.high_queue`` / below ``low_queue`` (None: it is not),
    its last mean queue, and its last load-driven weight change (unix s)."""

    degraded: bool = False
    since: float | None = None
    above_since: float | None = None
    below_since: float | None = None
    last_weight_change: float | None = None
    mean_waiting: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def evolve(self, **changes: Any) -> PoolState:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "degraded": self.degraded, "since": self.since, "above_since": self.above_since,
               "below_since": self.below_since, "last_weight_change": self.last_weight_change}
        if self.mean_waiting is not None:
            out["mean_waiting"] = self.mean_waiting
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> PoolState:
        known, extra = _split(cls, data or {})
        return cls(**known, extra=extra)


def node_records(data: Mapping[str, NodeRecord | Mapping[str, Any]]) -> dict[str, NodeRecord]:
    """Node id → record, for records given as :class:`NodeRecord` or as stored JSON."""
    return {k: v if isinstance(v, NodeRecord) else NodeRecord.from_json({"id": k, **v}) for k, v in data.items()}


def pool_states(data: Mapping[str, PoolState | Mapping[str, Any]]) -> dict[str, PoolState]:
    """Pool name → state, for states given as :class:`PoolState` or as stored JSON."""
    return {k: v if isinstance(v, PoolState) else PoolState.from_json(v) for k, v in data.items()}


def new_record(node_id: str, pool: str, url: str, base_weight: int, state: str, reason: str, now: float) -> NodeRecord:
    """The record of a node that just entered the policy."""
    return NodeRecord(id=node_id, pool=pool, url=url, state=state, since=now, reason=reason, base_weight=base_weight)


def fresh_report(entry: Mapping[str, Any] | None, now: float, policy: Policy | None) -> dict[str, Any] | None:
    """The agent report in a stored entry (``{"received_at": s, "report": {...}}``) if it is
    younger than ``health.missing_reports`` report intervals, else None."""
    if not entry or policy is None:
        return None
    limit = policy.health.missing_reports * policy.control.report_interval_s
    return entry["report"] if now - entry["received_at"] <= limit else None


def others_serving(records: Mapping[str, NodeRecord], rec: NodeRecord) -> list[str]:
    """Ids of the other serving (ramping/active) nodes of ``rec``'s pool."""
    return [r.id for r in records.values() if r.pool == rec.pool and r.id != rec.id and r.serving]
