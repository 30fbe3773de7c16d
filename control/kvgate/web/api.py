"""The control plane's HTTP API (Flask app factory), served by waitress (``kvgate control``).

Everything under ``/api/v1`` answers JSON; errors use OpenAI's shape
``{"error": {"message", "type", "code"}}`` (plus ``issues: [{"path", "reason"}]`` for a
bad policy). Every mutation needs ``Authorization: Bearer <admin token>``; reads too
unless the policy sets ``control.public_reads``. ``GET /healthz`` is always public.

=======  =====================================  ==================================================
method   path                                   what
=======  =====================================  ==================================================
GET      /admin/                                the admin web page (sign in with the token; see
                                               kvgate.control.admin)
GET      /healthz                               liveness (no auth)
GET      /metrics                               ``kvgate_control_*`` (Prometheus text)
GET      /api/v1/nodes                          every node: state, weights, last report
GET      /api/v1/nodes/<id>                     one node
POST     /api/v1/nodes/<id>/report              an agent's report (see kvgate.agent)
POST     /api/v1/nodes/<id>/drain               → draining (202); 409 from a state that cannot drain
POST     /api/v1/nodes/<id>/undrain             → warming → ramping → active (202)
POST     /api/v1/nodes/<id>/warm                run the warm-up now (202)
GET      /api/v1/pools                          balancer in force, overload degrade
GET      /api/v1/policy                         the running policy (YAML text and version)
POST     /api/v1/policy/validate                422 with field paths, or 200
PUT      /api/v1/policy                         apply (422 bad policy, 500 nginx refused it, 409
                                               ``node_has_work``: it drops a node with work, unless
                                               ``?force=true``)
GET      /api/v1/policy/versions                applied versions, newest first
POST     /api/v1/policy/versions/<n>/rollback   apply version n again (``?force=true`` as for PUT)
GET      /api/v1/events                         newest first; ``?node=&kind=&limit=&before=``
=======  =====================================  ==================================================
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from flask import Flask, Response, jsonify, redirect, render_template, request

from ..policy import PolicyError
from .admin import init_admin
from .plane import ApplyError, Conflict, ControlPlane, NodeHasWork, NotFound
from .report import ReportError, check_report
from .states import InvalidTransition
from .store import StoreError

MAX_POLICY_BYTES = 1024 * 1024


def _error(status: int, message: str, type_: str, code: str | None = None, **extra: Any) -> Response:
    resp = jsonify({"error": {"message": message, "type": type_, "code": code, **extra}})
    resp.status_code = status
    return resp


def _policy_text() -> str:
    """The policy YAML from the body: raw YAML/text, or JSON ``{"yaml": "..."}``."""
    if request.content_length and request.content_length > MAX_POLICY_BYTES:
        raise ValueError(f"policy larger than {MAX_POLICY_BYTES} bytes")
    if request.is_json:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("yaml"), str):
            raise ValueError('expected a JSON object {"yaml": "<policy text>"} or a YAML body')
        return body["yaml"]
    return request.get_data(as_text=True)


def _force() -> bool:
    """The ``?force=true`` flag (also ``1``, ``yes``)."""
    return request.args.get("force", "").lower() in ("1", "true", "yes")


def create_app(plane: ControlPlane, token: str) -> Flask:
    """The API over ``plane``; ``token`` is the admin token (compared in constant time)."""
    app = Flask("kvgate.control")
    app.config["JSON_SORT_KEYS"] = False
    app.config["MAX_CONTENT_LENGTH"] = 4 * MAX_POLICY_BYTES
    app.extensions["kvgate_plane"] = plane

    def authorized() -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    @app.before_request
    def _auth():
        if request.path in ("/", "/healthz", "/favicon.ico") or request.blueprint == "admin":
            return None  # the admin page signs in on its own (session cookie or Bearer)
        if request.url_rule is None and (request.path == "/admin" or request.path.startswith("/admin/")):
            return None  # no such page (an HTML 404 follows), or /admin → /admin/
        public = plane.policy is not None and plane.policy.control.public_reads
        if request.method in ("GET", "HEAD") and public:
            return None
        if not authorized():
            return _error(401, "missing or wrong admin token: send 'Authorization: Bearer <token>' "
                          "(`kvgate token` prints it)", "authentication_error", "invalid_token")
        return None

    @app.errorhandler(NotFound)
    def _not_found(exc: NotFound):
        return _error(404, str(exc.args[0] if exc.args else exc), "not_found_error", "not_found")

    @app.errorhandler(InvalidTransition)
    def _conflict(exc: InvalidTransition):
        return _error(409, str(exc), "conflict_error", "invalid_transition",
                      state=exc.current, wanted=exc.wanted)

    @app.errorhandler(ReportError)
    def _bad_report(exc: ReportError):
        return _error(422, str(exc), "invalid_request_error", "invalid_report", issues=exc.issues)

    @app.errorhandler(Conflict)
    def _refused(exc: Conflict):
        return _error(409, str(exc), "conflict_error", "conflict")

    @app.errorhandler(NodeHasWork)
    def _has_work(exc: NodeHasWork):
        return _error(409, str(exc), "conflict_error", "node_has_work", nodes=exc.nodes,
                      inflight=sum(n["inflight"] for n in exc.nodes))

    @app.errorhandler(PolicyError)
    def _bad_policy(exc: PolicyError):
        return _error(422, "invalid policy: " + "; ".join(str(i) for i in exc.issues), "invalid_request_error",
                      "invalid_policy", issues=[{"path": i.path, "reason": i.reason} for i in exc.issues])

    @app.errorhandler(ApplyError)
    def _apply_failed(exc: ApplyError):
        return _error(500, f"the gateway config was not applied; the running one keeps serving: {exc}",
                      "server_error", "apply_failed")

    @app.errorhandler(StoreError)
    def _store(exc: StoreError):
        return _error(503, str(exc), "server_error", "redis_unavailable")

    @app.errorhandler(ValueError)
    def _bad_request(exc: ValueError):
        return _error(400, str(exc), "invalid_request_error", "bad_request")

    @app.errorhandler(404)
    def _no_route(_exc):
        if request.path.startswith("/admin"):
            return render_template("admin/error.html", title="Not found",
                                   message=f"There is no page at {request.path}."), 404
        return _error(404, f"no such endpoint: {request.method} {request.path}", "not_found_error", "not_found")

    @app.errorhandler(405)
    def _no_method(_exc):
        if request.path.startswith("/admin"):
            return render_template("admin/error.html", title="Method not allowed",
                                   message=f"{request.method} is not allowed on {request.path}."), 405
        return _error(405, f"method {request.method} not allowed on {request.path}", "invalid_request_error",
                      "method_not_allowed")

    @app.errorhandler(413)
    def _too_large(_exc):
        if request.path.startswith("/admin") and "text/html" in request.headers.get("Accept", ""):
            return render_template("admin/error.html", title="Too large",
                                   message="The form is larger than the control plane accepts (4 MiB)."), 413
        return _error(413, "request body too large", "invalid_request_error", "too_large")

    @app.get("/")
    def root():
        return redirect("/admin/", 302)

    @app.get("/favicon.ico")
    def favicon():
        return Response(status=204)

    @app.get("/healthz")
    def healthz():
        return jsonify({"status": "ok", "policy_version": (plane.policy_version or {}).get("version"),
                        "redis": plane.store.ping()})

    @app.get("/metrics")
    def metrics():
        return Response(plane.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.get("/api/v1/nodes")
    def nodes():
        return jsonify({"nodes": plane.nodes_view()})

    @app.get("/api/v1/nodes/<node_id>")
    def node(node_id: str):
        with plane.lock:
            return jsonify(plane.node_view(node_id))

    @app.post("/api/v1/nodes/<node_id>/report")
    def report(node_id: str):
        return jsonify(plane.report(node_id, check_report(request.get_json(silent=True))))

    @app.post("/api/v1/nodes/<node_id>/drain")
    def drain(node_id: str):
        return jsonify(plane.drain(node_id, reason="API", force=_force())), 202

    @app.post("/api/v1/nodes/<node_id>/undrain")
    def undrain(node_id: str):
        return jsonify(plane.undrain(node_id, reason="API")), 202

    @app.post("/api/v1/nodes/<node_id>/warm")
    def warm(node_id: str):
        return jsonify(plane.warm(node_id, reason="API")), 202

    @app.get("/api/v1/pools")
    def pools():
        return jsonify({"pools": plane.pools_view()})

    @app.get("/api/v1/policy")
    def policy_get():
        v = plane.policy_version or {}
        return jsonify({"version": v.get("version"), "yaml": v.get("yaml"), "source": v.get("source"),
                        "applied_at": v.get("applied_at"), "digest": v.get("digest")})

    @app.post("/api/v1/policy/validate")
    def policy_validate():
        try:
            p = plane.validate(_policy_text())
        except ApplyError as exc:  # nothing was being applied: the policy is invalid (422), not a server fault
            reason = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
            return _error(422, f"invalid policy: {reason}", "invalid_request_error", "invalid_policy",
                          issues=[{"path": "", "reason": reason}])
        return jsonify({"valid": True, "pools": len(p.pools), "nodes": len(p.nodes())})

    @app.put("/api/v1/policy")
    def policy_apply():
        source = request.headers.get("X-Kvgate-Source", "API")[:100]
        return jsonify(plane.apply_policy(_policy_text(), source, force=_force()))

    @app.get("/api/v1/policy/versions")
    def versions():
        return jsonify({"versions": [{k: v for k, v in ver.items()} for ver in plane.store.versions()]})

    @app.post("/api/v1/policy/versions/<int:version>/rollback")
    def rollback(version: int):
        return jsonify(plane.rollback(version, by="API", force=_force()))

    @app.get("/api/v1/events")
    def events():
        try:
            limit = max(1, min(1000, int(request.args.get("limit", 100))))
        except ValueError:
            raise ValueError("limit must be an integer") from None
        before = request.args.get("before") or None
        if before is not None and not re.fullmatch(r"\d{1,19}(-\d{1,19})?", before):
            # Redis would refuse it, and that must not read as "Redis unavailable" (503)
            raise ValueError(f"before must be an event id such as 1700000000000-0, got {before[:40]!r}")
        return jsonify({"events": plane.store.events(limit=limit, node=request.args.get("node") or None,
                                                     kind=request.args.get("kind") or None, before=before)})

    init_admin(app, plane, token)
    return app
