"""The control plane's HTTP API: blueprint ``api`` (``/api/v1``) and ``root`` (``/``, ``/healthz``, ``/metrics``).

Everything under ``/api/v1`` answers JSON; errors use OpenAI's shape
``{"error": {"message", "type", "code"}}`` (plus ``issues: [{"path", "reason"}]`` for a
bad policy), from the one table in :mod:`kvgate.web.errors`. Every mutation needs
``Authorization: Bearer <admin token>``; reads too unless the policy sets
``control.public_reads`` (:func:`kvgate.web.auth.require_token`). ``GET /healthz`` is always
public. The views only translate HTTP to calls of the services (the control plane).

=======  =====================================  ==================================================
method   path                                   what
=======  =====================================  ==================================================
GET      /admin/                                the admin web page (sign in with the token; see
                                               kvgate.web.admin.views)
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
                                               ``?force=true``); header ``X-Kvgate-Policy-Dir``: the
                                               absolute folder of the file applied, where relative
                                               ``static_answers`` are read (default: the running
                                               policy's)
GET      /api/v1/policy/versions                applied versions, newest first
POST     /api/v1/policy/versions/<n>/rollback   apply version n again (``?force=true`` as for PUT)
GET      /api/v1/events                         newest first; ``?node=&kind=&limit=&before=``
GET      /api/v1/gateways                       every gateway member: version, in sync, last seen, lost
                                               (docs/scale-out.md)
GET      /api/v1/gateways/<id>/config           what member <id> must run: policy version and text,
                                               runtime, ``tag``; ``?known=<tag>&wait=<s>``: long poll
                                               until the tag changes (at most ``control.gateway_sync_s``)
POST     /api/v1/gateways/<id>/status           a ``kvgate gateway`` supervisor's status (version,
                                               runtime digest, nginx pid/health, in-flight per node)
GET      /api/v1/tenants                        the policy's tenants, ``gateway.auth``, key counts
GET      /api/v1/keys                           API keys (records, never secrets); ``?tenant=``
POST     /api/v1/keys                           ``{"tenant", "name"}`` → 201 ``{"key", "secret"}``: the
                                               secret is in this answer only
POST     /api/v1/keys/<id>/revoke               revoked within ``gateway.auth_cache_ttl_s``
GET      /api/v1/costs                          the cost report (kvgate.costs.report); ``?by=tenant|model|pool|
                                               day|hour&since=24h``; 400 for another ``by`` or ``since``
GET      /api/v1/batches                        every tenant's batches, newest first (OpenAI objects +
                                               ``tenant``, ``progress``); ``?tenant=&status=&limit=``
GET      /api/v1/batches/<id>                   one batch, any tenant's (404 unknown)
POST     /api/v1/batches/<id>/cancel            → cancelling (in-flight lines finish); 409 once finished
=======  =====================================  ==================================================
"""

from __future__ import annotations

import re

from flask import Blueprint, Response, jsonify, redirect, request

from ..control.report import check_report
from ..fleet.events import EventKind
from .auth import bearer, is_token, require_token
from .errors import json_error
from .state import services

MAX_POLICY_BYTES = 1024 * 1024

bp = Blueprint("api", __name__, url_prefix="/api/v1")
bp.before_request(require_token)

root = Blueprint("root", __name__)


def _policy_dir() -> str | None:
    """``X-Kvgate-Policy-Dir``: the folder of the policy file applied (``kvgate apply FILE`` sends
    FILE's), where its relative ``static_answers`` are read; None: the running policy's folder.

    Raises:
        ValueError: not an absolute path (→ 400).
    """
    import os

    d = request.headers.get("X-Kvgate-Policy-Dir")
    if d is None or d == "":
        return None
    if not os.path.isabs(d):
        raise ValueError(f"X-Kvgate-Policy-Dir must be an absolute folder, not {d[:200]!r}")
    return os.path.normpath(d)


def _policy_text() -> str:
    """The policy YAML from the body: raw YAML/text, or JSON ``{"yaml": "..."}``.

    Raises:
        ValueError: larger than MAX_POLICY_BYTES, or JSON of another shape (→ 400).
    """
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


# ------------------------------------------------------------------ root
@root.get("/")
def index():
    return redirect("/admin/", 302)


@root.get("/favicon.ico")
def favicon():
    return Response(status=204)


@root.get("/healthz")
def healthz():
    plane = services()
    return jsonify({"status": "ok", "policy_version": (plane.policy_version or {}).get("version"),
                    "redis": plane.store.ping()})


@root.get("/metrics")
def metrics():
    refused = require_token()
    if refused is not None:
        return refused
    return Response(services().metrics.render(), mimetype="text/plain; version=0.0.4")


# ------------------------------------------------------------------ nodes
@bp.get("/nodes")
def nodes():
    return jsonify({"nodes": services().nodes_view()})


@bp.get("/nodes/<node_id>")
def node(node_id: str):
    return jsonify(services().node_view(node_id))


@bp.post("/nodes/<node_id>/report")
def report(node_id: str):
    return jsonify(services().report(node_id, check_report(request.get_json(silent=True))))


@bp.post("/nodes/<node_id>/drain")
def drain(node_id: str):
    return jsonify(services().drain(node_id, reason="API", force=_force())), 202


@bp.post("/nodes/<node_id>/undrain")
def undrain(node_id: str):
    return jsonify(services().undrain(node_id, reason="API")), 202


@bp.post("/nodes/<node_id>/warm")
def warm(node_id: str):
    return jsonify(services().warm(node_id, reason="API")), 202


@bp.get("/pools")
def pools():
    return jsonify({"pools": services().pools_view()})


# ----------------------------------------------------------------- policy
@bp.get("/policy")
def policy_get():
    v = services().policy_version or {}
    return jsonify({"version": v.get("version"), "yaml": v.get("yaml"), "source": v.get("source"),
                    "applied_at": v.get("applied_at"), "digest": v.get("digest"),
                    "files_base": services().files_base})


@bp.post("/policy/validate")
def policy_validate():
    from ..control.plane import ApplyError

    try:
        p = services().validate(_policy_text(), _policy_dir())
    except ApplyError as exc:  # nothing was being applied: the policy is invalid (422), not a server fault
        reason = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
        return json_error(422, f"invalid policy: {reason}", "invalid_request_error", "invalid_policy",
                          issues=[{"path": "", "reason": reason}])
    return jsonify({"valid": True, "pools": len(p.pools), "nodes": len(p.nodes())})


@bp.put("/policy")
def policy_apply():
    source = request.headers.get("X-Kvgate-Source", "API")[:100]
    return jsonify(services().apply_policy(_policy_text(), source, force=_force(), files_base=_policy_dir()))


@bp.get("/policy/versions")
def versions():
    return jsonify({"versions": [dict(ver) for ver in services().store.versions()]})


@bp.post("/policy/versions/<int:version>/rollback")
def rollback(version: int):
    return jsonify(services().rollback(version, by="API", force=_force()))


# ------------------------------------------------------------------ cache
@bp.post("/cache/invalidate")
def cache_invalidate():
    """Retire every cached response: a new policy version with ``cache.namespace_version`` one
    above the version in force, pushed to the gateway (no reload). ``{"old", "new", "version",
    "result"}``; 503 ``redis_unavailable`` when the store cannot record it."""
    source = request.headers.get("X-Kvgate-Source", "API")[:100]
    return jsonify(services().invalidate_cache(source))


@bp.post("/cache/knowledge")
def cache_bump_knowledge():
    """Retire a pool's semantic cache: ``{"pool": name}`` → its knowledge_version + 1, pushed to the
    gateway as runtime (no reload, no new policy version). ``{"pool", "old", "new", "result"}``; 400
    ``invalid_request`` for an unknown pool or one without the semantic cache or static answers."""
    from ..control.semcache import CacheOpError

    body = request.get_json(silent=True) or {}
    source = request.headers.get("X-Kvgate-Source", "API")[:100]
    try:
        return jsonify(services().bump_knowledge(str(body.get("pool") or ""), source))
    except CacheOpError as exc:
        return json_error(400, str(exc), "invalid_request_error", "invalid_request", param=exc.param)


@bp.post("/cache/invalidate-tag")
def cache_invalidate_tag():
    """Remove the cache entries tagged ``{"tag": T}`` (X-Kvgate-Cache-Tags): the exact entries and
    the semantic service's. ``{"tag", "removed_exact", "removed_semantic", "semantic_error"}``."""
    from ..control.semcache import CacheOpError

    body = request.get_json(silent=True) or {}
    source = request.headers.get("X-Kvgate-Source", "API")[:100]
    try:
        return jsonify(services().invalidate_tag(str(body.get("tag") or ""), source))
    except CacheOpError as exc:
        return json_error(400, str(exc), "invalid_request_error", "invalid_request", param=exc.param)


# ---------------------------------------------------------------- tenants
def _apikeys():
    from ..control.apikeys import ApiKeys

    return ApiKeys(services().store)


def _tenant_ids() -> list[str]:
    policy = services().policy
    return [t.id for t in policy.tenants] if policy else []


@bp.get("/tenants")
def tenants():
    """``{"auth": mode, "tenants": [{id, name, models (null = all), cache, cache_scope, keys, revoked}]}``."""
    policy = services().policy
    counts: dict[str, list[int]] = {}
    for k in _apikeys().list():
        c = counts.setdefault(k.tenant, [0, 0])
        c[1 if k.revoked else 0] += 1
    out = [{"id": t.id, "name": t.name or t.id, "models": t.models, "cache": t.cache,
            "cache_scope": t.cache_scope, "keys": counts.get(t.id, [0, 0])[0],
            "revoked": counts.get(t.id, [0, 0])[1]} for t in (policy.tenants if policy else [])]
    return jsonify({"auth": policy.gateway.auth if policy else "off", "tenants": out})


@bp.get("/keys")
def api_keys():
    tenant = request.args.get("tenant") or None
    return jsonify({"keys": [k.to_json() for k in _apikeys().list(tenant)]})


@bp.post("/keys")
def create_api_key():
    """``{"tenant": id, "name": text}`` → 201 ``{"key": record, "secret": "kvg-…"}`` (``no-store``)."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("tenant"), str):
        raise ValueError('expected JSON {"tenant": "<tenant id>", "name": "<optional label>"}')
    name = body.get("name") or ""
    if not isinstance(name, str):
        raise ValueError("name must be a string")
    rec, secret = _apikeys().create(body["tenant"], name, tenants=_tenant_ids())
    services().event(EventKind.APIKEY_CREATED, f"API key {rec.id} created for tenant {rec.tenant}"
                     + (f" ({name})" if name else ""), key=rec.id, tenant=rec.tenant)
    resp = jsonify({"key": rec.to_json(), "secret": secret})
    resp.status_code = 201
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.post("/keys/<key_id>/revoke")
def revoke_api_key(key_id: str):
    rec = _apikeys().revoke(key_id)
    services().event(EventKind.APIKEY_REVOKED, f"API key {rec.id} of tenant {rec.tenant} revoked",
                     key=rec.id, tenant=rec.tenant)
    return jsonify({"key": rec.to_json()})


# --------------------------------------------------------------- gateways
@bp.get("/gateways")
def gateways():
    plane = services()
    return jsonify({"gateways": plane.gateways.view(), "sync_s": plane.gateways.sync_s(),
                    "version": (plane.policy_version or {}).get("version")})


@bp.get("/gateways/<member_id>/config")
def gateway_config(member_id: str):
    # the admin token always (control.public_reads or not): the answer is the whole policy text,
    # and a long poll holds a server thread
    given = bearer()
    if given is None or not is_token(given):
        return json_error(401, "missing or wrong admin token: a gateway's config is for its supervisor "
                          "(`kvgate gateway --token-file`)", "authentication_error", "invalid_token")
    registry = services().gateways
    try:
        wait = float(request.args.get("wait", 0) or 0)
    except ValueError:
        raise ValueError("wait must be a number of seconds") from None
    # a long poll holds one server thread: never longer than the sync interval
    wait = max(0.0, min(wait, registry.sync_s()))
    return jsonify(registry.wait_config(member_id, request.args.get("known") or None, wait))


@bp.post("/gateways/<member_id>/status")
def gateway_status(member_id: str):
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    return jsonify(services().gateways.report(member_id, body))


# ----------------------------------------------------------------- events
@bp.get("/events")
def events():
    try:
        limit = max(1, min(1000, int(request.args.get("limit", 100))))
    except ValueError:
        raise ValueError("limit must be an integer") from None
    before = request.args.get("before") or None
    if before is not None and not re.fullmatch(r"\d{1,19}(-\d{1,19})?", before):
        # Redis would refuse it, and that must not read as "Redis unavailable" (503)
        raise ValueError(f"before must be an event id such as 1700000000000-0, got {before[:40]!r}")
    return jsonify({"events": services().store.events(limit=limit, node=request.args.get("node") or None,
                                                     kind=request.args.get("kind") or None, before=before)})


# ------------------------------------------------------------------ costs
@bp.get("/costs")
def costs():
    """The cost report of :func:`kvgate.costs.report.build_report` (``by`` default ``tenant``, ``since``
    default ``24h``); a bad ``by`` or ``since`` is 400 ``bad_request``, Redis down 503."""
    import redis

    from ..control.store import StoreError
    from ..costs.report import build_report, check_by, parse_since

    by = check_by(request.args.get("by", "tenant"))
    since_s = parse_since(request.args.get("since", "24h"))
    store = services().store
    try:
        return jsonify(build_report(store.r, by, since_s))
    except redis.RedisError as exc:
        raise StoreError(f"redis {store.url}: cost report: {exc}") from None


# ---------------------------------------------------------------- batches
@bp.get("/batches")
def batches():
    """``{"batches": [...], "counts": {status: n}}``: every tenant's batches (kvgate.batch.overview)."""
    import redis

    from ..batch.overview import list_batches, summary
    from ..control.store import StoreError

    try:
        limit = int(request.args.get("limit", 100))
    except ValueError:
        raise ValueError("limit must be an integer") from None
    store = services().store
    try:
        rows = list_batches(store.r, tenant=request.args.get("tenant") or None,
                            status=request.args.get("status") or None, limit=limit)
    except redis.RedisError as exc:
        raise StoreError(f"redis {store.url}: batches: {exc}") from None
    return jsonify({"batches": rows, "counts": summary(rows)})


def _batch_or_404(batch_id: str):
    import redis

    from ..batch.overview import find
    from ..control.store import StoreError

    store = services().store
    try:
        b = find(store.r, batch_id)
    except redis.RedisError as exc:
        raise StoreError(f"redis {store.url}: batches: {exc}") from None
    return b


@bp.get("/batches/<batch_id>")
def batch(batch_id: str):
    b = _batch_or_404(batch_id)
    if b is None:
        return json_error(404, f"No batch with id {batch_id!r}", "invalid_request_error", "batch_not_found")
    return jsonify(b)


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    """The operator's cancel of any tenant's batch (the tenant's own: ``POST /v1/batches/<id>/cancel``)."""
    b = _batch_or_404(batch_id)
    if b is None:
        return json_error(404, f"No batch with id {batch_id!r}", "invalid_request_error", "batch_not_found")
    out = services().batches.cancel(b["tenant"], batch_id)
    services().event(EventKind.BATCH_CANCELLED, f"batch {batch_id} of tenant {b['tenant'] or '(anonymous)'} "
                     "cancelled by the operator", batch=batch_id, tenant=b["tenant"])
    return jsonify(out)
