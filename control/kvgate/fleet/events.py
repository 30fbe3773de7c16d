"""Event kinds of the control plane's event log (``kvgate:control:events``).

The values are stored in Redis, shown on the admin page's events view and filtered by
prefix (``kind=reload`` matches ``reload`` and ``reload_failed``,
:meth:`kvgate.control.store.Store.events`): they never change.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    """What an event records."""

    STATE = "state"
    """A node's state transition (``from_state``, ``to_state``, ``reason``)."""
    NODE_ADDED = "node_added"
    NODE_REMOVED = "node_removed"
    POLICY_APPLIED = "policy_applied"
    POLICY_REJECTED = "policy_rejected"
    CACHE_INVALIDATED = "cache_invalidated"
    APIKEY_CREATED = "apikey_created"
    APIKEY_REVOKED = "apikey_revoked"
    BATCH_CANCELLED = "batch_cancelled"
    """An operator cancelled a tenant's batch (``batch``, ``tenant``)."""
    RELOAD = "reload"
    """The gateway's static config was (re)loaded or nginx started (``result``)."""
    RELOAD_FAILED = "reload_failed"
    GATEWAY_LOST = "gateway_lost"
    """A gateway member's supervisor stopped reporting for 3 sync intervals (``gateway``, ``age_s``):
    it is not waited for by applies until it reports again (docs/scale-out.md)."""
    GATEWAY_BACK = "gateway_back"
    """A lost (or never seen) gateway member reports again (``gateway``, ``version``)."""
    RUNTIME_PUSHED = "runtime_pushed"
    """The runtime (weights, node states, balancers, cache namespace) went to the running
    gateway without a reload (:meth:`kvgate.nginxctl.Nginx.apply` answered ``"pushed"``)."""
    ENGINE_RESTARTED = "engine_restarted"
    STORE_BACK = "store_back"
    FAILOVER = "failover"
    EJECT_SKIPPED = "eject_skipped"
    WARMUP = "warmup"
    RAMP = "ramp"
    RAMP_HELD = "ramp_held"
    DEGRADE = "degrade"
    WEIGHT = "weight"
    DRAIN_FAILED = "drain_failed"
