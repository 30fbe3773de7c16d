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

LOG_FIELDS: tuple[str, ...] = ("ts", "pool", "node", "status", "cache", "kind", "fp", "key", "ms", "point",
                               "tries", "home")
"""The request-log entry's fields in XADD order (see ``keys.lua`` for each one's meaning);
``home`` (the key's home node, from the balancer) since issue 10: older entries lack it."""

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
    "stream_errors": "kvgate_stream_errors_total",
    "stream_cuts": "kvgate_stream_cuts_total",
    "request_log_written": "kvgate_request_log_written_total",
    "request_log_dropped": "kvgate_request_log_dropped_total",
    "prefix_captures": "kvgate_prefix_captures_total",
    "prefix_capture_skipped": "kvgate_prefix_capture_skipped_total",
    "config_loads": "kvgate_gateway_config_loads",
    "config_version": "kvgate_config_version",
    "config_pushes": "kvgate_config_pushes_total",
}
"""The gateway's metric families on ``/metrics``, by short name."""

REQUESTS = METRICS["requests"]
UPSTREAM_INFLIGHT = METRICS["upstream_inflight"]
FAILOVERS = METRICS["failovers"]


def resp_key(version: int, scope: str, digest: str) -> str:
    """``kvgate:resp:v<version>:<scope>:<digest>`` (scope as the gateway escapes it)."""
    return f"{RESP_PREFIX}v{version}:{scope}:{digest}"


def hot_key(pool: str, minute: int) -> str:
    """``kvgate:hot:<pool>:<minute>``; minute = floor(epoch seconds / 60)."""
    return f"{HOT_PREFIX}{pool}:{minute}"


def prefix_text_key(pool: str, fp: str) -> str:
    """``kvgate:prefix:<pool>:<fp>``: the warm-up document of fingerprint ``fp``."""
    return f"{PREFIX_TEXT_PREFIX}{pool}:{fp}"
