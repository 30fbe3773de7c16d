"""Live upstream weights: base weight × capacity × load factor, damped.

Every weight change on a consistent-hash ring moves keys between nodes, and a
moved key loses its prefix cache (its KV blocks stay on the old node). So a
computed weight is applied only when it differs from the applied one by more than
``weights.change_threshold`` and no sooner than ``weights.min_interval_s`` after the
pool's last load-driven change; small fluctuations never reach nginx.

Units: nginx ``weight=`` integers, :data:`kvgate.render.WEIGHT_SCALE` per 1.0 of
base weight (base weight 1, capacity 1, no load → 100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy.model import WeightsConfig
from ..render import WEIGHT_SCALE

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
