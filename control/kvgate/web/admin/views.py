"""The admin web page: blueprint ``admin`` under ``/admin`` (Flask + Jinja2), thin views over the services.

Pages (one template each, on ``templates/admin/base.html``):

=============================  ===========================================================
``/admin/``                    Fleet: one row per node, live figures, drain / undrain / warm,
                               15-minute charts of prefix-cache hit ratio and queue depth
``/admin/pools``               balancer in force, overload degrade, affinity ratio, hottest
                               route keys, failovers
``/admin/cache``               HIT / MISS / BYPASS per pool, entries and memory, invalidate
``/admin/costs``               cost and savings by lever per tenant, cost over time, cost per
                               successful request, the last hour's four quadrants (admin/costs.py)
``/admin/policy``              running YAML, edit, check (inline errors, diff), apply,
                               versions with rollback
``/admin/events``              newest first, filter by node and kind
=============================  ===========================================================

Sign-in: the admin token (``kvgate token`` prints it) → a signed session cookie
(HttpOnly, SameSite=Strict, 12 h). Every form carries a CSRF token (Flask-WTF); a POST
without a valid one answers 400 and changes nothing. A script may send
``Authorization: Bearer <token>`` instead (no cookie, no CSRF token) and gets JSON. Every view
but the sign-in page is :func:`kvgate.web.auth.require_admin`; a refused action answers with
its status and code from the one error table (:mod:`kvgate.web.errors`). The figures come
from :mod:`kvgate.web.admin.fleet`, the editor's helpers from :mod:`kvgate.web.admin.editor`.
Every action works as a plain form without JavaScript (GET shows a confirmation page,
POST acts and redirects back); ``static/admin.js`` turns the confirmation into a dialog,
follows the action's progress and refreshes the figures without reloading the page.
"""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, current_app, flash, g, jsonify, redirect, render_template, request, url_for

from ...control import states as st
from ...control.plane import ApplyError, Conflict, NodeHasWork, NotFound
from ...control.store import StoreError
from ...fleet.events import EventKind
from ...policy import PolicyError
from ..auth import actor, csrf, is_token, require_admin, sign_in, sign_out, signed_in
from ..errors import error_page, json_error, lookup, wants_json
from ..state import services, state
from .editor import annotate, diff_lines
from .fleet import TRAFFIC_WINDOW_S, _ago, _pct, _when, fleet_rows, gateway_rows, pool_lines

MAX_POLICY_BYTES = 1024 * 1024
"""The largest policy the editor takes (the API's limit too: kvgate.web.api)."""

EVENT_KINDS = tuple(k.value for k in EventKind)

ACTIONS = {
    "drain": {"label": "Drain", "target": st.DRAINED, "verb": "drained",
              "confirm": "Drain {node}? Only its keys move, to their next nodes on the ring; requests in flight "
                         "on it finish. It takes no traffic until you undrain it."},
    "undrain": {"label": "Undrain", "target": st.ACTIVE, "verb": "back in service",
                "confirm": "Undrain {node}? It is warmed with the pool's hot prefixes, then ramped back to its "
                           "weight step by step."},
    "warm": {"label": "Warm", "target": None, "verb": "warmed",
             "confirm": "Warm {node} now? The pool's warm-up prompts and hottest prefixes are sent to it directly "
                        "(its state does not change)."},
}

bp = Blueprint("admin", __name__, url_prefix="/admin", template_folder="templates",
               static_folder="static", static_url_path="/static")


def _traffic():
    return state().traffic


def _states(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {r["id"]: r["state"] for r in rows}


def _safe_next(target: str | None) -> str:
    """Only a path of this page (no other host): sign-in must not become an open redirect."""
    if target:
        parts = urlsplit(target)
        if (not parts.scheme and not parts.netloc and parts.path.startswith("/admin") and "\\" not in target
                and not any(ord(c) < 32 or ord(c) == 127 for c in target)):
            return target
    return url_for("admin.fleet")


@bp.before_request
def _cookie_policy():
    g.admin_via = None
    policy = services().policy
    if policy is not None:
        # served over HTTPS itself (control.tls): the cookie never goes out in clear either
        current_app.config["SESSION_COOKIE_SECURE"] = policy.control.admin_cookie_secure or policy.control.tls is not None


@bp.after_app_request
def _headers(resp: Response) -> Response:
    if not request.path.startswith("/admin"):
        return resp
    resp.headers.setdefault("Cache-Control", "no-store")
    resp.headers["X-Frame-Options"] = "DENY"
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"
    resp.headers["Content-Security-Policy"] = ("default-src 'self'; script-src 'self'; style-src 'self' "
                                               "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; "
                                               "form-action 'self'; base-uri 'none'")
    return resp


@bp.app_context_processor
def _context():
    if not request.path.startswith("/admin"):
        return {}
    plane = services()
    ref = urlsplit(request.referrer or "")
    back = ref.path + (f"?{ref.query}" if ref.query else "") if ref.netloc == request.host else None
    return {"plane": plane, "policy_version": plane.policy_version or {}, "fmt_when": _when, "fmt_pct": _pct,
            "cancel_url": _safe_next(back),
            "fmt_ago": _ago, "gateway_ok": plane.gateway_ok, "now": time.time()}


def done(message: str, status: int = 200, category: str = "ok", json_extra: dict[str, Any] | None = None,
         back: str | None = None, code: str | None = None):
    """An action's outcome: JSON for scripts and the page's JS, else a flash and a redirect (303)."""
    if wants_json():
        if category == "error":
            return json_error(status, message, "invalid_request_error" if status < 500 else "server_error",
                              code or "failed")
        return jsonify({"ok": True, "message": message, "at": time.time(), **(json_extra or {})}), status
    flash(message, category)
    return redirect(back or url_for("admin.fleet"), 303)


def failed(exc: Exception, back: str | None = None, message: str | None = None):
    """A refused action (a domain error): its status and code from the error table
    (kvgate.web.errors), as a flash and a redirect back, or JSON."""
    kind = lookup(exc)
    if kind is None:
        raise exc
    return done(message if message is not None else kind.message(exc), kind.status, "error", back=back,
                code=kind.code)


# ------------------------------------------------------------------ sign-in
@bp.route("/login", methods=["GET", "POST"])
def login():
    nxt = _safe_next(request.values.get("next"))
    if request.method == "GET":
        if signed_in():
            return redirect(nxt, 303)
        return render_template("admin/login.html", next=nxt, error=None)
    csrf.protect()
    given = request.form.get("token", "").strip()
    if not given or not is_token(given):
        current_app.logger.warning("admin sign-in refused from %s", request.remote_addr)
        return render_template("admin/login.html", next=nxt,
                               error="That is not the admin token. `kvgate token` prints it."), 401
    sign_in()
    return redirect(nxt, 303)


@bp.post("/logout")
@require_admin
def logout():
    sign_out()
    flash("Signed out.", "ok")
    return redirect(url_for("admin.login"), 303)


# -------------------------------------------------------------------- fleet
@bp.get("/")
@require_admin
def fleet():
    plane = services()
    rows = fleet_rows(plane)
    return render_template("admin/fleet.html", rows=rows, pools=pool_lines(plane, _traffic(), _states(rows)),
                           actions=ACTIONS, traffic_error=_traffic().get(plane).get("error"), page="fleet",
                           gateways=gateway_rows(plane))


@bp.get("/fleet.json")
@require_admin
def fleet_json():
    plane = services()
    rows = fleet_rows(plane)
    pools = [{"name": p["name"], "balancer_in_force": p["balancer_in_force"], "degraded": p["degraded"],
              "affinity": _pct(p["affinity_ratio"], 1), "hit": _pct((p["cache_ratio"] or {}).get("HIT"), 1),
              "errors": _pct(p["error_ratio"], 1), "serving": p["serving"], "nodes": len(p["nodes"])}
             for p in pool_lines(plane, _traffic(), _states(rows))]
    return jsonify({"rows": rows, "pools": pools, "at": time.time(),
                    "gateway_ok": plane.gateway_ok, "gateways": gateway_rows(plane),
                    "policy_version": (plane.policy_version or {}).get("version")})


@bp.get("/history.json")
@require_admin
def history_json():
    plane = services()
    assert plane.policy is not None
    now = time.time()
    return jsonify({"window_s": plane.history.window_s, "now": now,
                    "nodes": {n.id: plane.history.series(n.id, now=now) for n in plane.policy.nodes()}})


@bp.route("/nodes/<node_id>/<action>", methods=["GET", "POST"])
@require_admin
def node_action(node_id: str, action: str):
    plane = services()
    spec = ACTIONS.get(action)
    if spec is None:
        return error_page("Not found", f"no action {action!r} (drain, undrain or warm)", 404)
    if request.method == "GET":
        view = plane.node_view(node_id)  # NotFound → the error table's 404 page
        return render_template("admin/confirm.html", action=action, spec=spec, node=view,
                               message=spec["confirm"].format(node=node_id),
                               post_url=url_for("admin.node_action", node_id=node_id, action=action),
                               page="fleet")
    who = actor()
    try:
        if action == "drain":
            force = request.form.get("force", "").lower() in ("1", "true", "yes", "on")
            with plane.lock:
                before = plane.node_view(node_id)["state"]
                view = plane.drain(node_id, reason=who, force=force)
            message = (f"{node_id} is already {before}: nothing to do." if before in (st.DRAINING, st.DRAINED)
                       else f"{node_id}: drain started; it becomes drained when nothing is in flight on it.")
        elif action == "undrain":
            view = plane.undrain(node_id, reason=who)
            message = f"{node_id}: undrain started (warming, then ramping)."
        else:
            view = plane.warm(node_id, reason=who)
            message = f"{node_id}: warm-up started."
    except Conflict as exc:
        text = str(exc)
        cli_hint = "force it (kvgate drain --force, or force=true in the API) to do it anyway"
        if cli_hint in text and not wants_json():
            text = text.replace(cli_hint, "tick 'Drain even if it is the last serving node' "
                                "on the confirmation to do it anyway")
        return failed(exc, message=text)
    except (NotFound, ValueError, ApplyError, StoreError) as exc:  # ValueError: InvalidTransition
        return failed(exc)
    return done(message, 202, json_extra={"node": view, "target": spec["target"]})


# -------------------------------------------------------------------- pools
@bp.get("/pools")
@require_admin
def pools():
    plane = services()
    t = _traffic().get(plane)
    return render_template("admin/pools.html", pools=pool_lines(plane, _traffic()), traffic=t.get("pools") or {},
                           traffic_error=t.get("error"), window_s=TRAFFIC_WINDOW_S, page="pools")


# -------------------------------------------------------------------- cache
@bp.get("/cache")
@require_admin
def cache():
    plane = services()
    t = _traffic().get(plane, cache_stats=True)
    assert plane.policy is not None
    return render_template("admin/cache.html", traffic=t.get("pools") or {}, stats=t.get("cache"),
                           traffic_error=t.get("error"), cache_cfg=plane.policy.cache,
                           namespace=plane.namespace_in_force,
                           pool_names=[p.name for p in plane.policy.pools], window_s=TRAFFIC_WINDOW_S,
                           knowledge=_knowledge(plane), page="cache")


def _knowledge(plane) -> dict[str, int]:
    """pool → knowledge_version in force, for the pools with the semantic cache or static answers."""
    from ...control.semcache import knowledge_in_force

    assert plane.policy is not None
    on = {p.name for p in plane.policy.pools if p.semantic.enabled or p.semantic.static_answers}
    return {k: v for k, v in knowledge_in_force(plane).items() if k in on}


@bp.route("/cache/knowledge/<pool>", methods=["GET", "POST"])
@require_admin
def cache_bump_knowledge(pool: str):
    from ...control.semcache import CacheOpError

    plane = services()
    back = url_for("admin.cache")
    v = _knowledge(plane).get(pool)
    if v is None:
        return done(f"Pool {pool!r} has neither the semantic cache nor static answers.", 400, "error", back=back,
                    code="invalid_request")
    if request.method == "GET":
        return render_template("admin/confirm.html", action="bump-knowledge",
                               spec={"label": "Bump the knowledge version"}, node=None,
                               post_url=url_for("admin.cache_bump_knowledge", pool=pool), page="cache",
                               message=f"Retire the semantic cache of pool {pool}? Its knowledge version goes from "
                                       f"{v} to {v + 1}: no cached paraphrase answers again. Old entries expire "
                                       "by their TTL.")
    try:
        out = plane.bump_knowledge(pool, actor())
    except CacheOpError as exc:
        return done(str(exc), 400, "error", back=back, code="invalid_request")
    except (ApplyError, StoreError) as exc:
        return failed(exc, back=back)
    return done(f"Semantic cache of pool {pool} retired: knowledge version {out['old']} → {out['new']}.", 200,
                json_extra=out, back=back)


@bp.route("/cache/invalidate", methods=["GET", "POST"])
@require_admin
def cache_invalidate():
    plane = services()
    assert plane.policy is not None
    if request.method == "GET":
        v = plane.namespace_in_force
        return render_template("admin/confirm.html", action="invalidate", spec={"label": "Invalidate the cache"},
                               node=None, post_url=url_for("admin.cache_invalidate"), page="cache",
                               message=f"Invalidate the whole response cache? The namespace version goes from "
                                       f"{v} to {v + 1} (a new policy version): every cached answer is "
                                       "recomputed on its next request. Old entries expire by their TTL.")
    back = url_for("admin.cache")
    try:
        out = plane.invalidate_cache(actor())
    except (PolicyError, ApplyError, StoreError) as exc:
        return failed(exc, back=back)
    except ValueError as exc:  # as the page always answered it: Redis state unusable
        return done(str(exc), 503, "error", back=back, code="redis_unavailable")
    _traffic().reset()
    return done(f"Response cache invalidated: namespace version {out['old']} → {out['new']} "
                f"(policy version {out['version']}).", 200, json_extra=out, back=back)


# ------------------------------------------------------------------- policy
def policy_page(text: str | None = None, status: int = 200, **ctx: Any):
    plane = services()
    running = plane.policy_version or {}
    try:
        versions = plane.store.versions()
        events = [e for e in plane.store.events(limit=200) if str(e.get("kind", "")).startswith(
            ("policy", "reload", "cache_invalidated"))][:8]
    except StoreError as exc:
        versions, events = [], []
        ctx.setdefault("store_error", str(exc))
    return render_template("admin/policy.html", text=running.get("yaml", "") if text is None else text,
                           running=running, versions=versions, events=events, page="policy",
                           base_version=ctx.pop("base_version", running.get("version")), **ctx), status


def check(text: str) -> dict[str, Any]:
    """Validate ``text``: ``{"issues", "lines", "unplaced", "diff", "valid", "changed"}``."""
    plane = services()
    running = plane.policy_version or {}
    issues: list[dict[str, Any]] = []
    try:
        plane.validate(text)
    except PolicyError as exc:
        issues = [{"path": i.path, "reason": i.reason} for i in exc.issues]
    except ApplyError as exc:
        issues = [{"path": "", "reason": "nginx refused the rendered config: "
                   + " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())}]
    lines, unplaced = annotate(text, issues)
    diff = diff_lines(running.get("yaml", ""), text, f"running (version {running.get('version')})", "your edit")
    return {"issues": issues, "lines": lines, "unplaced": unplaced, "diff": diff, "valid": not issues,
            "changed": bool(diff)}


def form_text() -> tuple[str, Any]:
    """The edited policy (line ends normalised) and, when it is too large, the page refusing
    it (with the edit kept in the editor)."""
    text = request.form.get("yaml", "").replace("\r\n", "\n")
    if len(text.encode()) > MAX_POLICY_BYTES:
        return text, policy_page(text, status=413, store_error="The policy is larger than 1 MiB: not checked, "
                                 "not applied.")
    return text, None


@bp.get("/policy")
@require_admin
def policy():
    return policy_page()


@bp.post("/policy/check")
@require_admin
def policy_check():
    text, refused = form_text()
    if refused:
        return refused
    result = check(text)
    running_v = (services().policy_version or {}).get("version")
    base = request.form.get("base_version", type=int)
    if base is not None and running_v is not None and base != running_v:
        result["stale"] = (f"The running policy changed to version {running_v} since you loaded version {base}: "
                           "the diff below is against the running one.")
    if wants_json():
        return jsonify({k: result[k] for k in ("issues", "valid", "changed", "diff")}), 200 if result["valid"] else 422
    return policy_page(text, 200 if result["valid"] else 422, result=result,
                       base_version=running_v if result.get("stale") else base)


@bp.post("/policy/apply")
@require_admin
def policy_apply():
    text, refused = form_text()
    if refused:
        return refused
    # the base check and the apply in one critical section: two operators applying edits of
    # the same version must not overwrite each other unseen (plane.lock is re-entrant)
    with services().lock:
        return _apply_locked(text, request.form.get("base_version", type=int), actor())


def _apply_locked(text: str, base: int | None, who: str):
    plane = services()
    running = plane.policy_version or {}
    if base is not None and running.get("version") is not None and base != running.get("version"):
        result = check(text)
        result["stale"] = (f"The running policy changed to version {running.get('version')} since you loaded "
                           f"version {base}: review the diff against it, then apply again.")
        if wants_json():
            return json_error(409, result["stale"], "conflict_error", "stale_base_version")
        return policy_page(text, 409, result=result, base_version=running.get("version"))
    try:
        out = plane.apply_policy(text, who)
    except StoreError as exc:
        return failed(exc, back=url_for("admin.policy"))
    except (PolicyError, NodeHasWork, ApplyError) as exc:
        kind = lookup(exc)
        assert kind is not None
        if wants_json():
            if isinstance(exc, PolicyError):  # the page's script shows the issues, not the joined text
                return json_error(kind.status, "invalid policy", kind.type, kind.code, **kind.extra(exc))
            if isinstance(exc, NodeHasWork):
                return json_error(kind.status, str(exc), kind.type, kind.code, nodes=exc.nodes)
            return json_error(kind.status, f"not applied; the running config keeps serving: {exc}", kind.type,
                              kind.code)
        result = check(text)
        if isinstance(exc, NodeHasWork):  # the page has no force: drain first (the API and CLI can force)
            result["apply_error"] = f"{str(exc)[:1].upper()}{str(exc)[1:]}."  # says the running one serves
        elif isinstance(exc, ApplyError):
            result["apply_error"] = f"Not applied; the running config keeps serving. {exc}"
        return policy_page(text, kind.status, result=result, base_version=base)
    msg = (f"Policy version {out['version']} applied (gateway {out['result']})." if out["changed"]
           else "The policy is the same as the running one: nothing to apply.")
    _traffic().reset()
    return done(msg, 200, json_extra=out, back=url_for("admin.policy"))


@bp.get("/policy/versions/<int:version>")
@require_admin
def policy_version(version: int):
    plane = services()
    v = next((v for v in plane.store.versions() if v["version"] == version), None)  # StoreError → 503 page
    if v is None:
        return error_page("Not found", f"no stored policy version {version}", 404)
    running = plane.policy_version or {}
    diff = diff_lines(running.get("yaml", ""), v["yaml"], f"running (version {running.get('version')})",
                      f"version {version}")
    return render_template("admin/policy_version.html", v=v, diff=diff, running=running, page="policy")


@bp.route("/policy/versions/<int:version>/rollback", methods=["GET", "POST"])
@require_admin
def policy_rollback(version: int):
    if request.method == "GET":
        return render_template("admin/confirm.html", action="rollback",
                               spec={"label": f"Roll back to version {version}"}, node=None, page="policy",
                               post_url=url_for("admin.policy_rollback", version=version),
                               message=f"Apply policy version {version} again (as a new version)?")
    back = url_for("admin.policy")
    try:
        out = services().rollback(version, by=actor())
    except NodeHasWork as exc:
        return failed(exc, back=back, message=str(exc))
    except (NotFound, PolicyError, ApplyError, StoreError) as exc:
        return failed(exc, back=back)
    return done(f"Rolled back to version {version}: now version {out['version']} (gateway {out['result']}).",
                200, json_extra=out, back=back)


# ------------------------------------------------------------------- events
@bp.get("/events")
@require_admin
def events():
    plane = services()
    assert plane.policy is not None
    node = request.args.get("node") or None
    kind = request.args.get("kind") or None
    before = request.args.get("before") or None
    if before is not None and not re.fullmatch(r"\d{1,19}(-\d{1,19})?", before):
        return error_page("Bad request", "before must be an event id such as 1700000000000-0", 400)
    limit = 100
    error = None
    try:
        evs = plane.store.events(limit=limit + 1, node=node, kind=kind, before=before)
    except StoreError as exc:
        evs, error = [], str(exc)
    more = len(evs) > limit
    evs = evs[:limit]
    if wants_json():
        return jsonify({"events": evs})
    return render_template("admin/events.html", events=evs, node=node, kind=kind, kinds=EVENT_KINDS,
                           paged=bool(before), node_ids=[n.id for n in plane.policy.nodes()], error=error,
                           page="events", older=evs[-1]["id"] if more and evs else None)
