"""The overload step: a pool's mean engine queue → degrade to ``least_conn`` or restore its balancer."""

from __future__ import annotations

from typing import Any, Mapping

from ..policy.model import Policy
from .changes import Change, SavePool, event
from .events import EventKind
from .records import NodeRecord, PoolState, fresh_report


def mean_waiting(records: Mapping[str, NodeRecord], node_ids: list[str], reports: Mapping[str, dict[str, Any]],
                 policy: Policy, now: float) -> float:
    """Mean ``waiting`` of the fresh reports of the pool's serving nodes (0 without any)."""
    waits = []
    for node_id in node_ids:
        fresh = fresh_report(reports.get(node_id), now, policy)
        if records[node_id].serving and fresh and (fresh.get("engine") or {}).get("waiting") is not None:
            waits.append(float(fresh["engine"]["waiting"]))
    return sum(waits) / len(waits) if waits else 0.0


def overload_step(records: Mapping[str, NodeRecord], pools: Mapping[str, PoolState],
                  reports: Mapping[str, dict[str, Any]], policy: Policy, now: float) -> list[Change]:
    """Per pool: when the mean queue stays above ``overload.high_queue`` for ``overload.for_s``
    the pool switches to ``least_conn`` (degraded); when it stays below ``low_queue`` as long,
    back to the pool's balancer. ``overload.enabled: false`` ends a degrade at once.

    Returns one :class:`SavePool` per pool (stored only when the degrade switched, with
    ``switched_to``) and an event ``degrade`` per switch."""
    out: list[Change] = []
    for pool in policy.pools:
        oc = pool.overload
        p = pools[pool.name]
        mean = mean_waiting(records, [n.id for n in pool.nodes], reports, policy, now)
        new = p.evolve(mean_waiting=mean)
        switched: str | None = None
        changed = False
        if not oc.enabled:
            if p.degraded:
                new, changed = new.evolve(degraded=False, since=now), True
        elif not p.degraded:
            if mean > oc.high_queue:
                new = new.evolve(above_since=p.above_since or now)
                if now - new.above_since >= oc.for_s:
                    new, changed, switched = new.evolve(degraded=True, since=now, below_since=None), True, "least_conn"
                    out.append(event(EventKind.DEGRADE, f"pool {pool.name}: mean queue {mean:.1f} > "
                                     f"{oc.high_queue:g} for {oc.for_s:g}s; switched to least_conn", pool=pool.name,
                                     to="least_conn", mean_waiting=mean))
            else:
                new = new.evolve(above_since=None)
        else:
            if mean < oc.low_queue:
                new = new.evolve(below_since=p.below_since or now)
                if now - new.below_since >= oc.for_s:
                    new, changed, switched = new.evolve(degraded=False, since=now, above_since=None), True, pool.balancer
                    out.append(event(EventKind.DEGRADE, f"pool {pool.name}: mean queue {mean:.1f} < "
                                     f"{oc.low_queue:g} for {oc.for_s:g}s; back to {pool.balancer}", pool=pool.name,
                                     to=pool.balancer, mean_waiting=mean))
            else:
                new = new.evolve(below_since=None)
        out.append(SavePool(pool.name, new, stored=changed, switched_to=switched))
    return out
