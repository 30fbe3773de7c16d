"""The control plane's warm-up threads: one per node at most, each running
:func:`kvgate.control.warmup.run_warmup` and handing its outcome back to the plane
(:func:`finished_changes`: a warming node goes on to ramping, or stays warming to retry)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from .. import redisconn
from ..fleet import states as st
from ..fleet.changes import Change, Save, event, transition
from ..fleet.events import EventKind
from ..fleet.ramp import Counts, new_ramp
from ..fleet.records import NodeRecord, Warmup
from .warmup import WarmupResult, run_warmup

if TYPE_CHECKING:
    from .plane import ControlPlane

log = logging.getLogger("kvgate.control")


def outcome_of(result: WarmupResult) -> str:
    """``ok`` (nothing failed), ``failed`` (nothing sent) or ``partial``."""
    return "ok" if result.failed == 0 else ("failed" if result.sent == 0 else "partial")


def finished_changes(rec: NodeRecord, result: WarmupResult, steps: list[float] | tuple[float, ...], counts: Counts,
                     now: float) -> tuple[list[Change], bool]:
    """What a finished warm-up changes, and whether to retry it later.

    Whoever started the warm-up, a node that is warming now goes on to ramping at the first of
    ``ramp.steps`` (an undrain or a recovery during a manual warm-up does not start a second
    one); a failed warm-up (nothing sent) leaves it warming with its passing checks reset, to be
    retried. Any other node just keeps the result."""
    outcome = outcome_of(result)
    done = result.sent + result.failed
    rec = rec.evolve(warmup=Warmup(outcome, result.started_at, result.as_dict(), [done, done]))
    ttft = (f"; TTFT {result.ttft_before_ms} ms cold → {result.ttft_after_ms} ms warm"
            if result.ttft_before_ms is not None and result.ttft_after_ms is not None else "")
    out: list[Change] = [event(
        EventKind.WARMUP, f"{rec.id}: warm-up {outcome}: {result.sent}/{result.prompts + 1 if result.prompts else 0} "
        f"request(s) sent ({result.from_policy} policy prompt(s), {result.from_hot_prefixes} hot prefix(es)) in "
        f"{result.duration_s:.1f}s{ttft}", node=rec.id, pool=rec.pool,
        **{k: v for k, v in result.as_dict().items() if k != "errors"}, errors=result.errors)]
    if rec.state != st.WARMING:
        return out + [Save(rec)], False
    if outcome == "failed":
        # stays warming; the next passing health check after a failure retries
        return out + [Save(rec.evolve(health=dataclasses.replace(rec.health, passes=0)))], True
    return out + [transition(rec, st.RAMPING, f"warm-up {outcome}; ramping at {steps[0]:.0%} of its weight", now,
                             ramp=new_ramp(now, counts, rec.id))], False


class Warmups:
    """The warm-up threads of one plane."""

    def __init__(self, plane: ControlPlane):
        self.plane = plane
        self._threads: dict[str, threading.Thread] = {}

    def running(self, node_id: str) -> bool:
        t = self._threads.get(node_id)
        return bool(t and t.is_alive())

    def launch(self, node_id: str, reason: str | None = None) -> None:
        """Start the node's warm-up unless one runs (the caller holds ``plane.changing()``)."""
        if self.running(node_id):
            return
        plane = self.plane
        rec = plane.nodes[node_id].evolve(warmup=Warmup(status="running", started_at=time.time()))
        plane.apply([Save(rec), event(EventKind.WARMUP, f"{node_id}: warm-up started"
                                      + (f" (requested by {reason})" if reason else ""), node=node_id, pool=rec.pool)])
        t = threading.Thread(target=self._run, args=(node_id,), name=f"warmup-{node_id}", daemon=True)
        self._threads[node_id] = t
        t.start()

    def _run(self, node_id: str) -> None:
        plane = self.plane
        with plane.changing():
            rec = plane.nodes.get(node_id)
            if rec is None or plane.policy is None or rec.warmup is None:
                return
            pool = next(p for p in plane.policy.pools if p.name == rec.pool)
            url, redis_url, live = rec.url, plane.policy.redis.client_url, rec.warmup

        def progress(done: int, total: int) -> None:
            live.progress = [done, total]  # shown live on the node's views

        try:
            # hot prefixes are in the gateway's Redis (the policy's), which `--redis-url` may not be
            log_redis = redisconn.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                result = run_warmup(url, pool, log_redis, progress=progress)
            finally:
                log_redis.close()
        except Exception as exc:  # never leave a node stuck in warming
            log.exception("warm-up of %s failed", node_id)
            result = WarmupResult(errors=[str(exc)])
        with plane.changing():
            rec = plane.nodes.get(node_id)
            if rec is None:
                return
            outcome = outcome_of(result)
            plane.metrics.warmups.labels(node_id, outcome).inc()
            if result.ttft_before_ms is not None:
                plane.metrics.warmup_ttft.labels(node_id, "before").set(result.ttft_before_ms / 1000)
            if result.ttft_after_ms is not None:
                plane.metrics.warmup_ttft.labels(node_id, "after").set(result.ttft_after_ms / 1000)
            steps = plane.policy.ramp.steps if plane.policy else [0.0]
            changes, retry = finished_changes(rec, result, steps, plane.counts(), time.time())
            plane.apply(changes)
            if retry:
                self._retry_later(node_id)
            elif rec.state == st.WARMING:
                plane.try_apply()

    def _retry_later(self, node_id: str) -> None:
        plane = self.plane

        def retry() -> None:
            if plane.stopping.wait(plane.policy.health.probe_interval_s * 2 if plane.policy else 4):
                return
            with plane.changing():
                rec = plane.nodes.get(node_id)
                if rec and rec.state == st.WARMING:
                    self.launch(node_id)

        threading.Thread(target=retry, daemon=True).start()
