"""What a request's view reaches through ``current_app``: the services and the admin token.

:func:`kvgate.web.create_app` puts one :class:`WebState` in ``app.extensions["kvgate"]``;
views call :func:`services` instead of closing over a plane (flaskr's shape: module-level
blueprints, state on the app), so two apps in one process (tests) never share anything.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from flask import current_app


class Services(Protocol):
    """What the views call on the control plane (:class:`kvgate.control.plane.ControlPlane`;
    tests/web/webfixtures.py has a fake with the same names). Reads return JSON-ready dicts;
    actions raise the domain errors of :data:`kvgate.web.errors.ERRORS`."""

    policy: Any                      # the Policy in force (None before the first apply)
    policy_version: dict[str, Any] | None
    store: Any                       # ping, versions, events, session_revoked, revoke_session
    metrics: Any                     # render() -> Prometheus text
    history: Any                     # kvgate.web.admin.history.History
    lock: AbstractContextManager     # held around an action's check and the action
    gateway_ok: bool
    namespace_in_force: int
    snapshot: Any                    # kvgate.control.views.Snapshot (its gateway scrape: breakers)

    def nodes_view(self) -> list[dict[str, Any]]: ...
    def node_view(self, node_id: str) -> dict[str, Any]: ...
    def pools_view(self) -> list[dict[str, Any]]: ...
    def serving_weights(self) -> dict[str, int]: ...
    def report(self, node_id: str, report: dict[str, Any]) -> dict[str, Any]: ...
    def drain(self, node_id: str, reason: str | None = None, force: bool = False) -> dict[str, Any]: ...
    def undrain(self, node_id: str, reason: str | None = None) -> dict[str, Any]: ...
    def warm(self, node_id: str, reason: str | None = None) -> dict[str, Any]: ...
    def validate(self, text: str) -> Any: ...
    def apply_policy(self, text: str, source: str, force: bool = False) -> dict[str, Any]: ...
    def rollback(self, version: int, by: str | None = None, force: bool = False) -> dict[str, Any]: ...
    def invalidate_cache(self, source: str) -> dict[str, Any]: ...
    def bump_knowledge(self, pool: str, source: str) -> dict[str, Any]: ...
    def invalidate_tag(self, tag: str, source: str) -> dict[str, Any]: ...
    def event(self, kind: Any, message: str, node: str | None = None, pool: str | None = None,
              **data: Any) -> None: ...


@dataclass
class WebState:
    """``services``: the control plane (:class:`kvgate.control.plane.ControlPlane`, or a fake
    with the same methods in tests); ``token``: the admin token; ``traffic``: the admin
    page's request-log figures (:class:`kvgate.web.admin.fleet.TrafficCache`)."""

    services: Services
    token: str
    traffic: Any


def state() -> WebState:
    return current_app.extensions["kvgate"]


def services() -> Services:
    """The control plane behind this app."""
    return state().services
