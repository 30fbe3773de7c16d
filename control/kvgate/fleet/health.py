"""The health step (probes + agent reports + passive health → eject / recover / start warming),
and its figures besides probes: passive health and the store's returns.

Passive health (``health.passive``): the gateway counts every answer by node and status
(``kvgate_requests_total{node,status}``), and the reconciler scrapes those counters every
round. :class:`PassiveWindows` keeps each node's counters over the last ``window_s`` and
says whether its share of 5xx answers is above ``max_5xx_ratio`` (once it has at least
``min_requests`` answers in the window). A node that answers 500 to everything while its
``/health`` is fine fails its health checks that way, and is ejected like a node that fails
probes. No traffic reaches an ejected node, so its window starts again when it is ejected
and when it comes back: it returns on ``recover_after`` good probes and is judged again on
the answers it gives after its return.

:class:`StoreWatch` tells when the control plane's store (Redis) comes back: readable
again after failing, or emptied under it (its instance marker gone: a restart between two
rounds, a ``FLUSHALL``). Agents could not report while it was away (their posts were
answered 503) and their last reports may be gone with it, so for a grace after its return a
missing report is unknown, not a failed check (see :func:`report_window`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..policy.model import PassiveHealthConfig, Policy
from . import states as st
from .changes import Change, Checked, Event, ResetPassive, Save, StartWarmup, Transition, event, transition
from .events import EventKind
from .records import NodeRecord, fresh_report, others_serving


class PassiveWindows:
    """Per-node samples ``(unix s, answers, 5xx answers)`` of the gateway's cumulative counters."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}

    def add(self, now: float, node_ids: Iterable[str], answers: dict[str, float], errors: dict[str, float],
            window_s: float) -> None:
        """Record one scrape (``answers``/``errors``: node id → counter value, as in the
        gateway snapshot). A counter that went down (the gateway restarted) starts the node's
        window again. Keeps, per node, the samples of the last ``window_s`` plus the newest
        older one (the window's baseline)."""
        for node in node_ids:
            total, bad = float(answers.get(node, 0.0)), float(errors.get(node, 0.0))
            samples = self._samples.setdefault(node, deque())
            if samples and (total < samples[-1][1] or bad < samples[-1][2]):
                samples.clear()
            samples.append((now, total, bad))
            while len(samples) > 2 and samples[1][0] <= now - window_s:
                samples.popleft()

    def reset(self, node_id: str) -> None:
        """Forget the node's answers so far (it was ejected, or it came back)."""
        self._samples.pop(node_id, None)

    def figures(self, node_id: str) -> dict[str, float] | None:
        """``{"answers", "errors", "seconds"}`` over the node's window, None before two samples."""
        samples = self._samples.get(node_id)
        if not samples or len(samples) < 2:
            return None
        (t0, a0, e0), (t1, a1, e1) = samples[0], samples[-1]
        return {"answers": a1 - a0, "errors": e1 - e0, "seconds": round(t1 - t0, 1)}

    def verdict(self, node_id: str, cfg: PassiveHealthConfig) -> str | None:
        """The failed check's reason when the node's 5xx share is above the threshold, else None
        (also when it had fewer than ``min_requests`` answers in the window)."""
        f = self.figures(node_id)
        if not f or f["answers"] < cfg.min_requests or f["answers"] <= 0:
            return None
        share = f["errors"] / f["answers"]
        if share <= cfg.max_5xx_ratio:
            return None
        return (f"gateway: 5xx share {share:.0%} of {f['answers']:.0f} answers in the last {f['seconds']:g}s "
                f"(> health.passive.max_5xx_ratio {cfg.max_5xx_ratio:.0%})")


class StoreWatch:
    """Notices the store's returns. Feed it every round with :meth:`observe`; :meth:`in_grace`
    says whether missing agent reports are unknown rather than failed checks."""

    def __init__(self) -> None:
        self.instance: str | None = None
        self.down_since: float | None = None
        self.started_at = time.time()
        """When the control plane started (agents could not report before)."""
        self.back_at = 0.0
        """When the store last came back (:meth:`observe`)."""

    def in_grace(self, now: float, policy: Policy) -> bool:
        """:func:`in_report_grace` since :attr:`started_at` and :attr:`back_at`."""
        return in_report_grace(now, self.started_at, self.back_at, policy)

    def observe(self, readable: bool, instance: str | None, now: float) -> dict[str, object] | None:
        """``readable``: whether this round could read the reports; ``instance``: the store's
        instance marker (None when it could not be read). Returns ``{"down_s": s or None,
        "emptied": bool}`` when the store is back (readable after failing, or a new marker),
        else None."""
        if not readable:
            if self.down_since is None:
                self.down_since = now
            return None
        emptied = instance is not None and self.instance is not None and instance != self.instance
        if instance is not None:
            self.instance = instance
        if self.down_since is None and not emptied:
            return None
        down_s = now - self.down_since if self.down_since is not None else None
        self.down_since = None
        self.back_at = now
        return {"down_s": down_s, "emptied": emptied}


def report_window(policy: Policy) -> float:
    """Seconds of the report grace: ``missing_reports`` intervals plus the agents' longest
    backoff (``max(interval, min(10 s, 5 × interval))``, see :mod:`kvgate.agent.agent`)."""
    ri = policy.control.report_interval_s
    return policy.health.missing_reports * ri + max(ri, min(10.0, 5 * ri))


def store_back_event(back: Mapping[str, Any], policy: Policy) -> Event:
    """The ``store_back`` event for :meth:`StoreWatch.observe`'s ``{"down_s", "emptied"}``."""
    ri = policy.control.report_interval_s
    return event(EventKind.STORE_BACK, "Redis is back" + (f" after {back['down_s']:.0f}s" if back["down_s"] else "")
                 + (", emptied (its data is gone): node records written again" if back["emptied"] else "")
                 + f"; missing agent reports count as unknown for {report_window(policy):.0f}s (agents retry "
                 f"every {ri:g}s, longer after failed posts)", emptied=back["emptied"], down_s=back["down_s"])


def in_report_grace(now: float, started_at: float, store_back_at: float, policy: Policy) -> bool:
    """True while agents' missing reports cannot be held against them: the control plane is
    young (``started_at``: they could not report while it was not running), or its store came
    back lately (``store_back_at``: their posts were answered 503 while it was away, and their
    last reports may be gone with it); either way they retry with backoff. A missing report is
    then unknown, not a failed check."""
    return now - max(started_at, store_back_at) <= report_window(policy)


@dataclass(frozen=True)
class HealthInputs:
    """What a health round sees.

    Attributes:
        probes: node id → None (``GET /health`` answered 200) or why the probe failed; nodes
            not in it (joined after the probes were sent) are not judged.
        reports: the stored report entries (``{"received_at", "report"}``) by node id.
        reports_ok: False when Redis could not be read: the agent's part is not judged.
        report_grace: see :func:`in_report_grace`.
        gateway_ok: whether the gateway's ``/metrics`` was read this round (passive health
            judges only then).
        passive: the nodes' answers and 5xx at the gateway (read only).
    """

    probes: Mapping[str, str | None]
    reports: Mapping[str, dict[str, Any]]
    reports_ok: bool
    report_grace: bool
    gateway_ok: bool
    passive: PassiveWindows


def passive_room(records: Mapping[str, NodeRecord], rec: NodeRecord, share: float) -> bool:
    """Whether ejecting ``rec`` keeps its pool's ejected nodes within ``share`` of the pool
    (rounded down, at least 1): the cap on ejections by passive health (Envoy's
    ``max_ejection_percent``)."""
    pool = [r for r in records.values() if r.pool == rec.pool]
    ejected = sum(1 for r in pool if r.state == st.EJECTED)
    return ejected + 1 <= max(1, int(len(pool) * share))


def start_warming(rec: NodeRecord, reason: str, now: float, **fields: Any) -> list[Change]:
    """Move ``rec`` to ``warming`` and launch its warm-up."""
    return [transition(rec, st.WARMING, reason, now, **fields), StartWarmup(rec.id)]


def recover(rec: NodeRecord, policy: Policy, now: float) -> list[Change]:
    """An ejected node passed ``recover_after`` checks: back through warming if its engine
    restarted (or we cannot tell), else straight back to where it was.

    "Same engine" needs an agent report since the ejection whose ``engine.start_time`` is the
    one seen before it; a node with an agent waits for that report for up to
    ``missing_reports`` report intervals of passing checks (called again each round: returns
    ``[]`` meanwhile) rather than be warmed for want of it. Its passive-health window starts
    again either way."""
    before = rec.engine_start_time_at_eject
    seen = (rec.engine_start_seen_at or 0.0) >= (rec.since or 0.0)
    hc = policy.health
    passes = rec.health.passes
    passing_extra_s = (passes - hc.recover_after) * hc.probe_interval_s
    if rec.has_agent and before is not None and not seen \
            and passing_extra_s < hc.missing_reports * policy.control.report_interval_s:
        return []
    same_engine = before is not None and seen and rec.engine_start_time == before
    resume = rec.resume_state
    if same_engine and resume in (st.ACTIVE, st.RAMPING):
        ramp = dataclasses.replace(rec.ramp, since=now) if resume == st.RAMPING and rec.ramp else rec.ramp
        return [ResetPassive(rec.id), transition(rec, resume, f"recovered after {passes} passed checks; "
                                                 "same engine process, cache kept", now, ramp=ramp)]
    why = f"it was {resume}" if same_engine else "engine restarted, cache is empty" \
        if before is not None and seen else "cannot tell whether the engine kept its cache"
    return [ResetPassive(rec.id), *start_warming(rec, f"recovered after {passes} passed checks ({why})", now)]


def _agent_reasons(rec: NodeRecord, inputs: HealthInputs, policy: Policy, now: float) -> list[str]:
    """Why the agent's side of the check fails: no fresh report (outside the report grace), or
    a report saying the engine is unhealthy."""
    if not (rec.has_agent and inputs.reports_ok):
        return []
    entry = inputs.reports.get(rec.id)
    fresh = fresh_report(entry, now, policy)
    if fresh is None and not inputs.report_grace:
        age = now - entry["received_at"] if entry else None
        return ["no agent report" + (f" for {age:.0f}s" if age is not None else "")]
    if fresh is not None and not (fresh.get("engine") or {}).get("healthy", True):
        return ["agent: engine " + str((fresh.get("engine") or {}).get("error") or "unhealthy")]
    return []


def health_step(records: Mapping[str, NodeRecord], inputs: HealthInputs, policy: Policy, now: float) -> list[Change]:
    """Count passed/failed checks; eject and recover. A check fails on the probe, on the agent's
    report (missing — unless in the report grace —, or saying the engine is unhealthy) and, for a
    serving node, on its 5xx share at the gateway (``health.passive``). Without readable reports
    (Redis down) the agent's part is not judged.

    ``health.eject_after`` failed checks in a row eject a warming, ramping or active node —
    unless it is the last serving node of its pool, or it fails on its 5xx share alone and
    passive health already ejected ``health.passive.max_ejected_share`` of its pool (an
    ``eject_skipped`` event each). A joining node's first passing check starts its warm-up;
    ``health.recover_after`` passing checks bring an ejected node back (:func:`recover`).

    Returns per judged node :class:`Checked`, the events, and one :class:`Save` or
    :class:`Transition` with its new record (then :class:`StartWarmup` for a warm-up)."""
    hc = policy.health
    work = dict(records)  # later nodes see earlier ejections (last serving node, the passive cap)
    out: list[Change] = []
    for node_id, rec in records.items():
        if node_id not in inputs.probes:
            continue
        reasons = [inputs.probes[node_id]] if inputs.probes[node_id] else []
        reasons += _agent_reasons(rec, inputs, policy, now)
        h = dataclasses.replace(rec.health, last_check=now, passive=inputs.passive.figures(node_id))
        capped = False
        if hc.passive.enabled and rec.serving and inputs.gateway_ok:
            why = inputs.passive.verdict(node_id, hc.passive)
            if why:
                # failing on its 5xx share alone: ejected only within the pool's share
                capped = not reasons and not passive_room(work, rec, hc.passive.max_ejected_share)
                reasons.append(why)
        changes: list[Change]
        if reasons:
            h = dataclasses.replace(h, fails=h.fails + 1, passes=0, last_error="; ".join(reasons))
            out.append(Checked(node_id, passed=False))
            new = rec.evolve(health=h)
            # a joining node is not serving: it just waits for its first passing check
            last = rec.serving and not others_serving(work, rec)
            if last and h.fails == hc.eject_after:
                out.append(event(EventKind.EJECT_SKIPPED, f"{node_id}: {h.fails} failed health checks, but it is "
                                 f"the last serving node of pool {rec.pool}: kept in the ring ({h.last_error})",
                                 node=node_id, pool=rec.pool))
            if capped and not last and h.fails == hc.eject_after:
                out.append(event(EventKind.EJECT_SKIPPED, f"{node_id}: {h.fails} failed health checks on its 5xx "
                                 f"share alone, but passive health already ejected the most of pool {rec.pool} it "
                                 f"may (health.passive.max_ejected_share {hc.passive.max_ejected_share:g}): kept "
                                 f"in the ring ({h.last_error})", node=node_id, pool=rec.pool))
            if (not last and not capped and rec.state in (st.WARMING, st.RAMPING, st.ACTIVE)
                    and h.fails >= hc.eject_after):
                # no traffic while ejected: its passive window is judged again on its return
                changes = [ResetPassive(node_id), transition(
                    new, st.EJECTED, f"{h.fails} failed health checks: {h.last_error}", now,
                    resume_state=rec.state, engine_start_time_at_eject=rec.engine_start_time)]
            else:
                changes = [Save(new)]
        else:
            h = dataclasses.replace(h, fails=0, passes=h.passes + 1)
            out.append(Checked(node_id, passed=True))
            new = rec.evolve(health=h)
            changes = []
            # the engine's start time comes with each report (engine_start_changes)
            if rec.state == st.JOINING:
                changes = start_warming(new, "passed its health check", now)
            elif rec.state == st.EJECTED and h.passes >= hc.recover_after:
                changes = recover(new, policy, now)
            if not changes:
                changes = [Save(new)]
        for c in changes:
            if isinstance(c, (Save, Transition)):
                work[node_id] = c.record
        out += changes
    return out


def engine_start_changes(rec: NodeRecord, report: Mapping[str, Any], now: float) -> list[Change]:
    """Keep the engine's process start time (``engine.start_time``) of every report, and when it
    was seen: the record tells an engine that kept its cache from a restarted one (see
    :func:`recover`) from the first report on, not only after a probe round. A serving node's
    engine that restarted gets an ``engine_restarted`` event. The record is stored only when
    the start time changed."""
    start = (report.get("engine") or {}).get("start_time")
    if start is None:
        return []
    before = rec.engine_start_time
    out: list[Change] = []
    if before is not None and before != start and rec.serving:
        out.append(event(EventKind.ENGINE_RESTARTED, f"{rec.id}: engine restarted; its prefix cache is empty",
                         node=rec.id, pool=rec.pool))
    out.append(Save(rec.evolve(engine_start_time=start, engine_start_seen_at=now), stored=before != start))
    return out

