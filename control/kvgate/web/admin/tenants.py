"""The admin page's Tenants page (issue 12 item 7): ``/admin/tenants``.

Per tenant of the policy: its models, cache scope, priority and limits; the current use of its
rpm, tpm and concurrency limits (read from the buckets in Redis: ``kvgate.limits``); its answers
and 429s over the last 15 minutes (the control plane's scrapes of the gateway, kept in
:class:`kvgate.web.admin.history.History`); its API keys with create and revoke. A new key's
secret is shown once, on the answer to the create form (``no-store``), and nowhere else.
"""

from __future__ import annotations

import time
from typing import Any

from flask import jsonify, render_template, request, url_for

from ... import keys as contract
from ...control.apikeys import ApiKeyError, ApiKeys, UnknownKey
from ...control.store import StoreError
from ...fleet.events import EventKind
from ..auth import actor, require_admin
from ..errors import wants_json
from ..state import services
from .views import bp, done, failed

WINDOW_MS = 60_000


def bucket_use(r: Any, key: str, cap: int, now_ms: float) -> float:
    """What a token bucket (``kvgate.limits``) has used now: ``cap`` − its tokens refilled to
    ``now_ms`` (an absent bucket is full: 0 used)."""
    t, ts = r.hmget(key, "t", "ts")
    if t is None or ts is None:
        return 0.0
    left = min(cap, float(t) + max(0.0, now_ms - float(ts)) * cap / WINDOW_MS)
    return max(0.0, cap - left)


def tenant_rows() -> tuple[list[dict[str, Any]], str | None]:
    """One row per tenant of the policy; ``error`` when Redis could not be read."""
    plane = services()
    policy = plane.policy
    if policy is None:
        return [], None
    totals = plane.history.tenant_totals() if hasattr(plane.history, "tenant_totals") else {}
    error = None
    keys_by_tenant: dict[str, list[Any]] = {}
    use: dict[str, dict[str, float]] = {}
    try:
        for k in ApiKeys(plane.store).list():
            keys_by_tenant.setdefault(k.tenant, []).append(k)
        r = plane.store.r
        now_ms = time.time() * 1000
        for t in policy.tenants:
            lim, u = t.limits, {}
            if lim.rpm:
                u["rpm"] = bucket_use(r, f"{contract.RATELIMIT_PREFIX}{t.id}:rpm", lim.rpm, now_ms)
            if lim.tpm:
                u["tpm"] = bucket_use(r, f"{contract.RATELIMIT_PREFIX}{t.id}:tpm", lim.tpm, now_ms)
            if lim.concurrency:
                u["concurrency"] = float(r.zcount(f"{contract.RATELIMIT_PREFIX}{t.id}:concurrency", now_ms, "+inf"))
            use[t.id] = u
    except (StoreError, OSError, ValueError) as exc:
        error = f"Redis could not be read: {exc}"
    except Exception as exc:  # redis-py's own errors (a ConnectionError is not an OSError)
        error = f"Redis could not be read: {type(exc).__name__}: {exc}"
    rows = []
    for t in policy.tenants:
        lim = t.limits
        limits = [(name, value) for name, value in (("rpm", lim.rpm), ("tpm", lim.tpm),
                                                    ("concurrency", lim.concurrency),
                                                    ("session_rpm", lim.session_rpm),
                                                    ("key rpm", lim.per_key.rpm if lim.per_key else None),
                                                    ("key tpm", lim.per_key.tpm if lim.per_key else None))
                  if value is not None]
        tt = totals.get(t.id, {})
        rows.append({"id": t.id, "name": t.name or t.id, "models": t.models, "cache": t.cache_scope,
                     "priority": t.priority, "limits": limits, "use": use.get(t.id, {}),
                     "requests_15m": tt.get("requests", 0), "ratelimited_15m": tt.get("ratelimited", 0),
                     "keys": [k.to_json() for k in keys_by_tenant.get(t.id, [])]})
    return rows, error


@bp.get("/tenants")
@require_admin
def tenants():
    plane = services()
    rows, error = tenant_rows()
    if wants_json():
        return jsonify({"auth": plane.policy.gateway.auth if plane.policy else "off", "tenants": rows,
                        "error": error})
    return render_template("admin/tenants.html", rows=rows, error=error, page="tenants",
                           auth=plane.policy.gateway.auth if plane.policy else "off")


@bp.post("/tenants/<tenant>/keys")
@require_admin
def create_key(tenant: str):
    plane = services()
    back = url_for("admin.tenants")
    name = (request.form.get("name") or (request.get_json(silent=True) or {}).get("name") or "").strip()
    try:
        rec, secret = ApiKeys(plane.store).create(tenant, name, tenants=[t.id for t in plane.policy.tenants]
                                                  if plane.policy else [])
    except (ApiKeyError, StoreError) as exc:
        return failed(exc, back=back)
    plane.event(EventKind.APIKEY_CREATED, f"API key {rec.id} created for tenant {rec.tenant} by {actor()}"
                + (f" ({name})" if name else ""), key=rec.id, tenant=rec.tenant)
    if wants_json():
        resp = jsonify({"key": rec.to_json(), "secret": secret})
        resp.status_code = 201
        return resp
    return render_template("admin/key_created.html", key=rec, secret=secret, page="tenants"), 201


@bp.route("/keys/<key_id>/revoke", methods=["GET", "POST"])
@require_admin
def revoke_key(key_id: str):
    plane = services()
    back = url_for("admin.tenants")
    if request.method == "GET":
        return render_template("admin/confirm.html", action="revoke", spec={"label": "Revoke the key"}, node=None,
                               post_url=url_for("admin.revoke_key", key_id=key_id), page="tenants",
                               message=f"Revoke API key {key_id}? Gateways refuse it within "
                                       f"{plane.policy.gateway.auth_cache_ttl_s:g} s; it cannot be restored.")
    try:
        rec = ApiKeys(plane.store).revoke(key_id)
    except (UnknownKey, StoreError) as exc:
        return failed(exc, back=back)
    plane.event(EventKind.APIKEY_REVOKED, f"API key {rec.id} of tenant {rec.tenant} revoked by {actor()}",
                key=rec.id, tenant=rec.tenant)
    return done(f"API key {rec.id} of tenant {rec.tenant} revoked: gateways refuse it within "
                f"{plane.policy.gateway.auth_cache_ttl_s:g} s.", json_extra={"key": rec.to_json()}, back=back)
