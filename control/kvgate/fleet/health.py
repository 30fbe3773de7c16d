"""Health figures of the control plane besides probes: passive health and the store's returns.

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
missing report is unknown, not a failed check (see ``ControlPlane._report_grace``).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..policy.model import PassiveHealthConfig


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
    """Notices the store's returns. Feed it every round with :meth:`observe`."""

    def __init__(self) -> None:
        self.instance: str | None = None
        self.down_since: float | None = None

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
        return {"down_s": down_s, "emptied": emptied}
