"""What the API and the admin page show, read from a :class:`~kvgate.control.plane.Snapshot`
(no lock, no I/O: the caller reads the reports)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..fleet.records import NodeRecord, PoolState
from ..policy.model import Policy
from ..render import Runtime
from .exceptions import NotFound
from .probes import empty_gateway


@dataclass(frozen=True)
class Snapshot:
    """The plane's state after its last change, for the views (records are never changed in
    place, so the maps are shallow copies)."""

    policy: Policy | None = None
    policy_version: dict[str, Any] | None = None
    nodes: Mapping[str, NodeRecord] = dataclasses.field(default_factory=dict)
    pools: Mapping[str, PoolState] = dataclasses.field(default_factory=dict)
    applied: Runtime | None = None
    gateway: Mapping[str, Any] = dataclasses.field(default_factory=empty_gateway)


def node_view(snap: Snapshot, node_id: str, entry: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """One node as the API shows it: its stored record, the weight in force, its last report
    (``entry``: the stored ``{"received_at", "report"}`` or None) and the gateway's in-flight
    count (None when the gateway could not be read). Raises NotFound."""
    rec = snap.nodes.get(node_id)
    if rec is None:
        raise NotFound(f"no node {node_id!r} in the policy")
    return {
        **{k: v for k, v in rec.to_json().items() if k != "engine_start_time_at_eject"},
        "weight": snap.applied.weights.get(node_id) if snap.applied else None,
        "serving": rec.serving,
        "report": entry["report"] if entry else None,
        "report_age_s": round(now - entry["received_at"], 3) if entry else None,
        "inflight_gateway": snap.gateway["inflight"].get(node_id, 0.0) if snap.gateway.get("ok") else None,
    }


def pools_view(snap: Snapshot) -> list[dict[str, Any]]:
    """Every pool with its balancer in force, overload state, nodes and failover count."""
    assert snap.policy is not None
    out = []
    for pool in snap.policy.pools:
        p = snap.pools.get(pool.name) or PoolState()
        out.append({"name": pool.name, "models": pool.models, "balancer": pool.balancer,
                    "balancer_in_force": "least_conn" if p.degraded else pool.balancer,
                    "degraded": p.degraded, "degraded_since": p.since if p.degraded else None,
                    "mean_waiting": p.mean_waiting, "nodes": [n.id for n in pool.nodes],
                    "failovers": snap.gateway["failovers"].get(pool.name)})
    return out
