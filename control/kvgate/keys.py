"""The contract between the data path and the control plane, Python side.

Every Redis key the gateway writes, the request-log entry's fields and the gateway's metric
names, mirrored from ``lua/kvgate/keys.lua`` (the gateway's side); ``tests/unit/
test_keys_contract.py`` runs luajit on that file and compares the two, so a name changed on
one side only fails the tests instead of silently reading nothing.
"""

from __future__ import annotations

RESP_PREFIX = "kvgate:resp:"
"""Response cache: ``kvgate:resp:v<N>:<scope>:<sha256 hex>`` (``cache_key.lua``)."""
LOG_STREAM = "kvgate:log"
"""The request-log stream (XADD by ``reqlog.lua``'s flush, ``MAXLEN ~ LOG_MAXLEN``)."""
LOG_MAXLEN = 100000
HOT_PREFIX = "kvgate:hot:"
"""Hot prefixes per pool and minute: ``kvgate:hot:<pool>:<minute>`` (sorted set of fingerprints)."""
PREFIX_TEXT_PREFIX = "kvgate:prefix:"
"""Warm-up prefix documents: ``kvgate:prefix:<pool>:<fp>`` (opt-in ``warmup.capture_prefix_text``)."""
CONTROL_PREFIX = "kvgate:control:"
"""Everything the control plane stores (``control/store.py``); the gateway writes nothing here."""
NODE_LOAD_PREFIX = "kvgate:load:"
"""Engines' last reported load: a hash per pool ``kvgate:load:<pool>``, field = node id, value =
:data:`NODE_LOAD_FIELDS` space-separated (``-`` = unknown). Written by the control plane at each
agent report, read by the gateway's timer every second (``lua/kvgate/node_load.lua``)."""
GWLOAD_PREFIX = "kvgate:gwload:"
"""In-flight prefill per gateway: a hash ``kvgate:gwload:<gateway id>``, field ``<pool>\t<node>``
(or ``<pool>\t``, the pool's total), value = estimated prompt tokens in flight. Replaced every
``gateway.load_sync_s`` (50 ms) by each gateway's worker 0 (TTL 4 rounds) when the policy has several gateway members; every
gateway adds the other members' sums to its own for the load bound (``lua/kvgate/gwload.lua``)."""
APIKEY_PREFIX = "kvgate:apikey:"
"""API keys: a hash per key ``kvgate:apikey:<sha256 hex of the secret>`` with ``id``, ``tenant``,
``name``, ``created`` (unix s), ``revoked`` (``0``/``1``) and ``last_used`` (unix s, set by the
gateways). Written by the control plane (``control/apikeys.py``), read by ``lua/kvgate/tenant.lua``.
The secret itself is stored nowhere."""
FLIGHT_PREFIX = "kvgate:flight:"
"""Single flight (``lua/kvgate/flight.lua``): ``kvgate:flight:<exact-cache key>``, set (NX, with the
wait bound as TTL) by the first miss of a key and deleted with its stored entry."""
TAG_PREFIX = "kvgate:tag:"
"""Cache tags (``X-Kvgate-Cache-Tags``, ``lua/kvgate/semantic.lua``): a set ``kvgate:tag:<tag>`` of
exact-cache keys with the entries' TTL; ``kvgate cache invalidate --tag`` deletes them
(``control/semcache.py``)."""
RATELIMIT_PREFIX = "kvgate:rl:"
"""Tenants' limits (``lua/kvgate/limits.lua``): token-bucket hashes ``kvgate:rl:<tenant>:rpm`` /
``:tpm`` (fields ``t`` tokens left, ``ts`` ms, ``n`` requests admitted while the bucket lived),
per session ``kvgate:rl:<tenant>:s:<16 hex>:rpm``, per key ``kvgate:rl:<tenant>:k:<key id>:rpm`` /
``:tpm``, and the sorted set ``kvgate:rl:<tenant>:concurrency``; every one with a TTL of at most
one window (a full bucket is an absent key)."""
APIKEY_INDEX = "kvgate:apikeys"
"""Hash: key id -> the key's sha256 hex (the control plane's listing and revocation by id)."""


def apikey_key(digest: str) -> str:
    """``kvgate:apikey:<digest>`` (``keys.lua``'s ``apikey``)."""
    return APIKEY_PREFIX + digest


NODE_LOAD_FIELDS: tuple[str, ...] = ("received_at", "interval_s", "waiting", "running", "kv_use")
"""``received_at``: unix s (the control plane's clock); ``interval_s``: the agents' report interval
(a report older than 3 of them is unknown to the gateway); ``waiting``/``running``: the engine's
queued / running requests; ``kv_use``: KV-cache use 0..1."""

LOG_FIELDS: tuple[str, ...] = ("ts", "pool", "node", "status", "cache", "kind", "fp", "key", "ms", "point",
                               "tries", "home", "spill", "tenant", "key_id", "model", "prompt", "cached",
                               "completion", "ttft", "batch", "blocks", "cost", "saved_cache", "saved_prefix",
                               "saved_batch")
"""The request-log entry's fields in XADD order (see ``keys.lua`` for each one's meaning);
``home`` (the key's home node, from the balancer) since issue 10, ``spill`` (``bound`` | ``queue``
| ``""``: why a bounded balancer sent the key past its home) since issue 11, the usage record
(``key_id`` .. ``saved_batch``: tokens, TTFT in ms, block hashes, money in integer nano-dollars,
``""`` = unknown) since issue 13: older entries lack them."""

METRICS: dict[str, str] = {
    "requests": "kvgate_requests_total",
    "upstream_response": "kvgate_upstream_response_seconds",
    "failovers": "kvgate_failovers_total",
    "cache_errors": "kvgate_cache_errors_total",
    "cache_stores": "kvgate_cache_stores_total",
    "cache_store_skipped": "kvgate_cache_store_skipped_total",
    "route_key_fallback": "kvgate_route_key_fallback_total",
    "route_key_shared_prefix": "kvgate_route_key_shared_prefix_total",
    "route_key_sentinel": "kvgate_route_key_sentinel_total",
    "bad_requests": "kvgate_bad_requests_total",
    "upstream_inflight": "kvgate_upstream_inflight",
    "upstream_load": "kvgate_upstream_load_tokens",
    "upstream_load_remote": "kvgate_upstream_load_tokens_remote",
    "redis_master_changes": "kvgate_redis_master_changes_total",
    "route_spill": "kvgate_route_spill_total",
    "upstream_failover": "kvgate_upstream_failover_total",
    "upstream_breaker": "kvgate_upstream_breaker_state",
    "stream_errors": "kvgate_stream_errors_total",
    "stream_cuts": "kvgate_stream_cuts_total",
    "request_log_written": "kvgate_request_log_written_total",
    "request_log_dropped": "kvgate_request_log_dropped_total",
    "prefix_captures": "kvgate_prefix_captures_total",
    "prefix_capture_skipped": "kvgate_prefix_capture_skipped_total",
    "config_loads": "kvgate_gateway_config_loads",
    "config_version": "kvgate_config_version",
    "config_pushes": "kvgate_config_pushes_total",
    "ratelimited": "kvgate_ratelimited_total",
    "ratelimit_redis_errors": "kvgate_ratelimit_redis_errors_total",
    "admission_waiting": "kvgate_admission_waiting",
    "admission_inflight": "kvgate_admission_inflight",
    "admission_wait": "kvgate_admission_wait_seconds",
    "admission_rejected": "kvgate_admission_rejected_total",
    "tokens": "kvgate_tokens_total",
    "tokens_avoided": "kvgate_tokens_avoided_total",
    "cost_usd": "kvgate_cost_usd_total",
    "saved_usd": "kvgate_saved_usd_total",
}
"""The gateway's metric families on ``/metrics``, by short name."""

REQUESTS = METRICS["requests"]
UPSTREAM_INFLIGHT = METRICS["upstream_inflight"]
FAILOVERS = METRICS["failovers"]
ROUTE_SPILL = METRICS["route_spill"]
UPSTREAM_LOAD = METRICS["upstream_load"]
UPSTREAM_LOAD_REMOTE = METRICS["upstream_load_remote"]
UPSTREAM_FAILOVER = METRICS["upstream_failover"]
UPSTREAM_BREAKER = METRICS["upstream_breaker"]
"""0 closed, 1 open, 2 half-open (kvgate.breaker)."""


def resp_key(version: int, scope: str, digest: str) -> str:
    """``kvgate:resp:v<version>:<scope>:<digest>`` (scope as the gateway escapes it)."""
    return f"{RESP_PREFIX}v{version}:{scope}:{digest}"


def hot_key(pool: str, minute: int) -> str:
    """``kvgate:hot:<pool>:<minute>``; minute = floor(epoch seconds / 60)."""
    return f"{HOT_PREFIX}{pool}:{minute}"


def prefix_text_key(pool: str, fp: str) -> str:
    """``kvgate:prefix:<pool>:<fp>``: the warm-up document of fingerprint ``fp``."""
    return f"{PREFIX_TEXT_PREFIX}{pool}:{fp}"


def node_load_key(pool: str) -> str:
    """``kvgate:load:<pool>``: the hash of the pool's engines' last reported load."""
    return f"{NODE_LOAD_PREFIX}{pool}"


def node_load_value(received_at: float, interval_s: float, waiting: float | None, running: float | None,
                    kv_use: float | None) -> str:
    """A node's field in :func:`node_load_key`: :data:`NODE_LOAD_FIELDS` space-separated,
    ``-`` for a figure the report lacks (unknown, never 0)."""
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{float(v):.6g}"
    return f"{received_at:.3f} {interval_s:.6g} {fmt(waiting)} {fmt(running)} {fmt(kv_use)}"
