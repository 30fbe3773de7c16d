"""One table from domain errors to HTTP: status, OpenAI error ``type`` and ``code``.

The services (:mod:`kvgate.control.plane`, the store, the policy loader) raise plain
exceptions and never import Flask; this module is the only place that says what each one
means over HTTP. The API answers it as JSON in OpenAI's shape
``{"error": {"message", "type", "code", ...extra}}``; the admin page renders the same entry as
its HTML error page (``admin/error.html``, with the entry's title), or as JSON for its script
and for Bearer clients (:func:`wants_json`).

A lookup walks the exception's MRO, so the most specific entry wins (``NodeHasWork`` before
``Conflict``, ``InvalidTransition`` and ``PolicyError`` before ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, Response, g, jsonify, render_template, request
from flask_wtf.csrf import CSRFError

from ..control.apikeys import ApiKeyError, UnknownKey
from ..control.plane import ApplyError, Conflict, NodeHasWork, NotFound
from ..control.report import ReportError
from ..control.states import InvalidTransition
from ..control.store import StoreError
from ..policy import PolicyError


def _first_arg(exc: BaseException) -> str:
    """``str(KeyError("x"))`` is ``"'x'"``: a KeyError's message is its first argument."""
    return str(exc.args[0]) if exc.args else str(exc)


def _no_extra(_exc: BaseException) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ErrorKind:
    """How one exception class answers: ``status`` (HTTP), ``type`` and ``code`` (the
    ``error`` object's), ``title`` (the HTML page's heading), ``message(exc)`` and
    ``extra(exc)`` (more fields of the ``error`` object, JSON only)."""

    status: int
    type: str
    code: str
    title: str
    message: Callable[[BaseException], str] = str
    extra: Callable[[BaseException], dict[str, Any]] = field(default=_no_extra)


def _policy_message(exc: BaseException) -> str:
    return "invalid policy: " + "; ".join(str(i) for i in getattr(exc, "issues", []))


def _policy_issues(exc: BaseException) -> dict[str, Any]:
    return {"issues": [{"path": i.path, "reason": i.reason} for i in getattr(exc, "issues", [])]}


def _csrf_message(exc: BaseException) -> str:
    return (f"{getattr(exc, 'description', exc)} Nothing was changed. The page may be out of date, or the request "
            "did not come from this page: reload it and try again.")


ERRORS: dict[type[BaseException], ErrorKind] = {
    NotFound: ErrorKind(404, "not_found_error", "not_found", "Not found", _first_arg),
    InvalidTransition: ErrorKind(409, "conflict_error", "invalid_transition", "Not possible now",
                                 extra=lambda e: {"state": e.current, "wanted": e.wanted}),  # type: ignore[attr-defined]
    NodeHasWork: ErrorKind(409, "conflict_error", "node_has_work", "Nodes still have work",
                           extra=lambda e: {"nodes": e.nodes,  # type: ignore[attr-defined]
                                            "inflight": sum(n["inflight"] for n in e.nodes)}),  # type: ignore[attr-defined]
    Conflict: ErrorKind(409, "conflict_error", "conflict", "Not possible now"),
    ReportError: ErrorKind(422, "invalid_request_error", "invalid_report", "Invalid report",
                           extra=lambda e: {"issues": e.issues}),  # type: ignore[attr-defined]
    PolicyError: ErrorKind(422, "invalid_request_error", "invalid_policy", "Invalid policy", _policy_message,
                           _policy_issues),
    ApplyError: ErrorKind(500, "server_error", "apply_failed", "Not applied",
                          lambda e: f"the gateway config was not applied; the running one keeps serving: {e}"),
    StoreError: ErrorKind(503, "server_error", "redis_unavailable", "Redis unavailable"),
    UnknownKey: ErrorKind(404, "not_found_error", "api_key_not_found", "No such API key", _first_arg),
    ApiKeyError: ErrorKind(400, "invalid_request_error", "invalid_api_key_request", "Not possible"),
    CSRFError: ErrorKind(400, "invalid_request_error", "csrf_failed", "Bad request", _csrf_message),
    ValueError: ErrorKind(400, "invalid_request_error", "bad_request", "Bad request"),
}
"""Domain exception → how it answers. Add a service's new exception here, nowhere else."""


def lookup(exc: BaseException) -> ErrorKind | None:
    """The entry of ``exc``'s most specific class in :data:`ERRORS`, or None."""
    for cls in type(exc).__mro__:
        kind = ERRORS.get(cls)
        if kind is not None:
            return kind
    return None


def json_error(status: int, message: str, type_: str, code: str | None = None, **extra: Any) -> Response:
    """``{"error": {"message", "type", "code", **extra}}`` with ``status``."""
    resp = jsonify({"error": {"message": message, "type": type_, "code": code, **extra}})
    resp.status_code = status
    return resp


def error_json(exc: BaseException) -> Response:
    """``exc`` as the API answers it (its :data:`ERRORS` entry; an unknown exception is re-raised)."""
    kind = lookup(exc)
    if kind is None:
        raise exc
    return json_error(kind.status, kind.message(exc), kind.type, kind.code, **kind.extra(exc))


def error_page(title: str, message: str, status: int) -> tuple[str, int]:
    """The admin page's HTML error page."""
    return render_template("admin/error.html", title=title, message=message), status


def wants_json() -> bool:
    """Whether an admin-page request is answered in JSON: a Bearer client, a ``*.json`` URL, or
    an ``Accept`` that prefers JSON to HTML (the page's own script)."""
    if g.get("admin_via") == "bearer" or request.path.endswith(".json"):
        return True
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return best == "application/json" and request.accept_mimetypes[best] > request.accept_mimetypes["text/html"]


def _is_admin() -> bool:
    """Under the admin page's prefix (as the page's headers and 404 page have always been decided)."""
    return request.path.startswith("/admin")


def _domain_error(exc: BaseException):
    kind = lookup(exc)
    assert kind is not None
    if _is_admin() and not wants_json():
        return error_page(kind.title, kind.message(exc), kind.status)
    return error_json(exc)


def register(app: Flask) -> None:
    """Install the handlers: every :data:`ERRORS` class, and the HTTP errors Flask raises
    itself (404 no route, 405 method, 413 body too large): JSON, or the HTML page under /admin."""
    for cls in ERRORS:
        app.register_error_handler(cls, _domain_error)

    @app.errorhandler(404)
    def _no_route(_exc):
        if _is_admin():
            return error_page("Not found", f"There is no page at {request.path}.", 404)
        return json_error(404, f"no such endpoint: {request.method} {request.path}", "not_found_error", "not_found")

    @app.errorhandler(405)
    def _no_method(_exc):
        if _is_admin():
            return error_page("Method not allowed", f"{request.method} is not allowed on {request.path}.", 405)
        return json_error(405, f"method {request.method} not allowed on {request.path}", "invalid_request_error",
                          "method_not_allowed")

    @app.errorhandler(413)
    def _too_large(_exc):
        if _is_admin() and "text/html" in request.headers.get("Accept", ""):
            return error_page("Too large", "The form is larger than the control plane accepts (4 MiB).", 413)
        return json_error(413, "request body too large", "invalid_request_error", "too_large")
