"""The routing policy: the operator's interface to kvgate, as a typed, validated model.

Every field carries a description; ``docs/policy-reference.md`` documents the same fields.
The model is strict: unknown keys are errors (a typo must not silently fall back
to a default), and cross-field rules (unique node ids, one pool per model) are
checked after the fields themselves.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

AffinityKey = Literal["session", "user", "prefix"]
Balancer = Literal["chash", "round_robin", "least_conn"]

_HEADER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


class GatewayConfig(_Strict):
    """The nginx data path."""

    listen: str = Field("127.0.0.1:8080", description="HOST:PORT nginx listens on for client traffic.")
    worker_processes: int = Field(2, ge=1, le=64, description="nginx worker processes.")
    worker_connections: int = Field(4096, ge=64, description="nginx worker_connections.")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="Largest accepted request body in bytes; larger → 413. Bodies are kept in memory "
        "up to this size so the route key and cache key can be computed in the access phase.",
    )
    debug_headers: bool = Field(
        False, description="Add X-Kvgate-Node and X-Kvgate-Route-Key-Kind to responses."
    )
    connect_timeout_s: float = Field(1.0, gt=0, description="Upstream connect timeout (seconds).")
    read_timeout_s: float = Field(600.0, gt=0, description="Upstream read timeout between two reads (seconds).")
    fallback_route_key: str = Field(
        "kvgate:fallback", min_length=1, max_length=128,
        description="Route key used when a request has none of the pool's affinity keys; counted in "
        "kvgate_requests_total{route_key_kind=\"fallback\"}.",
    )
    worker_shutdown_timeout_s: int = Field(
        300, ge=1, description="How long old workers may finish streams after a reload (seconds)."
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _host_port(v)


class RedisConfig(_Strict):
    """The Redis instance for the response cache (and, later, state and rate limits)."""

    url: str = Field("redis://127.0.0.1:6390/0", description="redis://HOST:PORT/DB of the Redis to use.")
    timeout_ms: int = Field(200, ge=1, le=10_000, description="Connect/read timeout the data path allows Redis (ms).")
    pool_size: int = Field(64, ge=1, description="Keepalive connections per nginx worker.")
    managed: bool = Field(
        True, description="`kvgate up` starts a private redis-server on this address when true."
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "redis" or not parts.hostname or not parts.port:
            raise ValueError(f"expected redis://HOST:PORT/DB, got {v!r}")
        if parts.username or parts.password:
            raise ValueError("credentials in redis.url are not supported yet (the gateway does not AUTH); "
                             "bind Redis to a private address instead")
        db = parts.path.lstrip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"database must be a number, got {db!r}")
        return v

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 6379

    @property
    def db(self) -> int:
        return int(urlsplit(self.url).path.lstrip("/") or 0)


class CacheConfig(_Strict):
    """The exact response cache in Redis (docs/gateway.md, Response cache)."""

    enabled: bool = Field(True, description="Look up and store deterministic responses in Redis.")
    ttl_s: int = Field(3600, ge=1, description="Lifetime of a cached response (seconds).")
    max_entry_bytes: int = Field(
        1024 * 1024, ge=1024, description="Responses larger than this are served but not cached (bytes)."
    )
    namespace_version: int = Field(
        1, ge=1, description="Part of every cache key: bump it to invalidate the whole cache at once."
    )


class NodeConfig(_Strict):
    """One inference server (one vLLM/SGLang replica)."""

    id: str = Field(description="Stable node id: lowercase letters, digits, '-' and '_'.")
    url: str = Field(description="Base URL of the engine's OpenAI-compatible server, e.g. http://10.0.0.5:8000.")
    weight: int = Field(1, ge=1, le=1000, description="Relative share of keys (nginx `weight=`).")
    simulate: bool = Field(
        False, description="`kvgate up` starts a `kvgate sim` engine simulator at this URL (demo/testing)."
    )

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"invalid node id {v!r}: use lowercase letters, digits, '-' and '_'")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://HOST:PORT, got {v!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"the node URL must be a bare http://HOST:PORT, got {v!r}")
        return v.rstrip("/")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80

    @property
    def address(self) -> str:
        """``HOST:PORT`` as nginx's ``server`` directive wants it."""
        return f"{self.host}:{self.port}"


class PoolConfig(_Strict):
    """A set of nodes serving the same models, with one balancer and one affinity-key order."""

    name: str = Field(description="Pool name (lowercase letters, digits, '-' and '_').")
    models: list[str] = Field(min_length=1, description="Model names (the request's `model`) served by this pool.")
    balancer: Balancer = Field(
        "chash",
        description="`chash`: nginx `hash $kvgate_route_key consistent` (ketama) with weights; "
        "`round_robin` and `least_conn`: baselines.",
    )
    affinity: list[AffinityKey] = Field(
        default_factory=lambda: ["session", "user", "prefix"],
        min_length=1,
        description="Route-key sources, first present wins: `session` (the session header), "
        "`user` (the OpenAI `user` field), `prefix` (conversation-stable prompt-prefix fingerprint).",
    )
    session_header: str = Field("X-Session-Id", description="Header carrying the client's session id.")
    prefix_chars: int = Field(
        2048, ge=64, le=1_000_000,
        description="Window of the canonical prompt hashed into the prefix fingerprint (bytes of UTF-8). It never "
        "extends past the end of the first user message. Make it longer than any system prompt (plus tools) "
        "that many conversations share: a window covering only that sends them all to one node.",
    )
    nodes: list[NodeConfig] = Field(min_length=1, description="The pool's inference servers.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"invalid pool name {v!r}: use lowercase letters, digits, '-' and '_'")
        return v

    @field_validator("session_header")
    @classmethod
    def _check_header(cls, v: str) -> str:
        if not _HEADER_RE.match(v):
            raise ValueError(f"invalid header name {v!r}")
        return v

    @field_validator("affinity")
    @classmethod
    def _check_affinity(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("affinity keys must not repeat")
        return v


class SimulatorConfig(_Strict):
    """Settings of the engine simulators that `kvgate up` starts for nodes with `simulate: true`."""

    model: str = Field("demo-model", description="Model name the simulators serve.")
    time_scale: float = Field(
        1.0, gt=0, description="Multiplier on every simulated duration (0.1 = ten times faster than real)."
    )
    prefill_s_per_token: float = Field(1e-4, ge=0, description="Prefill time per uncached prompt token (seconds).")
    decode_s_per_token: float = Field(0.02, ge=0, description="Decode time per output token (seconds).")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences running at once (vLLM --max-num-seqs).")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block (vLLM --block-size).")
    num_gpu_blocks: int = Field(65536, ge=16, description="KV-cache capacity per engine (blocks).")
    stream_interval: int = Field(
        1, ge=1, description="Tokens per streamed chunk (vLLM --stream-interval)."
    )


class Policy(_Strict):
    """A whole routing policy file."""

    version: Literal[1] = Field(1, description="Policy schema version.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    pools: list[PoolConfig] = Field(min_length=1, description="Pools of nodes; each model belongs to one pool.")
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)

    def nodes(self) -> list[NodeConfig]:
        """All nodes of all pools, in file order."""
        return [node for pool in self.pools for node in pool.nodes]

    def pool_of_node(self, node_id: str) -> PoolConfig:
        """The pool a node belongs to. Raises KeyError for an unknown id."""
        for pool in self.pools:
            if any(n.id == node_id for n in pool.nodes):
                return pool
        raise KeyError(node_id)

    def with_balancer(self, balancer: Balancer) -> "Policy":
        """A copy with every pool's balancer replaced (used by the trace replay)."""
        return self.model_copy(
            update={"pools": [p.model_copy(update={"balancer": balancer}) for p in self.pools]}
        )
