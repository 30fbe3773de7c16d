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

from flask import Flask, Response, current_app, g, jsonify, render_template, request
from flask_wtf.csrf import CSRFError

import redis

from ..batch.files import BatchApiError, FileInUse, FileNotFound, FileTooLarge, InvalidRequest
from ..batch.jobs import BatchNotCancellable, BatchNotFound
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


def _param(exc: BaseException) -> dict[str, Any]:
    """OpenAI's ``error.param`` (the Batch API's errors name the field at fault, or null)."""
    return {"param": getattr(exc, "param", None)}


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
    redis.RedisError: ErrorKind(503, "server_error", "redis_unavailable", "Redis unavailable",
                                lambda e: f"Redis cannot be reached right now; retry in a few seconds ({e})", _param),
    # the Batch API (/v1/files, /v1/batches; kvgate.batch.files, kvgate.batch.jobs): OpenAI's error type
    FileNotFound: ErrorKind(404, "invalid_request_error", "file_not_found", "No such file", extra=_param),
    BatchNotFound: ErrorKind(404, "invalid_request_error", "batch_not_found", "No such batch", extra=_param),
    FileTooLarge: ErrorKind(413, "invalid_request_error", "file_too_large", "Too large", extra=_param),
    FileInUse: ErrorKind(409, "invalid_request_error", "file_in_use", "File in use", extra=_param),
    BatchNotCancellable: ErrorKind(409, "invalid_request_error", "batch_not_cancellable", "Not possible now",
                                   extra=_param),
    InvalidRequest: ErrorKind(400, "invalid_request_error", "invalid_request", "Bad request", extra=_param),
    BatchApiError: ErrorKind(400, "invalid_request_error", "invalid_request", "Bad request", extra=_param),
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
    """``exc`` as the API answers it (its :data:`ERRORS` entry; an unknown exception is re-raised).
    Under ``/v1/`` (tenants, not operators) ``param`` is always there and a server error's
    message does not name kvgate's internals (the log has them)."""
    kind = lookup(exc)
    if kind is None:
        raise exc
    message, extra = kind.message(exc), kind.extra(exc)
    if is_openai_path():
        extra = {"param": None, **extra}
        if kind.status >= 500:
            current_app.logger.warning("%s %s: %s", request.method, request.path, message)
            message = "The service cannot reach its state store right now; retry in a few seconds." \
                if kind.code == "redis_unavailable" else "The server had an error while processing your request."
    return json_error(kind.status, message, kind.type, kind.code, **extra)


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


def is_openai_path() -> bool:
    """Under ``/v1/`` (the Batch API): errors in OpenAI's exact shape, ``param`` included."""
    return request.path == "/v1" or request.path.startswith("/v1/")


def register(app: Flask) -> None:
    """Install the handlers: every :data:`ERRORS` class, and the HTTP errors Flask raises
    itself (404 no route, 405 method, 413 body too large, 500 under ``/v1/``): JSON, or the
    HTML page under /admin; under ``/v1/`` OpenAI's ``{"error": {message, type, param, code}}``."""
    for cls in ERRORS:
        app.register_error_handler(cls, _domain_error)

    @app.errorhandler(500)
    def _internal(exc):
        if is_openai_path():
            return json_error(500, "The server had an error while processing your request; the control plane's "
                              "log has the details.", "server_error", "internal_error", param=None)
        return exc  # Flask's own 500 page, as before

    @app.errorhandler(404)
    def _no_route(_exc):
        if is_openai_path():
            return json_error(404, f"Invalid URL ({request.method} {request.path})", "invalid_request_error",
                              "unknown_url", param=None)
        if _is_admin():
            return error_page("Not found", f"There is no page at {request.path}.", 404)
        return json_error(404, f"no such endpoint: {request.method} {request.path}", "not_found_error", "not_found")

    @app.errorhandler(405)
    def _no_method(_exc):
        if is_openai_path():
            return json_error(405, f"Invalid method for URL ({request.method} {request.path})",
                              "invalid_request_error", "method_not_allowed", param=None)
        if _is_admin():
            return error_page("Method not allowed", f"{request.method} is not allowed on {request.path}.", 405)
        return json_error(405, f"method {request.method} not allowed on {request.path}", "invalid_request_error",
                          "method_not_allowed")

    @app.errorhandler(413)
    def _too_large(_exc):
        if is_openai_path():
            return json_error(413, "The request body is larger than this endpoint accepts.", "invalid_request_error",
                              "too_large", param=None)
        if _is_admin() and "text/html" in request.headers.get("Accept", ""):
            return error_page("Too large", "The form is larger than the control plane accepts (4 MiB).", 413)
        return json_error(413, "request body too large", "invalid_request_error", "too_large")
