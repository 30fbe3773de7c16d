"""The control plane's domain errors (the web layer maps each to a status and an error type).

Re-exported by :mod:`kvgate.control.plane`; :class:`kvgate.fleet.states.InvalidTransition`
(409) is the state machine's.
"""

from __future__ import annotations

from typing import Any


class ApplyError(RuntimeError):
    """nginx refused or failed to load a config; the running config keeps serving."""


class NotFound(KeyError):
    """No node (or version) with that id."""


class Conflict(RuntimeError):
    """The action is refused in the current situation (the API answers 409): a warm-up already
    runs, or draining would leave a pool without a serving node."""


class NodeHasWork(Conflict):
    """A policy apply would remove nodes that still have work (the API answers 409,
    ``code: node_has_work``); nothing was applied.

    ``nodes``: ``[{"id", "state", "inflight": int (the larger known count), "inflight_gateway":
    float | None, "inflight_engine": float | None}]``."""

    def __init__(self, message: str, nodes: list[dict[str, Any]]):
        super().__init__(message)
        self.nodes = nodes


class StaleVersion(Conflict):
    """A policy edited from a version that is no longer the running one (the API answers 409,
    ``code: stale_base_version``); nothing was applied. ``running``: the running version."""

    def __init__(self, message: str, running: int | None):
        super().__init__(message)
        self.running = running
