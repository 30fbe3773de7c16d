"""The admin web page, served by the control plane under ``/admin`` (Flask + Jinja2).

Pages (one template each, on ``templates/admin/base.html``):

=============================  ===========================================================
``/admin/``                    Fleet: one row per node, live figures, drain / undrain / warm,
                               15-minute charts of prefix-cache hit ratio and queue depth
``/admin/pools``               balancer in force, overload degrade, affinity ratio, hottest
                               route keys, failovers
``/admin/cache``               HIT / MISS / BYPASS per pool, entries and memory, invalidate
``/admin/policy``              running YAML, edit, check (inline errors, diff), apply,
                               versions with rollback
``/admin/events``              newest first, filter by node and kind
=============================  ===========================================================

Sign-in: the admin token (``kvgate token`` prints it) → a signed session cookie
(HttpOnly, SameSite=Strict, 12 h). Every form carries a CSRF token (Flask-WTF); a POST
without a valid one answers 400 and changes nothing. A script may send
``Authorization: Bearer <token>`` instead (no cookie, no CSRF token) and gets JSON.
Every action works as a plain form without JavaScript (GET shows a confirmation page,
POST acts and redirects back); ``static/admin.js`` turns the confirmation into a dialog,
follows the action's progress and refreshes the figures without reloading the page.
"""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from flask import (Blueprint, Flask, Response, flash, g, jsonify, redirect, render_template, request, session,
                   url_for)
from flask_wtf.csrf import CSRFError, CSRFProtect

from ..policy import PolicyError
from ..policy.locate import lines_of
from . import states as st
from .plane import ApplyError, Conflict, ControlPlane, NodeHasWork, NotFound
from .states import InvalidTransition
from .store import StoreError

log = logging.getLogger("kvgate.control.admin")

SESSION_HOURS = 12
MAX_POLICY_BYTES = 1024 * 1024
"""The largest policy the editor takes (the API's limit too: kvgate.control.app)."""
TRAFFIC_WINDOW_S = 900.0
"""The Pools and Cache pages (and the Fleet page's pool line) read the last 15 minutes of the request log."""
TRAFFIC_CACHE_S = 3.0
"""The request-log analysis is reused for this long (many open pages cost one analysis)."""
RATE_WINDOW_S = 60.0
"""Requests/s, error rate and the node's prefix-cache hit ratio on the Fleet page are over the last minute."""

EVENT_KINDS = ("state", "reload", "reload_failed", "failover", "degrade", "warmup", "ramp", "ramp_held", "weight",
               "policy_applied", "policy_rejected", "cache_invalidated", "node_added", "node_removed",
               "engine_restarted", "eject_skipped", "drain_failed")

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


# ----------------------------------------------------------------- formatting
def _pct(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}%"


def _num(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def _when(ts: float | None) -> str:
    if not ts:
        return "—"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _weight(w: int | None) -> str:
    """nginx weights are rendered in units of 1/100 of a policy weight (kvgate.render.WEIGHT_SCALE)."""
    from ..render import WEIGHT_SCALE

    return "—" if w is None else f"{w / WEIGHT_SCALE:.2f}"


# ------------------------------------------------------------------ fleet data
def _gpu_cells(report: dict[str, Any] | None) -> tuple[str, str, str]:
    """(memory text, utilisation text, title) from an agent report's ``gpu`` part."""
    if not report:
        return "—", "—", "no agent report yet"
    gpu = report.get("gpu") or {}
    if gpu.get("status") != "ok":
        reason = gpu.get("reason") or "NVML unavailable"
        return "no GPU", "no GPU", f"no GPU figures: {reason}"
    devs = gpu.get("devices") or []
    if not devs:
        return "no GPU", "no GPU", "NVML found no device"
    used = sum(d.get("memory_used_bytes") or 0 for d in devs)
    total = sum(d.get("memory_total_bytes") or 0 for d in devs)
    utils = [d["utilization_pct"] for d in devs if d.get("utilization_pct") is not None]
    util = f"{sum(utils) / len(utils):.0f}%" if utils else "—"
    names = ", ".join(sorted({str(d.get("name") or "GPU") for d in devs}))
    return f"{_gib(used)} / {_gib(total)} GiB", util, f"{len(devs)} × {names}"


def _progress(plane: ControlPlane, n: dict[str, Any], now: float) -> tuple[str, bool]:
    """What the node is doing now, and whether an action is under way (the row shows progress)."""
    state = n["state"]
    warm = n.get("warmup") or {}
    policy = plane.policy
    if state == st.DRAINING and n.get("drain"):
        d = n["drain"]
        gw, en = d.get("inflight_gateway"), d.get("inflight_engine")
        left = max(0.0, d.get("deadline", now) - now)
        return (f"draining for {now - d.get('started', now):.0f} s: {_num(gw)} in flight at the gateway, "
                f"{_num(en)} at the engine (timeout in {left:.0f} s)"), True
    if warm.get("status") == "running":
        done, total = (warm.get("progress") or [0, 0])[:2]
        return f"warm-up running: {done}/{total or '?'} prompt(s) sent", True
    if state == st.WARMING:
        return "warming: waiting for the warm-up to start", True
    if state == st.RAMPING and policy is not None:
        ramp = n.get("ramp") or {}
        steps = policy.ramp.steps
        step = min(ramp.get("step", 0), len(steps) - 1)
        held = f"; held: {ramp['held']}" if ramp.get("held") else ""
        return f"ramping: step {step + 1}/{len(steps)} at {steps[step]:.0%} of its weight{held}", True
    if state == st.JOINING:
        return "joining: waiting for its first passing health check", True
    note = ""
    if warm.get("status") in ("ok", "partial", "failed") and warm.get("result"):
        r = warm["result"]
        ttft = ""
        if r.get("ttft_before_ms") is not None and r.get("ttft_after_ms") is not None:
            ttft = f", TTFT {r['ttft_before_ms']:.0f} → {r['ttft_after_ms']:.0f} ms"
        note = f"last warm-up {warm['status']}: {r.get('sent', 0)} sent{ttft}"
    if state == st.EJECTED:
        text = f"ejected: {(n.get('health') or {}).get('last_error') or n.get('reason') or ''}"
    elif state == st.DRAINED:
        d = n.get("drain") or {}
        text = "drained (timed out with requests in flight)" if d.get("timed_out") else "drained: safe to stop"
    else:
        text = ""
    return "; ".join(t for t in (text, note) if t), False


def fleet_rows(plane: ControlPlane, now: float | None = None) -> list[dict[str, Any]]:
    """One dict per node for the Fleet table: ``cells`` (display text by column), ``classes``
    (CSS class by column: ``bad``/``warn``/``cold``), ``title`` (tooltips), ``actions``
    (which of drain/undrain/warm the state allows) and the raw state/progress."""
    now = now or time.time()
    assert plane.policy is not None
    nodes = plane.nodes_view()
    redis_ok = plane.store.ping()
    policy = plane.policy
    stale_after = policy.health.missing_reports * policy.control.report_interval_s
    rows = []
    for n in nodes:
        report = n.get("report")
        age = n.get("report_age_s")
        fresh = age is not None and age <= stale_after
        engine = (report or {}).get("engine") or {}
        down = n["state"] == st.EJECTED or not fresh or engine.get("healthy") is False
        rates = plane.history.rates(n["id"], now=now, over_s=RATE_WINDOW_S)
        mem, util, gpu_title = _gpu_cells(report)
        hit = rates.get("prefix_hit_ratio")
        hit_title = "prefix-cache hits ÷ lookups (tokens) on this engine over the last minute"
        if hit is None and engine.get("prefix_cache_queries"):
            hit = (engine.get("prefix_cache_hits") or 0) / engine["prefix_cache_queries"]
            hit_title = "no lookups in the last minute: since the engine started"
        if down:  # an unreachable engine's last figures would hide that it is down
            hit, engine = None, {}
            why = (((report or {}).get("engine") or {}).get("error")
                   or ("ejected" if n["state"] == st.EJECTED else "no fresh agent report"))
            hit_title = f"no figure: {why}"
        progress, busy = _progress(plane, n, now)
        err = rates.get("error_rate")
        running, waiting = engine.get("running"), engine.get("waiting")
        cls = {
            "state": f"state-{n['state']}",
            "report_age": ("warn" if not redis_ok else
                           "bad" if age is None and n.get("has_agent") or (age is not None and age > stale_after) else ""),
            "errors": "bad" if err and err >= 0.05 else ("warn" if err and err > 0 else ""),
            "kv_cache": "warn" if (engine.get("kv_cache_usage") or 0) >= 0.9 else "",
            "queue": "warn" if (waiting or 0) > 0 else "",
        }
        rows.append({
            "id": n["id"], "pool": n["pool"], "url": n["url"], "state": n["state"], "reason": n.get("reason") or "",
            "progress": progress, "busy": busy, "hit_ratio": hit,
            "warmup_status": (n.get("warmup") or {}).get("status"),
            "warmup_finished_at": ((n.get("warmup") or {}).get("result") or {}).get("finished_at"),
            "cells": {
                "state": n["state"],
                "weight": f"{_weight(n.get('target_weight'))} / "
                          f"{'down' if not n.get('weight') else _weight(n.get('weight'))}",
                "gpu_mem": mem, "gpu_util": util,
                "queue": f"{_num(running)} / {_num(waiting)}",
                "kv_cache": _pct(engine.get("kv_cache_usage")),
                "prefix_hit": _pct(hit, 1),
                "req_s": _num(rates.get("req_s"), 1),
                "errors": _pct(err, 1),
                "report_age": ("unknown (Redis down)" if not redis_ok else _ago(age) if age is not None
                               else ("none yet" if not n.get("has_agent") else "missing")),
                "progress": progress,
            },
            "classes": cls,
            "title": {"gpu_mem": gpu_title, "gpu_util": gpu_title, "prefix_hit": hit_title,
                      "state": f"since {_when(n.get('since'))}: {n.get('reason') or ''}",
                      "report_age": "age of the node agent's last report"},
            "actions": {
                "drain": st.DRAINING in st.TRANSITIONS.get(n["state"], ()),
                "undrain": st.WARMING in st.TRANSITIONS.get(n["state"], ()) and n["state"] in (st.DRAINING, st.DRAINED),
                "warm": (n.get("warmup") or {}).get("status") != "running",
            },
        })
    # a node far colder than the rest of its pool is what an average would hide
    by_pool: dict[str, list[float]] = {}
    for r in rows:
        if r["hit_ratio"] is not None and r["state"] in st.SERVING:
            by_pool.setdefault(r["pool"], []).append(r["hit_ratio"])
    for r in rows:
        others = [h for h in by_pool.get(r["pool"], []) if h is not r["hit_ratio"]]
        best = max(others) if others else None
        if r["state"] in st.SERVING and best and best > 0.05 and (r["hit_ratio"] or 0) < best / 2:
            r["classes"]["prefix_hit"] = "cold"
            r["title"]["prefix_hit"] += f" — under half of the best node in pool {r['pool']} ({_pct(best, 1)})"
    return rows


# -------------------------------------------------------------- policy editor
def annotate(text: str, issues: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The policy text as numbered lines with each issue attached to the line of its field.

    Returns ``(lines, unplaced)``: ``lines`` = ``[{"no", "text", "issues": [...]}]``;
    issues whose line cannot be told (the whole document, nginx's own refusal) are in ``unplaced``."""
    lines = [{"no": i + 1, "text": t, "issues": []} for i, t in enumerate(text.splitlines() or [""])]
    unplaced = []
    for issue, no in zip(issues, lines_of(text, [i.get("path") or "" for i in issues])):
        if no is not None and 1 <= no <= len(lines):
            issue = {**issue, "line": no}
            lines[no - 1]["issues"].append(issue)
        else:
            unplaced.append(issue)
    return lines, unplaced


def diff_lines(old: str, new: str, old_name: str, new_name: str) -> list[dict[str, str]]:
    """A unified diff (difflib) as ``[{"kind": "add"|"del"|"hunk"|"file"|"ctx", "text"}]``."""
    out = []
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), old_name, new_name, lineterm="", n=3):
        if line.startswith(("+++", "---")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append({"kind": kind, "text": line})
    return out


# ------------------------------------------------------------------ the page
class _TrafficCache:
    """The request-log figures of the Pools/Cache pages and the Fleet page's pool line.

    A :class:`~kvgate.control.traffic.TrafficTracker` reads the gateway's request log
    incrementally: the first refresh reads the last 15 minutes, later ones only what was
    logged since (a Fleet page polls every 2 s). The figures are reused for TRAFFIC_CACHE_S;
    the cache's entry count (a SCAN of Redis) only for the Cache page, for CACHE_STATS_S."""

    CACHE_STATS_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = 0.0
        self._key: Any = None
        self._value: Any = None
        self._clients: dict[str, redis.Redis] = {}
        self._tracker: Any = None
        self._tracker_url: str | None = None
        self._stats: tuple[float, Any, Any] = (0.0, None, None)

    def reset(self) -> None:
        """Refresh on the next call (after an action that changes the figures)."""
        self._key = None
        self._stats = (0.0, None, None)

    def redis_for(self, url: str) -> redis.Redis:
        client = self._clients.get(url)
        if client is None:
            client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
            self._clients[url] = client
        return client

    def get(self, plane: ControlPlane, cache_stats: bool = False) -> dict[str, Any]:
        """``{"pools": {name: figures} | None, "cache": {...} | None, "error": str | None}``
        (``cache`` only with ``cache_stats``). Never raises for Redis: ``error`` says it."""
        from .traffic import TrafficTracker
        from .traffic import cache_stats as read_cache_stats

        policy = plane.policy
        assert policy is not None
        weights = plane.serving_weights()
        key = (id(policy), tuple(sorted(weights.items())))
        with self._lock:
            if not (self._key == key and time.monotonic() - self._at < TRAFFIC_CACHE_S):
                r = self.redis_for(policy.redis.url)
                if self._tracker is None or self._tracker_url != policy.redis.url:
                    self._tracker = TrafficTracker(window_s=TRAFFIC_WINDOW_S)  # its first update backfills
                    self._tracker_url = policy.redis.url
                value: dict[str, Any] = {"pools": None, "cache": None, "error": None}
                try:
                    self._tracker.update(r, policy, weights)
                    value["pools"] = {p["pool"]: p for p in self._tracker.view(policy)}
                except redis.RedisError as exc:
                    value["error"] = f"the gateway's Redis ({policy.redis.url}) cannot be read: {exc}"
                except Exception as exc:  # a page must degrade with a message, never fail on the figures
                    log.exception("reading the request log failed")
                    value["error"] = f"the request log could not be analysed: {type(exc).__name__}: {exc}"
                self._key, self._at, self._value = key, time.monotonic(), value
            value = dict(self._value)
            if cache_stats and not value["error"]:
                at, version, stats = self._stats
                ns = plane.namespace_in_force
                if version != ns or time.monotonic() - at >= self.CACHE_STATS_S:
                    try:
                        stats = read_cache_stats(self.redis_for(policy.redis.url), ns)
                        self._stats = (time.monotonic(), ns, stats)
                    except redis.RedisError as exc:
                        value["error"] = f"the gateway's Redis ({policy.redis.url}) cannot be read: {exc}"
                        stats = None
                value["cache"] = stats
            return value


def _wants_json() -> bool:
    if g.get("admin_via") == "bearer" or request.path.endswith(".json"):
        return True
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return best == "application/json" and request.accept_mimetypes[best] > request.accept_mimetypes["text/html"]


def _json_error(status: int, message: str, type_: str, code: str, **extra: Any) -> Response:
    resp = jsonify({"error": {"message": message, "type": type_, "code": code, **extra}})
    resp.status_code = status
    return resp


def actor() -> str:
    """Who acts, as events and node reasons say it."""
    return "admin page" if g.get("admin_via") == "session" else "admin page (token)"


def _safe_next(target: str | None) -> str:
    """Only a path of this page (no other host): sign-in must not become an open redirect."""
    if target:
        parts = urlsplit(target)
        if (not parts.scheme and not parts.netloc and parts.path.startswith("/admin") and "\\" not in target
                and not any(ord(c) < 32 or ord(c) == 127 for c in target)):
            return target
    return url_for("admin.fleet")


def init_admin(app: Flask, plane: ControlPlane, token: str) -> None:
    """Mount the admin page on ``app`` (the control plane's Flask app)."""
    # The session key is derived from the admin token: sessions survive a control-plane restart
    # and end when the token is replaced.
    app.secret_key = hmac.new(token.encode(), b"kvgate admin session key", hashlib.sha256).hexdigest()
    app.config.update(
        SESSION_COOKIE_NAME="kvgate_admin",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        PERMANENT_SESSION_LIFETIME=dt.timedelta(hours=SESSION_HOURS),
        SESSION_REFRESH_EACH_REQUEST=False,  # the cookie expires 12 h after sign-in, however busy the page
        WTF_CSRF_CHECK_DEFAULT=False,   # checked in the blueprint: a Bearer request needs none
        WTF_CSRF_TIME_LIMIT=None,       # valid as long as the session (an open page may sit for hours)
    )
    csrf = CSRFProtect(app)
    mark = hmac.new(token.encode(), b"kvgate admin signed in", hashlib.sha256).hexdigest()[:32]
    traffic = _TrafficCache()
    bp = Blueprint("admin", __name__, url_prefix="/admin", template_folder="templates",
                   static_folder="static", static_url_path="/static")

    def bearer() -> str | None:
        """The token of an ``Authorization: Bearer`` header (other schemes, e.g. a proxy's Basic
        auth, are not ours: the session decides then)."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return given.strip() if scheme.lower() == "bearer" else None

    def signed_in() -> bool:
        """A session cookie of this token, younger than SESSION_HOURS, not signed out."""
        if not hmac.compare_digest(str(session.get("admin", "")), mark):
            return False
        try:
            if time.time() - float(session.get("iat", 0)) > SESSION_HOURS * 3600:
                return False
        except (TypeError, ValueError):
            return False
        sid = str(session.get("sid", ""))
        try:
            return bool(sid) and not plane.store.session_revoked(sid)
        except StoreError:
            return True  # Redis down: the page stays usable (it says Redis is down); see docs/admin.md

    @bp.before_request
    def _auth():
        g.admin_via = None
        if plane.policy is not None:
            app.config["SESSION_COOKIE_SECURE"] = plane.policy.control.admin_cookie_secure
        if request.endpoint in ("admin.login", "admin.static"):
            return None
        given = bearer()
        if given is not None:
            if hmac.compare_digest(given.encode(), token.encode()):
                g.admin_via = "bearer"
                return None
            return _json_error(401, "wrong admin token in the Authorization header (`kvgate token` prints it)",
                               "authentication_error", "invalid_token")
        if signed_in():
            g.admin_via = "session"
            if request.method not in ("GET", "HEAD", "OPTIONS"):
                csrf.protect()  # raises CSRFError → 400, before the view runs: nothing changes
            return None
        if _wants_json():  # the page's script (fetch) and other JSON clients: 401, never a redirect
            return _json_error(401, "not signed in (or the session ended): sign in again", "authentication_error",
                               "not_signed_in", login=url_for("admin.login"))
        nxt = request.full_path.rstrip("?") if request.method == "GET" else None
        return redirect(url_for("admin.login", next=nxt), 303)

    @app.after_request
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

    @app.errorhandler(CSRFError)
    def _csrf_error(exc: CSRFError):
        message = (f"{exc.description} Nothing was changed. The page may be out of date, or the request did not "
                   "come from this page: reload it and try again.")
        if request.path.endswith(".json") or _wants_json():
            return _json_error(400, message, "invalid_request_error", "csrf_failed")
        return render_template("admin/error.html", title="Bad request", message=message), 400

    @bp.app_context_processor
    def _context():
        if not request.path.startswith("/admin"):
            return {}
        ref = urlsplit(request.referrer or "")
        back = ref.path + (f"?{ref.query}" if ref.query else "") if ref.netloc == request.host else None
        return {"plane": plane, "policy_version": plane.policy_version or {}, "fmt_when": _when, "fmt_pct": _pct,
                "cancel_url": _safe_next(back),
                "fmt_ago": _ago, "gateway_ok": plane.gateway_ok, "now": time.time()}

    def done(message: str, status: int = 200, category: str = "ok", json_extra: dict[str, Any] | None = None,
             back: str | None = None):
        """An action's outcome: JSON for scripts and the page's JS, else a flash and a redirect (303)."""
        if _wants_json():
            if category == "error":
                code = {404: "not_found", 409: "conflict", 422: "invalid_policy", 503: "redis_unavailable"}
                return _json_error(status, message, "invalid_request_error" if status < 500 else "server_error",
                                   code.get(status, "failed"))
            return jsonify({"ok": True, "message": message, "at": time.time(), **(json_extra or {})}), status
        flash(message, category)
        return redirect(back or url_for("admin.fleet"), 303)

    # --------------------------------------------------------------- sign-in
    @bp.route("/login", methods=["GET", "POST"])
    def login():
        nxt = _safe_next(request.values.get("next"))
        if request.method == "GET":
            if signed_in():
                return redirect(nxt, 303)
            return render_template("admin/login.html", next=nxt, error=None)
        csrf.protect()
        given = request.form.get("token", "").strip()
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            log.warning("admin sign-in refused from %s", request.remote_addr)
            return render_template("admin/login.html", next=nxt,
                                   error="That is not the admin token. `kvgate token` prints it."), 401
        session.clear()  # a fresh session (and CSRF token) on sign-in
        session["admin"] = mark
        session["sid"] = secrets.token_urlsafe(16)
        session["iat"] = time.time()
        session.permanent = True
        return redirect(nxt, 303)

    @bp.post("/logout")
    def logout():
        sid = str(session.get("sid", ""))
        if sid:
            try:  # a copy of the cookie stops working too (until Redis forgets it, when it would expire)
                plane.store.revoke_session(sid, int(SESSION_HOURS * 3600 - (time.time() - float(session.get("iat", 0)))))
            except (StoreError, TypeError, ValueError) as exc:
                log.warning("sign-out not recorded: %s", exc)
        session.clear()
        flash("Signed out.", "ok")
        return redirect(url_for("admin.login"), 303)

    # ----------------------------------------------------------------- fleet
    def pool_lines() -> list[dict[str, Any]]:
        t = traffic.get(plane)
        out = []
        for p in plane.pools_view():
            tv = (t.get("pools") or {}).get(p["name"]) or {}
            with plane.lock:
                serving = [i for i in p["nodes"] if (plane.nodes.get(i) or {}).get("state") in st.SERVING]
            requests_n = tv.get("requests") or 0
            out.append({**p, "affinity_ratio": tv.get("affinity_ratio"), "routed": tv.get("routed"),
                        "requests": tv.get("requests"), "cache_ratio": tv.get("cache_ratio") or {},
                        "failovers_window": tv.get("failovers"), "serving": len(serving),
                        "error_ratio": (tv.get("errors") or 0) / requests_n if requests_n else None,
                        "unjudged": max(0, requests_n - (tv.get("routed") or 0)
                                        - ((tv.get("cache") or {}).get("HIT") or 0))})
        return out

    @bp.get("/")
    def fleet():
        return render_template("admin/fleet.html", rows=fleet_rows(plane), pools=pool_lines(), actions=ACTIONS,
                               traffic_error=traffic.get(plane).get("error"), page="fleet")

    @bp.get("/fleet.json")
    def fleet_json():
        pools = [{"name": p["name"], "balancer_in_force": p["balancer_in_force"], "degraded": p["degraded"],
                  "affinity": _pct(p["affinity_ratio"], 1), "hit": _pct((p["cache_ratio"] or {}).get("HIT"), 1),
                  "errors": _pct(p["error_ratio"], 1), "serving": p["serving"], "nodes": len(p["nodes"])}
                 for p in pool_lines()]
        return jsonify({"rows": fleet_rows(plane), "pools": pools, "at": time.time(),
                        "gateway_ok": plane.gateway_ok,
                        "policy_version": (plane.policy_version or {}).get("version")})

    @bp.get("/history.json")
    def history_json():
        assert plane.policy is not None
        now = time.time()
        return jsonify({"window_s": plane.history.window_s, "now": now,
                        "nodes": {n.id: plane.history.series(n.id, now=now) for n in plane.policy.nodes()}})

    @bp.route("/nodes/<node_id>/<action>", methods=["GET", "POST"])
    def node_action(node_id: str, action: str):
        spec = ACTIONS.get(action)
        if spec is None:
            return render_template("admin/error.html", title="Not found",
                                   message=f"no action {action!r} (drain, undrain or warm)"), 404
        if request.method == "GET":
            try:
                with plane.lock:
                    view = plane.node_view(node_id)
            except NotFound as exc:
                return render_template("admin/error.html", title="Not found", message=str(exc.args[0])), 404
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
        except NotFound as exc:
            return done(str(exc.args[0]), 404, "error")
        except (InvalidTransition, Conflict) as exc:
            text = str(exc)
            cli_hint = "force it (kvgate drain --force, or force=true in the API) to do it anyway"
            if isinstance(exc, Conflict) and cli_hint in text and not _wants_json():
                text = text.replace(cli_hint, "tick 'Drain even if it is the last serving node' "
                                    "on the confirmation to do it anyway")
            return done(text, 409, "error")
        except ApplyError as exc:
            return done(f"the gateway config was not applied; the running one keeps serving: {exc}", 500, "error")
        except StoreError as exc:
            return done(str(exc), 503, "error")
        return done(message, 202, json_extra={"node": view, "target": spec["target"]})

    # ----------------------------------------------------------------- pools
    @bp.get("/pools")
    def pools():
        t = traffic.get(plane)
        return render_template("admin/pools.html", pools=pool_lines(), traffic=t.get("pools") or {},
                               traffic_error=t.get("error"), window_s=TRAFFIC_WINDOW_S, page="pools")

    # ----------------------------------------------------------------- cache
    @bp.get("/cache")
    def cache():
        t = traffic.get(plane, cache_stats=True)
        assert plane.policy is not None
        return render_template("admin/cache.html", traffic=t.get("pools") or {}, stats=t.get("cache"),
                               traffic_error=t.get("error"), cache_cfg=plane.policy.cache,
                               namespace=plane.namespace_in_force,
                               pool_names=[p.name for p in plane.policy.pools], window_s=TRAFFIC_WINDOW_S,
                               page="cache")

    @bp.route("/cache/invalidate", methods=["GET", "POST"])
    def cache_invalidate():
        assert plane.policy is not None
        if request.method == "GET":
            v = plane.namespace_in_force
            return render_template("admin/confirm.html", action="invalidate", spec={"label": "Invalidate the cache"},
                                   node=None, post_url=url_for("admin.cache_invalidate"), page="cache",
                                   message=f"Invalidate the whole response cache? The namespace version goes from "
                                           f"{v} to {v + 1} (a new policy version): every cached answer is "
                                           "recomputed on its next request. Old entries expire by their TTL.")
        who = actor()
        back = url_for("admin.cache")
        try:
            out = plane.invalidate_cache(who)
        except PolicyError as exc:
            return done("; ".join(str(i) for i in exc.issues), 422, "error", back=back)
        except ApplyError as exc:
            return done(f"not applied; the running config keeps serving: {exc}", 500, "error", back=back)
        except (StoreError, ValueError) as exc:
            return done(str(exc), 503, "error", back=back)
        traffic.reset()
        return done(f"Response cache invalidated: namespace version {out['old']} → {out['new']} "
                    f"(policy version {out['version']}).", 200, json_extra=out, back=back)

    # ---------------------------------------------------------------- policy
    def policy_page(text: str | None = None, status: int = 200, **ctx: Any):
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
    def policy():
        return policy_page()

    @bp.post("/policy/check")
    def policy_check():
        text, refused = form_text()
        if refused:
            return refused
        result = check(text)
        running_v = (plane.policy_version or {}).get("version")
        base = request.form.get("base_version", type=int)
        if base is not None and running_v is not None and base != running_v:
            result["stale"] = (f"The running policy changed to version {running_v} since you loaded version {base}: "
                               "the diff below is against the running one.")
        if _wants_json():
            return jsonify({k: result[k] for k in ("issues", "valid", "changed", "diff")}), 200 if result["valid"] else 422
        return policy_page(text, 200 if result["valid"] else 422, result=result,
                           base_version=running_v if result.get("stale") else base)

    @bp.post("/policy/apply")
    def policy_apply():
        text, refused = form_text()
        if refused:
            return refused
        # the base check and the apply in one critical section: two operators applying edits of
        # the same version must not overwrite each other unseen (plane.lock is re-entrant)
        with plane.lock:
            return _apply_locked(text, request.form.get("base_version", type=int), actor())

    def _apply_locked(text: str, base: int | None, who: str):
        running = plane.policy_version or {}
        if base is not None and running.get("version") is not None and base != running.get("version"):
            result = check(text)
            result["stale"] = (f"The running policy changed to version {running.get('version')} since you loaded "
                               f"version {base}: review the diff against it, then apply again.")
            if _wants_json():
                return _json_error(409, result["stale"], "conflict_error", "stale_base_version")
            return policy_page(text, 409, result=result, base_version=running.get("version"))
        try:
            out = plane.apply_policy(text, who)
        except PolicyError as exc:
            if _wants_json():
                return _json_error(422, "invalid policy", "invalid_request_error", "invalid_policy",
                                   issues=[{"path": i.path, "reason": i.reason} for i in exc.issues])
            return policy_page(text, 422, result=check(text), base_version=base)
        except NodeHasWork as exc:  # the page has no force: drain first (the API and CLI can force)
            if _wants_json():
                return _json_error(409, str(exc), "conflict_error", "node_has_work", nodes=exc.nodes)
            result = check(text)
            result["apply_error"] = f"{str(exc)[:1].upper()}{str(exc)[1:]}."  # says the running one serves
            return policy_page(text, 409, result=result, base_version=base)
        except ApplyError as exc:
            if _wants_json():
                return _json_error(500, f"not applied; the running config keeps serving: {exc}", "server_error",
                                   "apply_failed")
            result = check(text)
            result["apply_error"] = f"Not applied; the running config keeps serving. {exc}"
            return policy_page(text, 500, result=result, base_version=base)
        except StoreError as exc:
            return done(str(exc), 503, "error", back=url_for("admin.policy"))
        msg = (f"Policy version {out['version']} applied (gateway {out['result']})." if out["changed"]
               else "The policy is the same as the running one: nothing to apply.")
        traffic.reset()
        return done(msg, 200, json_extra=out, back=url_for("admin.policy"))

    @bp.get("/policy/versions/<int:version>")
    def policy_version(version: int):
        try:
            v = next((v for v in plane.store.versions() if v["version"] == version), None)
        except StoreError as exc:
            return render_template("admin/error.html", title="Redis unavailable", message=str(exc)), 503
        if v is None:
            return render_template("admin/error.html", title="Not found",
                                   message=f"no stored policy version {version}"), 404
        running = plane.policy_version or {}
        diff = diff_lines(running.get("yaml", ""), v["yaml"], f"running (version {running.get('version')})",
                          f"version {version}")
        return render_template("admin/policy_version.html", v=v, diff=diff, running=running, page="policy")

    @bp.route("/policy/versions/<int:version>/rollback", methods=["GET", "POST"])
    def policy_rollback(version: int):
        if request.method == "GET":
            return render_template("admin/confirm.html", action="rollback",
                                   spec={"label": f"Roll back to version {version}"}, node=None, page="policy",
                                   post_url=url_for("admin.policy_rollback", version=version),
                                   message=f"Apply policy version {version} again (as a new version)?")
        back = url_for("admin.policy")
        try:
            out = plane.rollback(version, by=actor())
        except NotFound as exc:
            return done(str(exc.args[0]), 404, "error", back=back)
        except PolicyError as exc:
            return done("; ".join(str(i) for i in exc.issues), 422, "error", back=back)
        except NodeHasWork as exc:
            return done(str(exc), 409, "error", back=back)
        except ApplyError as exc:
            return done(f"not applied; the running config keeps serving: {exc}", 500, "error", back=back)
        except StoreError as exc:
            return done(str(exc), 503, "error", back=back)
        return done(f"Rolled back to version {version}: now version {out['version']} (gateway {out['result']}).",
                    200, json_extra=out, back=back)

    # ---------------------------------------------------------------- events
    @bp.get("/events")
    def events():
        assert plane.policy is not None
        node = request.args.get("node") or None
        kind = request.args.get("kind") or None
        before = request.args.get("before") or None
        if before is not None and not re.fullmatch(r"\d{1,19}(-\d{1,19})?", before):
            return render_template("admin/error.html", title="Bad request",
                                   message="before must be an event id such as 1700000000000-0"), 400
        limit = 100
        error = None
        try:
            evs = plane.store.events(limit=limit + 1, node=node, kind=kind, before=before)
        except StoreError as exc:
            evs, error = [], str(exc)
        more = len(evs) > limit
        evs = evs[:limit]
        if _wants_json():
            return jsonify({"events": evs})
        return render_template("admin/events.html", events=evs, node=node, kind=kind, kinds=EVENT_KINDS, paged=bool(before),
                               node_ids=[n.id for n in plane.policy.nodes()], error=error, page="events",
                               older=evs[-1]["id"] if more and evs else None)

    app.register_blueprint(bp)
