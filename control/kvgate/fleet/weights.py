"""Live upstream weights: base weight × capacity × load factor, damped.

Every weight change on a consistent-hash ring moves keys between nodes, and a
moved key loses its prefix cache (its KV blocks stay on the old node). So a
computed weight is applied only when it differs from the applied one by more than
``weights.change_threshold`` and no sooner than ``weights.min_interval_s`` after the
pool's last load-driven change; small fluctuations never reach nginx.

Units: nginx ``weight=`` integers, :data:`WEIGHT_SCALE` per 1.0 of base weight (base
weight 1, capacity 1, no load → 100). ``0`` means down (not taking traffic): every weight a
serving node gets is at least 1.

This is the one module with the weight arithmetic: the scale, ``0 = down``, the ramp share,
the target a node serves at (:func:`target_of`), the serving weights that define a key's home
node (:func:`serving_weights`) and the damped target step (:func:`weights_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..policy.model import Policy, WeightsConfig
from . import states as st
from .changes import Change, Save, SavePool, event
from .events import EventKind
from .records import NodeRecord, PoolState, fresh_report

WEIGHT_SCALE = 100
"""nginx ``weight=`` units per 1.0 of policy base weight: the control plane's capacity, load
and ramp factors are fractions, and nginx weights are integers. Ketama gives a server
``160 × weight`` points, each derived from the previous one, so raising one node's weight
only adds that node's points: keys move to it and nowhere else."""

DOWN = 0
"""The weight of a node that takes no traffic (nginx ``down``)."""

CAPACITY_MIN, CAPACITY_MAX = 0.25, 4.0
KV_FREE = 0.7
"""KV-cache use below this costs nothing in the load factor (vLLM keeps running
sequences' blocks plus a cached tail; a busy healthy engine sits around 0.3–0.7)."""


def capacity_of(report: dict[str, Any] | None) -> float | None:
    """A node's raw capacity figure from its agent report, or None when unknown.

    GPU memory in bytes (NVML, summed over the node's GPUs) when the agent sees GPUs;
    otherwise the engine's KV-cache blocks (``vllm:cache_config_info{num_gpu_blocks}``).
    Figures are compared only within a pool, and only of one kind (see :func:`capacities`).
    """
    if not report:
        return None
    total = _gpu_memory(report)
    if total:
        return total
    blocks = (report.get("engine") or {}).get("num_gpu_blocks")
    return float(blocks) if blocks else None


def _gpu_memory(report: dict[str, Any] | None) -> float | None:
    """GPU memory in bytes summed over the node's GPUs, None when NVML gives no figure."""
    gpu = (report or {}).get("gpu") or {}
    if gpu.get("status") != "ok":
        return None
    total = sum(d.get("memory_total_bytes") or 0 for d in gpu.get("devices") or [])
    return float(total) if total > 0 else None


def capacities(reports: dict[str, dict[str, Any] | None]) -> dict[str, float]:
    """Capacity factor per node of one pool: its figure ÷ the pool's mean, clamped to
    [0.25, 4]; 1.0 for nodes without a figure, and for everyone when the pool mixes
    GPU-memory and KV-block figures (they are not comparable)."""
    gpu_kind = {nid: _gpu_memory(r) is not None for nid, r in reports.items()}
    figures = {nid: capacity_of(r) for nid, r in reports.items()}
    known = {nid: f for nid, f in figures.items() if f}
    if not known or len({gpu_kind[n] for n in known}) > 1:
        return {nid: 1.0 for nid in reports}
    mean = sum(known.values()) / len(known)
    return {nid: (min(CAPACITY_MAX, max(CAPACITY_MIN, known[nid] / mean)) if nid in known else 1.0)
            for nid in reports}


def load_factor(report: dict[str, Any] | None, cfg: WeightsConfig) -> float:
    """1.0 for an idle node, down to ``cfg.min_factor`` under pressure.

    pressure = max(waiting ÷ ``queue_high``, (KV use − 0.7) ÷ (``kv_high`` − 0.7)),
    clamped to [0, 1]; factor = 1 − (1 − min_factor) × pressure. Queue depth is
    vLLM's ``num_requests_waiting`` (SGLang: ``num_queue_reqs``); KV use is
    ``kv_cache_usage_perc`` (SGLang: ``token_usage``). No report → 1.0.
    """
    engine = (report or {}).get("engine") or {}
    waiting = engine.get("waiting")
    kv = engine.get("kv_cache_usage")
    pressure = 0.0
    if waiting is not None:
        pressure = max(pressure, float(waiting) / cfg.queue_high)
    if kv is not None and cfg.kv_high > KV_FREE:
        pressure = max(pressure, (float(kv) - KV_FREE) / (cfg.kv_high - KV_FREE))
    pressure = min(1.0, max(0.0, pressure))
    return 1.0 - (1.0 - cfg.min_factor) * pressure


def computed_weight(base: int, capacity: float, load: float) -> int:
    """nginx weight for ``base × capacity × load`` (at least 1)."""
    return max(1, round(base * WEIGHT_SCALE * capacity * load))


@dataclass
class Damper:
    """Decides whether a newly computed weight replaces the applied one.

    Args:
        cfg: the policy's ``weights`` section.
    """

    cfg: WeightsConfig

    def accept(self, applied: int | None, computed: int, now: float, last_change: float | None) -> bool:
        """True when ``computed`` should replace ``applied``: there is none yet, or it differs
        by more than ``change_threshold`` (relative) and the pool's last load-driven change
        was at least ``min_interval_s`` ago."""
        if applied is None or applied <= 0:
            return True
        if abs(computed - applied) / applied <= self.cfg.change_threshold:
            return False
        return last_change is None or now - last_change >= self.cfg.min_interval_s


def ramp_weight(target: int, fraction: float) -> int:
    """The weight of a ramping node on a step (``fraction`` of its target), at least 1."""
    return max(1, round(target * fraction))


def base_nginx_weight(base: int) -> int:
    """nginx weight of a policy base weight (``base × WEIGHT_SCALE``)."""
    return base * WEIGHT_SCALE


def target_of(rec: NodeRecord, base: int) -> int:
    """The weight ``rec`` serves at when active: its target, or ``base × WEIGHT_SCALE`` when it
    has none or its base weight changed in the policy since (a stale stored target)."""
    if rec.base_weight != base or not rec.target_weight:
        return base_nginx_weight(base)
    return rec.target_weight


def node_weight(rec: NodeRecord | None, base: int, steps: list[float] | tuple[float, ...], fresh_fleet: bool) -> int:
    """The nginx weight in force for a node: ``active`` its target, ``ramping`` the ramp step's
    share of it (a step past the end is the last), every other state :data:`DOWN`. A node
    without a record is ``joining`` (down), unless the fleet is fresh (no records at all: every
    node at its base weight)."""
    if rec is None:
        return base_nginx_weight(base) if fresh_fleet else DOWN
    target = target_of(rec, base)
    if rec.state == st.ACTIVE:
        return target
    if rec.state == st.RAMPING:
        step = rec.ramp.step if rec.ramp else 0
        return ramp_weight(target, steps[min(step, len(steps) - 1)])
    return DOWN


def serving_weights(policy: Policy, applied: Mapping[str, int], records: Mapping[str, NodeRecord]) -> dict[str, int]:
    """Node id → the nginx weight the node has when it serves: the weight in force
    (``applied``), and for a node that is down (draining, drained, ejected, warming …) its
    target weight, else its base weight. The ring of these weights defines a route key's *home
    node* (the admin page's affinity ratio): a drain does not move the other nodes' homes."""
    out = {}
    for node in policy.nodes():
        w = applied.get(node.id) or DOWN
        if w <= DOWN:
            rec = records.get(node.id)
            w = (rec.target_weight if rec else None) or base_nginx_weight(node.weight)
        out[node.id] = int(w)
    return out


def weights_step(records: Mapping[str, NodeRecord], pools: Mapping[str, PoolState],
                 reports: Mapping[str, dict[str, Any]] | None, policy: Policy, now: float) -> list[Change]:
    """Recompute every node's target weight: base × capacity × load (``weights.dynamic``) or
    the base weight, damped (:class:`Damper`) except the first one after the base weight was set
    or changed. ``reports``: the stored entries (``{"received_at", "report"}``), None when they
    cannot be read: then only missing targets are set.

    Returns :class:`Save` for every record whose target or computed weight changed, an event
    ``weight`` per damped change, and :class:`SavePool` (memory only) with the pool's
    ``last_weight_change`` when one of its nodes changed."""
    cfg = policy.weights
    out: list[Change] = []
    if reports is None:
        for rec in records.values():
            if rec.target_weight is None:
                out.append(Save(rec.evolve(target_weight=base_nginx_weight(rec.base_weight)), stored=False))
        return out
    damper = Damper(cfg)
    for pool in policy.pools:
        fresh = {n.id: fresh_report(reports.get(n.id), now, policy) for n in pool.nodes}
        caps = capacities(fresh) if cfg.dynamic else {n.id: 1.0 for n in pool.nodes}
        p = pools[pool.name]
        changed: list[Change] = []
        for node in pool.nodes:
            rec = records[node.id]
            base = rec.base_weight
            if not cfg.dynamic:
                computed = base_nginx_weight(base)
            else:
                computed = computed_weight(base, caps[node.id], load_factor(fresh[node.id], cfg))
            current = rec.target_weight
            if current is None:
                new = rec.evolve(computed_weight=computed, target_weight=computed)
            elif current != computed and damper.accept(current, computed, now, p.last_weight_change):
                new = rec.evolve(computed_weight=computed, target_weight=computed, last_weight_change=now)
                changed += [Save(new), event(EventKind.WEIGHT, f"{rec.id}: target weight {current} → {computed} "
                                             "(capacity × load)", node=rec.id, pool=pool.name, old=current,
                                             new=computed)]
                continue
            else:
                new = rec.evolve(computed_weight=computed)
            if new != rec:  # a figure of every round: stored with the record's next change
                out.append(Save(new, stored=False))
        out += changed
        if changed:
            out.append(SavePool(pool.name, p.evolve(last_weight_change=now), stored=False))
    return out
