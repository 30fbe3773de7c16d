"""Render a :class:`~kvgate.policy.model.Policy` into the gateway's nginx files, and the
runtime the control plane pushes on top of them.

Two kinds of config, as in ingress-nginx:

*Static* files (:func:`render`), relative to the nginx prefix, changed only through the reload
transaction (:meth:`kvgate.nginxctl.Nginx.apply`):

``conf/nginx.conf``
    from the Jinja2 templates in the repo's ``nginx/`` folder: absolute module
    paths (``/usr/lib/nginx/modules/...``, a ``-p`` prefix would otherwise be
    prepended), pid and error log under ``logs/``, every temp path under ``tmp/``,
    ``lua_package_path "<lua_dir>/?.lua;;"``, one ``upstream pool_<name>`` per pool, the
    client listener and the loopback-only internal listener (``gateway.internal_listen``).
``conf/kvgate.json``
    the data-path config the Lua modules read once in ``init_by_lua`` (see
    ``lua/kvgate/config.lua``): pools, model → pool, node address → node id, cache,
    Redis, limits, ``internal.push_secret_sha256``, and a ``digest`` that ``GET
    /kvgate/health`` reports, so a caller can tell when a reload has taken effect.

Neither depends on a :class:`Runtime`: node weights, node states, the balancer in force per
pool and the cache namespace version are the *runtime* (:func:`runtime_document`), pushed to
``POST /kvgate/config`` on the internal listener without a reload and written to
``conf/runtime.json`` before every start, reload and push (the gateway seeds its runtime from
that file when it loads). kvgate.json keeps the policy's base weight per node, balancer per
pool and namespace version only as the defaults the Lua uses when no ``runtime.json`` exists;
they are left out of the ``digest`` (:func:`static_digest`), so a policy that changes only
those is a push too.

Rendering is deterministic but not pure: it resolves host names with
``getaddrinfo`` (node hosts, so ``$upstream_addr`` maps back to node ids; the Redis
host, because Lua cosockets resolve nothing without a ``resolver`` directive). The
same policy, ``lua_dir`` and name resolution give the same bytes, which is how
:meth:`kvgate.nginxctl.Nginx.apply` detects "unchanged"; a changed DNS answer shows
as a changed config.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any

import jinja2

from . import paths
from .addr import connect_address
from .fleet.weights import WEIGHT_SCALE  # noqa: F401 - the weight arithmetic's one home; re-exported
from .policy.model import DEFAULT_TENANT, Policy
from .policy.pricing import PricesConfig
from .policy.tls import nginx_tls

TENANT = "default"
"""Tenant of every request until authentication names one (part of every cache key)."""


@dataclass(frozen=True)
class Runtime:
    """What the control plane changes on top of a policy: the gateway's runtime, pushed
    without a reload (:func:`runtime_document`).

    Attributes:
        weights: node id → nginx-scale weight (units of ``1/WEIGHT_SCALE`` of base weight 1);
            ``0`` = not taking traffic (the node keeps its place on the ring, so only its own
            keys move to their next nodes). A node not in the map gets
            ``policy weight × WEIGHT_SCALE``.
        balancers: pool name → balancer in force (overload degrade switches a pool to
            ``least_conn``); pools not in the map use the policy's balancer.
        namespace_version: the response cache's namespace version in force when higher than
            the policy's: the control plane never lets it go back (a rollback or an older policy
            file would otherwise make invalidated entries readable again); None = the policy's.
        states: node id → the control plane's state name (``active``, ``draining`` …), shown by
            ``GET /kvgate/config``; the data path routes on the weight alone. A node not in the
            map reads ``active`` when its weight is above 0, else ``down``.
        home_weights: node id → the node's *serving* weight (>= 1,
            :func:`kvgate.fleet.weights.serving_weights`: the weight in force, or for a node not
            taking traffic its target weight). The gateway's home ring (a key's home node, logged
            as ``home`` in the request log) is built from these. A node not in the map gets its
            weight when above 0, else ``policy weight × WEIGHT_SCALE``.
    """

    weights: Mapping[str, int] = field(default_factory=dict)
    balancers: Mapping[str, str] = field(default_factory=dict)
    namespace_version: int | None = None
    states: Mapping[str, str] = field(default_factory=dict)
    home_weights: Mapping[str, int] = field(default_factory=dict)
    knowledge: Mapping[str, int] = field(default_factory=dict)
    """pool name → the pool's semantic ``knowledge_version`` in force when higher than the
    policy's (``kvgate cache bump-knowledge POOL``: never goes back, like the namespace)."""

    def weight(self, node_id: str, base: int) -> int:
        return int(self.weights.get(node_id, base * WEIGHT_SCALE))

    def home_weight(self, node_id: str, base: int) -> int:
        """The node's weight on the home ring (>= 1): :attr:`home_weights`, else its weight in
        force when above 0, else its base weight × ``WEIGHT_SCALE``."""
        w = int(self.home_weights.get(node_id) or 0)
        if w <= 0:
            w = self.weight(node_id, base)
        if w <= 0:
            w = base * WEIGHT_SCALE
        return max(1, w)

    def balancer(self, pool_name: str, configured: str) -> str:
        return self.balancers.get(pool_name, configured)

    def state(self, node_id: str, weight: int) -> str:
        return str(self.states.get(node_id) or ("active" if weight > 0 else "down"))


def runtime_document(policy: Policy, runtime: Runtime | None = None) -> dict[str, Any]:
    """The runtime as the gateway takes it: the body of ``POST /kvgate/config`` and the content
    of ``conf/runtime.json``.

    Shape (every pool and node of the policy, no others)::

        {"pools": {"<pool>": {"balancer": "chash" | "round_robin" | "least_conn" | "chash_bounded",
                              "bound_factor": float > 1, "bound_load": "prefill_tokens" | "requests",
                              "saturated_queue": int >= 0 (absent: none),
                              "nodes": {"<node id>": {"weight": int >= 0, "state": str,
                                                      "home_weight": int >= 1}}}},
         "cache": {"namespace_version": int >= 1,
                   "knowledge": {"<pool>": int >= 1}}}   # only pools with the semantic cache or static answers

    ``runtime=None`` is the policy as written: every node ``active`` at its base weight × 100.
    ``home_weight``: the node's weight on the home ring (:meth:`Runtime.home_weight`); the
    gateway logs each keyed request's home node on that ring. The namespace version is the
    higher of the policy's and the runtime's."""
    runtime = runtime or Runtime()
    pools: dict[str, Any] = {}
    for pool in policy.pools:
        nodes: dict[str, Any] = {}
        for n in pool.nodes:
            w = max(0, runtime.weight(n.id, n.weight))
            nodes[n.id] = {"weight": w, "state": runtime.state(n.id, w), "home_weight": runtime.home_weight(n.id, n.weight)}
        pools[pool.name] = {"balancer": runtime.balancer(pool.name, pool.balancer), "nodes": nodes,
                            **_bound_fields(pool)}
    cache: dict[str, Any] = {"namespace_version": max(policy.cache.namespace_version, runtime.namespace_version or 0)}
    knowledge = {p.name: max(p.semantic.knowledge_version, int(runtime.knowledge.get(p.name) or 0))
                 for p in policy.pools if p.semantic.enabled or p.semantic.static_answers}
    if knowledge:
        # the semantic cache's knowledge versions (lua/kvgate/semantic.lua: part of every scope)
        cache["knowledge"] = knowledge
    return {"pools": pools, "cache": cache}


def _bound_fields(pool: Any) -> dict[str, Any]:
    """The pool's chash_bounded fields as the runtime (and kvgate.json's defaults) carry them:
    ``bound_factor``, ``bound_load``, and ``saturated_queue`` unless the policy has none (null)."""
    out: dict[str, Any] = {"bound_factor": pool.bound_factor, "bound_load": pool.bound_load}
    if pool.saturated_queue is not None:
        out["saturated_queue"] = pool.saturated_queue
    return out


def runtime_json(doc: Mapping[str, Any]) -> str:
    """The bytes sent and written for a runtime document: compact JSON, sorted keys (the same
    document always gives the same text, and so the same sha256)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


TEMPLATE_DIR = paths.template_dir()  # $KVGATE_HOME/nginx or the package's share/nginx (kvgate.paths)


def default_lua_dir() -> Path:
    """The folder with ``kvgate/*.lua``: ``$KVGATE_HOME/lua`` or the package's ``share/lua``
    (:func:`kvgate.paths.lua_dir`)."""
    return paths.lua_dir()


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _seconds(value: float) -> str:
    """nginx time: whole milliseconds (``1.5`` → ``1500ms``)."""
    return f"{max(1, round(value * 1000))}ms"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, port: int) -> list[str]:
    """IP addresses of ``host`` (DNS or ``/etc/hosts``), IPv4 ones first, in resolver
    order, without duplicates; ``[]`` if it does not resolve. An IP literal is returned
    unchanged."""
    if _is_ip(host):
        return [host]
    out: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            addr = str(info[4][0])
            if addr not in out:
                out.append(addr)
    return out


def _addresses(host: str, port: int) -> list[str]:
    """``HOST:PORT`` plus the IPv4 forms nginx will report in ``$upstream_addr``."""
    out = [f"{host}:{port}"]
    if _is_ip(host):
        return out
    for ip in _resolve(host, port):
        addr = f"{ip}:{port}"
        if ":" not in ip and addr not in out:
            out.append(addr)
    return out


def node_peer(host: str, port: int) -> str:
    """The address the Lua ``chash`` balancer connects a node to: ``IP:PORT`` (``[IPv6]:PORT``),
    the host resolved here, IPv4 preferred, because ``ngx.balancer.set_current_peer`` resolves
    no names. This is also the address ``$upstream_addr`` then shows (mapped back to the node
    id in ``nodes_by_addr``). A host that does not resolve is returned as ``HOST:PORT``:
    the upstream's ``server HOST:PORT`` line then fails ``nginx -t`` ("host not found in
    upstream"), as it did before the balancer moved to Lua."""
    ips = _resolve(host, port)
    if not ips:
        return f"{host}:{port}"
    ip = ips[0]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def redis_host(policy: Policy) -> str:
    """The IP address the data path connects to for ``policy.redis``.

    Lua cosockets cannot resolve a name unless nginx has a ``resolver`` directive
    (none is rendered), so ``redis://localhost:6390/0`` would fail on every call: the
    host is resolved here, IPv4 preferred; an IP literal is kept as written.

    Raises:
        ValueError: the host does not resolve (the message names ``redis.url``).
    """
    host, port = policy.redis.host, policy.redis.port
    ips = _resolve(host, port)
    if not ips:
        raise ValueError(f"redis.url {policy.redis.url!r}: cannot resolve host {host!r} to an IP address")
    return ips[0]


def sentinel_peers(policy: Policy) -> list[dict[str, Any]]:
    """``policy.redis.sentinels`` as the data path connects to them: ``[{"host": IP, "port": N}]``,
    each host resolved as :func:`redis_host` does (cosockets resolve no names).

    Raises:
        ValueError: a sentinel's host does not resolve (the message names ``redis.sentinels[i]``).
    """
    out = []
    for i, item in enumerate(policy.redis.sentinels):
        host, _, port = item.rpartition(":")
        host = host.strip("[]")
        ips = _resolve(host, int(port))
        if not ips:
            raise ValueError(f"redis.sentinels[{i}] {item!r}: cannot resolve host {host!r} to an IP address")
        out.append({"host": ips[0], "port": int(port)})
    return out


def _prices(prices: PricesConfig) -> dict[str, Any]:
    """A pool's ``prices`` in ``kvgate.json``: ``{input, cached, output}`` in whole nano-dollars per
    token (:meth:`PricesConfig.nano_usd_per_token`) and ``batch_discount`` (0..1, the share a batch
    request does not pay)."""
    t = prices.nano_usd_per_token()
    return {"input": t.input, "cached": t.cached_input, "output": t.output, "batch_discount": prices.batch_discount}


SEMANTIC_SOCKET = "semantic.sock"
"""A socket name in the run dir, for a policy whose ``semantic_service.listen`` is empty (older
policies; the field defaults to a loopback port now)."""


def semantic_listen(policy: Policy, run_dir: Path | None) -> str:
    """Where the gateway reaches the semantic service (``kvgate semantic`` listens there):
    ``semantic_service.listen`` as written (default ``127.0.0.1:9096``); an empty one falls back
    to ``unix:<run dir>/semantic.sock`` (the run dir is the nginx prefix's parent), or with
    ``run_dir=None`` to ``""``, which the Lua reads as ``unix:<nginx prefix>/../semantic.sock``."""
    listen = policy.semantic_service.listen
    if listen:
        return listen
    if run_dir is None:
        return ""
    return f"unix:{Path(run_dir).resolve() / SEMANTIC_SOCKET}"


def _pool_semantic(pool: Any, cache_ttl_s: int) -> dict[str, Any] | None:
    """A pool's ``semantic`` in kvgate.json (lua/kvgate/semantic.lua), or None when the pool has
    neither the semantic cache nor static answers (the cache stage then asks nothing). ``ttl_s``:
    the pool's, else the cache's.
    ``knowledge_version`` is a default only: the runtime's (``cache.knowledge``) is in force when
    higher."""
    sc = pool.semantic
    if not (sc.enabled or sc.static_answers):
        return None
    return {"enabled": sc.enabled, "static": sc.static_answers is not None, "similarity_min": sc.similarity_min,
            "model": sc.model, "ttl_s": sc.ttl_s or cache_ttl_s, "timeout_ms": sc.timeout_ms,
            "max_temperature": sc.max_temperature, "max_question_bytes": sc.max_question_bytes,
            "knowledge_version": sc.knowledge_version}


def data_config(policy: Policy, push_secret_sha256: str = "", batch_secret: str = "",
                run_dir: Path | None = None) -> dict[str, Any]:
    """The ``kvgate.json`` content (without its ``digest`` and ``lua_digest``) as a dict.

    Per pool ``balancer`` and per node ``weight`` are the policy's (base weight ×
    ``WEIGHT_SCALE``), as is ``cache.namespace_version``: the defaults of a gateway without
    ``conf/runtime.json`` (:data:`RUNTIME_DEFAULTS`). ``internal.push_secret_sha256``: sha256 hex
    of the push secret the internal listener accepts (``""``: none, every push is refused).
    ``batch_secret``: the key of the Batch API's ``X-Kvgate-Batch`` header
    (:func:`kvgate.batch.records.batch_secret`; ``""``: every such header is refused).

    Resolves host names (see :func:`redis_host`); raises ``ValueError`` when the Redis
    host does not resolve."""
    pools: dict[str, Any] = {}
    models: dict[str, str] = {}
    nodes_by_addr: dict[str, str] = {}
    for pool in policy.pools:
        peers = {n.id: node_peer(n.host, n.port) for n in pool.nodes}
        pools[pool.name] = {
            "name": pool.name,
            "upstream": f"pool_{pool.name}",
            "balancer": pool.balancer,  # default only: the runtime's is in force
            **_bound_fields(pool),  # defaults only too
            "affinity": list(pool.affinity),
            "session_header": pool.session_header,
            "prefix_chars": pool.prefix_chars,
            # peer: where the Lua balancer connects; the ring is built from id and weight
            # (weight: the default only, the runtime's is in force)
            "nodes": [{"id": n.id, "address": n.address, "weight": n.weight * WEIGHT_SCALE,
                       "peer": peers[n.id]}
                      for n in pool.nodes],
            "capture": {
                "enabled": pool.warmup.capture_prefix_text,
                "ttl_s": pool.warmup.capture_ttl_s,
                "max_bytes": pool.warmup.capture_max_bytes,
            },
            "hot_window_s": pool.warmup.hot_window_s,
            **({"admission": {"node_capacity": pool.admission.node_capacity,
                              "queue_length": pool.admission.queue_length,
                              "queue_timeout_s": pool.admission.queue_timeout_s}} if pool.admission else {}),
            # the prefix balancer's index (lua/kvgate/prefix_index.lua): capacity in prompt bytes
            "prefix_index": {
                "chunk_chars": pool.prefix_index.chunk_chars,
                "capacity_chars": round(pool.prefix_index.kv_capacity_tokens * pool.prefix_index.chars_per_token),
                "chars_per_token": pool.prefix_index.chars_per_token,
                "ttl_s": pool.prefix_index.ttl_s,
                "max_chars": pool.prefix_index.max_prompt_chars,
            },
            # failover, breakers, keyless requests (lua/kvgate/breaker.lua, balancer/peers.lua)
            "failover": pool.failover.model_dump(),
            # what a token costs (lua/kvgate/usage.lua): whole nano-dollars per token, so the
            # request log's costs sum exactly; absent: no prices (cost "")
            **({"prices": _prices(pool.prices)} if pool.prices is not None else {}),
            # the semantic cache and static answers (lua/kvgate/semantic.lua); absent: off
            **({"semantic": sem} if (sem := _pool_semantic(pool, policy.cache.ttl_s)) else {}),
        }
        for model in pool.models:
            models[model] = pool.name
        for node in pool.nodes:
            for addr in _addresses(node.host, node.port) + [peers[node.id]]:
                nodes_by_addr[addr] = node.id
    gw = policy.gateway
    tenants: dict[str, Any] = {}
    for t in policy.tenants:
        entry: dict[str, Any] = {"name": t.name or t.id, "scope": t.cache_scope, "priority": t.priority}
        lim = t.limits
        limits = {k: v for k, v in (("rpm", lim.rpm), ("tpm", lim.tpm), ("concurrency", lim.concurrency),
                                    ("session_rpm", lim.session_rpm),
                                    ("key_rpm", lim.per_key.rpm if lim.per_key else None),
                                    ("key_tpm", lim.per_key.tpm if lim.per_key else None)) if v is not None}
        if limits:
            entry["limits"] = limits  # absent: unlimited (no Redis call at all)
        if t.models is not None:
            entry["models"] = {m: True for m in t.models}  # absent: every model
        tenants[t.id] = entry
    member = policy.member_of_listen(gw.listen)
    return {
        # which member of the gateway tier this is (docs/scale-out.md): with more than one member
        # the data path sums in-flight load across them through Redis
        "gateway": {"id": member.id, "members": sorted(m.id for m in policy.gateway_members()),
                    "load_sync_s": gw.load_sync_s},
        # the cache scope of every request when gateway.auth is off (one anonymous tenant)
        "tenant": TENANT,
        # API keys (lua/kvgate/tenant.lua): the mode, how long a worker trusts a key's lookup,
        # how long a seen key stays valid while Redis is unreachable
        "auth": {"mode": gw.auth, "cache_ttl_s": gw.auth_cache_ttl_s, "stale_s": gw.auth_stale_s,
                 "default_tenant": DEFAULT_TENANT},
        "tenants": tenants,
        "tenant_ids": sorted(tenants),
        # lua/kvgate/limits.lua: a concurrency slot is a lease of slot_lease_s, renewed while its
        # request runs (slot_ttl_s: how long a gateway keeps renewing one, at most)
        # the request log's usage record (lua/kvgate/usage.lua): block hashes kept per prompt
        "usage": {"log_blocks": policy.usage.log_blocks},
        "limits": {"on_redis_error": policy.limits.on_redis_error,
                   "fallback_factor": policy.limits.fallback_factor,
                   "default_max_tokens": policy.limits.default_max_tokens,
                   "session_burst_s": policy.limits.session_burst_s,
                   "slot_lease_s": policy.limits.slot_lease_s,
                   "slot_ttl_s": max(600.0, 2 * gw.read_timeout_s)},
        "debug_headers": gw.debug_headers,
        "fallback_route_key": gw.fallback_route_key,
        "max_body_bytes": gw.max_body_bytes,
        # the Lua body reader's idle timeout and total deadline (lua/kvgate/body.lua)
        "client_body_timeout_ms": max(1, round(gw.client_body_timeout_s * 1000)),
        "client_body_deadline_ms": max(1, round(gw.client_body_deadline_s * 1000)),
        "shutdown": {
            "grace_s": gw.worker_shutdown_timeout_s,
            "cut_streams_after_s": stream_cut_after_s(gw.worker_shutdown_timeout_s, gw.read_timeout_s),
        },
        "models": models,
        "model_list": sorted(models),
        "pools": pools,
        "pool_names": [p.name for p in policy.pools],
        "upstream_pools": {f"pool_{p.name}": p.name for p in policy.pools},
        "nodes_by_addr": nodes_by_addr,
        "cache": {
            "enabled": policy.cache.enabled,
            "ttl_s": policy.cache.ttl_s,
            "max_entry_bytes": policy.cache.max_entry_bytes,
            # single flight (lua/kvgate/flight.lua): how long a duplicate miss waits; 0 = off
            "single_flight_wait_ms": round(policy.cache.single_flight_wait_s * 1000),
            "namespace_version": policy.cache.namespace_version,  # default only (runtime.json)
            # lowercase, in the policy's order: ngx.req.get_headers() keys are lowercase (the
            # names also enter the credential digest, so the policy's spelling does not)
            "credential_headers": [h.lower() for h in policy.cache.credential_headers],
        },
        "internal": {"push_secret_sha256": push_secret_sha256},
        # the semantic service (lua/kvgate/semantic.lua): "" = unix:<nginx prefix>/../semantic.sock
        "semantic_service": {"listen": semantic_listen(policy, run_dir)},
        # the Batch API's line principal (lua/kvgate/batch_principal.lua): HMAC key, "" = refused
        "batch_secret": batch_secret,
        "redis": {
            # with sentinels the data path connects to the master they name (host/port unused)
            "host": redis_host(policy) if not policy.redis.sentinels else policy.redis.host,
            "port": policy.redis.port,
            "db": policy.redis.db,
            "timeout_ms": policy.redis.timeout_ms,
            "pool_size": policy.redis.pool_size,
            # only with redis.sentinels (lua/kvgate/redis.lua, docs/sentinel.md): absent keys keep a
            # plain Redis's config as it was
            **({"sentinels": sentinel_peers(policy), "master_name": policy.redis.master_name,
                "sentinel_timeout_ms": policy.redis.sentinel_timeout_ms} if policy.redis.sentinels else {}),
        },
    }


MULTIPART_SLACK_BYTES = 1024 * 1024
"""``client_max_body_size`` of the client listener's ``/v1/files`` is the policy's
``batch.max_file_bytes`` (OpenAI's 200 MB by default) plus this much for the multipart framing
(the control plane checks the file's own size)."""


STREAM_CUT_MARGIN_S = 1.0
"""Seconds between the read timeout of a stream silent at the shutdown cut and the end of the grace."""


def stream_cut_after_s(grace_s: float, read_timeout_s: float) -> float:
    """Seconds after a worker begins its graceful shutdown at which it ends the streams still sending.

    A stream that sends after this instant is ended with an error event (``lua/kvgate/shutdown.lua``);
    one silent at it ends by the read timeout before ``grace_s`` runs out, so nginx's forced
    close at the end of ``worker_shutdown_timeout`` never cuts a stream silently. The policy
    requires ``grace_s >= read_timeout_s + STREAM_CUT_MARGIN_S``, so the result is >= 0.
    """
    return max(0.0, grace_s - read_timeout_s - STREAM_CUT_MARGIN_S)


def lua_digest(lua_dir: Path) -> str:
    """sha256 (16 hex digits) over the paths and contents of ``lua_dir/kvgate/**/*.lua``."""
    h = hashlib.sha256()
    root = Path(lua_dir)
    for path in sorted(root.glob("kvgate/**/*.lua")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


RUNTIME_DEFAULTS = ("pools.*.balancer", "pools.*.bound_factor", "pools.*.bound_load", "pools.*.saturated_queue",
                    "pools.*.nodes[].weight", "pools.*.semantic.knowledge_version", "cache.namespace_version")
"""Fields of kvgate.json that are only the runtime's defaults: left out of :func:`static_digest`."""


def static_identity(data: Mapping[str, Any]) -> dict[str, Any]:
    """kvgate.json's content without ``digest`` and the :data:`RUNTIME_DEFAULTS`: what a change
    of must reload nginx."""
    out = json.loads(json.dumps({k: v for k, v in data.items() if k != "digest"}))
    for pool in (out.get("pools") or {}).values():
        if isinstance(pool, dict):
            pool.pop("balancer", None)
            pool.pop("bound_factor", None)
            pool.pop("bound_load", None)
            pool.pop("saturated_queue", None)
            if isinstance(pool.get("semantic"), dict):
                pool["semantic"].pop("knowledge_version", None)
            for node in pool.get("nodes") or []:
                if isinstance(node, dict):
                    node.pop("weight", None)
    if isinstance(out.get("cache"), dict):
        out["cache"].pop("namespace_version", None)
    return out


def static_digest(conf: str, data: Mapping[str, Any]) -> str:
    """sha256 (16 hex digits) over ``nginx.conf`` and :func:`static_identity` of kvgate.json: the
    ``digest`` that ``GET /kvgate/health`` reports. Two renders with the same digest differ at most
    in the runtime's defaults, which never need a reload."""
    body = json.dumps(static_identity(data), sort_keys=True, indent=2)
    return hashlib.sha256((conf + "\0" + body).encode()).hexdigest()[:16]


def upstream_pools(policy: Policy) -> list[dict[str, Any]]:
    """The pools as the upstream template sees them: name, models and per server its node id,
    address and ``peer`` (:func:`node_peer`: one resolved ``IP:PORT``, or ``HOST:PORT`` as written
    when it does not resolve, which then fails ``nginx -t``). The ``server`` line is the peer, so
    nginx gives the request exactly one try per node (a name resolving to IPv4 and IPv6 would give
    two), which the Lua balancer counts on when it takes the retry away from a pool with one node
    taking traffic. No balancer, weight or state: those are the runtime's, applied in
    ``balancer_by_lua`` (a change of them must never change nginx.conf)."""
    return [
        {
            "name": pool.name,
            "models": pool.models,
            "nodes": [{"id": n.id, "address": n.address, "peer": node_peer(n.host, n.port)} for n in pool.nodes],
        }
        for pool in policy.pools
    ]


def render(policy: Policy, lua_dir: Path, runtime: Runtime | None = None, *,
           push_secret_sha256: str = "", batch_secret: str = "", run_dir: Path | None = None,
           control_url: str | None = None) -> dict[str, str]:
    """Render the gateway's static config for ``policy``.

    Args:
        policy: a validated policy.
        lua_dir: folder holding ``kvgate/*.lua`` (made absolute).
        runtime: ignored: the static files never depend on the runtime (see
            :func:`runtime_document`); kept so older callers need no change.
        push_secret_sha256: sha256 hex of the internal listener's push secret
            (:class:`kvgate.nginxctl.Nginx` passes its ``conf/push.secret``'s); ``""`` renders a
            gateway that refuses every push (fine for ``nginx -t``).
        batch_secret: the HMAC key of the Batch API worker's ``X-Kvgate-Batch`` header
            (:func:`kvgate.batch.records.batch_secret` of the admin token; hex). ``""`` renders a
            gateway that refuses every batch header. It is a secret: kvgate.json is 0600-worthy.
        run_dir: the run dir, for the semantic service's default socket (:func:`semantic_listen`;
            :class:`kvgate.nginxctl.Nginx` passes its prefix's parent).

    Returns:
        ``{"conf/nginx.conf": text, "conf/kvgate.json": text}``, paths relative to
        the nginx prefix.

    Raises:
        ValueError: ``redis.url`` names a host that does not resolve, or a ``gateway.tls`` file
            cannot be read (its content digest is rendered: :func:`kvgate.policy.tls.nginx_tls`).
    """
    del runtime
    lua_dir = Path(lua_dir).resolve()
    gw = policy.gateway
    conf = _env().get_template("nginx.conf.j2").render(
        gw=gw,
        # where /v1/files and /v1/batches go (docs/tls.md): the control plane at control.listen on
        # this host, or, for a gateway member on another host, the URL its supervisor reaches it at
        control_addr=urlsplit(control_url).netloc if control_url else connect_address(policy.control.listen),
        control_scheme=(urlsplit(control_url).scheme if control_url
                        else "https" if policy.control.tls else "http"),
        files_max_body_bytes=policy.batch.max_file_bytes + MULTIPART_SLACK_BYTES,
        public_metrics=policy.public_metrics,
        pools=upstream_pools(policy),
        lua_dir=str(lua_dir),
        connect_timeout=_seconds(gw.connect_timeout_s),
        read_timeout=_seconds(gw.read_timeout_s),
        tls=nginx_tls(gw.tls),  # docs/tls.md: the files' digest is in the config, a renewal reloads
    )
    data = data_config(policy, push_secret_sha256, batch_secret, run_dir)
    # The Lua modules are loaded once per (re)load, so a changed module must count as a
    # changed config: otherwise `kvgate up` after an upgrade would keep the old code.
    data["lua_digest"] = lua_digest(lua_dir)
    data["digest"] = static_digest(conf, data)
    return {
        "conf/nginx.conf": conf,
        "conf/kvgate.json": json.dumps(data, sort_keys=True, indent=2) + "\n",
    }
