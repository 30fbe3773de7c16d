"""What a request's view reaches through ``current_app``: the services and the admin token.

:func:`kvgate.web.create_app` puts one :class:`WebState` in ``app.extensions["kvgate"]``;
views call :func:`services` instead of closing over a plane (flaskr's shape: module-level
blueprints, state on the app), so two apps in one process (tests) never share anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import current_app


@dataclass
class WebState:
    """``services``: the control plane (:class:`kvgate.control.plane.ControlPlane`, or a fake
    with the same methods in tests); ``token``: the admin token; ``traffic``: the admin
    page's request-log figures (:class:`kvgate.web.admin.fleet.TrafficCache`)."""

    services: Any
    token: str
    traffic: Any


def state() -> WebState:
    return current_app.extensions["kvgate"]


def services() -> Any:
    """The control plane behind this app."""
    return state().services
