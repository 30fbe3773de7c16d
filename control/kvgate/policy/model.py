"""The routing policy: the operator's interface to kvgate, as a typed, validated model.

Every field carries a description; ``docs/policy-reference.md`` documents the same fields.
The model is strict: unknown keys are errors (a typo must not silently fall back
to a default), and cross-field rules (unique node ids, one pool per model) are
checked after the fields themselves.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .batch import BatchConfig
from .semantic import PoolSemanticConfig, SemanticServiceConfig
from .pricing import PricesConfig, UsageConfig

AffinityKey = Literal["session", "user", "prefix"]
AuthMode = Literal["off", "optional", "required"]
Balancer = Literal["chash", "round_robin", "least_conn", "chash_bounded", "prefix"]

GRACE_OVER_READ_TIMEOUT_S = 300
"""Default reload grace beyond the read timeout (gateway.worker_shutdown_timeout_s when not set)."""

_HEADER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


def _loopback_listen(value: str) -> str:
    """A listen address only this machine can reach: ``127.0.0.0/8:PORT``, ``[::1]:PORT`` or
    ``unix:/absolute/path`` (the push endpoint changes routing: it must never face a network)."""
    if value.startswith("unix:"):
        path = value[5:]
        if not path.startswith("/") or len(path) < 2 or any(c.isspace() or c in ";{}" for c in path):
            raise ValueError(f"expected unix:/absolute/path, got {value!r}")
        return value
    _host_port(value)
    host = value.rpartition(":")[0]
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host != bare and ":" not in bare or host == bare and ":" in bare:
        raise ValueError(f"expected 127.0.0.1:PORT, [::1]:PORT or unix:/path, got {value!r}")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address: use 127.0.0.1:PORT, [::1]:PORT or unix:/path "
                         "(a host name could resolve off this machine)") from None
    if not ip.is_loopback:
        raise ValueError(f"{host} is not a loopback address: the internal listener takes runtime pushes and must "
                         "stay on this machine (127.0.0.1:PORT, [::1]:PORT or unix:/path)")
    return value


TlsProtocol = Literal["TLSv1.2", "TLSv1.3"]


def is_loopback_listen(listen: str) -> bool:
    """Whether a ``HOST:PORT`` listen address is reachable from this machine only (a loopback IP
    or ``localhost``; a wildcard or any other host faces a network)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TlsConfig(_Strict):
    """TLS on a listener (docs/tls.md): PEM files, read when the policy is applied and again
    whenever their content changes (a renewed certificate is loaded by the confirmed reload)."""

    certificate: str = Field(
        ..., min_length=1, description="The PEM certificate chain (the server's certificate first, then its "
        "intermediates): an absolute path, or one relative to the policy file's folder (as `static_answers`). "
        "Read by nginx's master (root) and by `kvgate control`; a renewal in place (same path, new content) is "
        "loaded within a reconcile tick or two.",
    )
    key: str = Field(..., min_length=1, description="The PEM private key of `certificate` (unencrypted; mode 0600 "
                     "is fine: only the master and the control plane read it); absolute, or relative to the policy "
                     "file's folder.")
    protocols: list[TlsProtocol] = Field(
        ["TLSv1.2", "TLSv1.3"], min_length=1, description="TLS versions offered (nginx `ssl_protocols`).",
    )

    @field_validator("certificate", "key")
    @classmethod
    def _check_path(cls, v: str) -> str:
        # a relative path is made absolute against the policy file's folder before anything reads
        # it (kvgate.policy.tls.resolve_tls): nginx would read it from its own prefix
        if any(c.isspace() or c in ";{}\"'" for c in v):
            raise ValueError(f"{v!r}: white space, quotes, ';', '{{' and '}}' are not allowed in the path")
        return v


class GatewayConfig(_Strict):
    """The nginx data path."""

    listen: str = Field("127.0.0.1:8080", description="HOST:PORT nginx listens on for client traffic.")
    tls: TlsConfig | None = Field(
        None, description="Serve HTTPS on `listen` with this certificate and key (HTTP/1.1; the internal "
        "listener stays plain, on loopback). null: plain HTTP. See docs/tls.md.",
    )
    internal_listen: str = Field(
        "127.0.0.1:9080",
        description="Loopback-only address of the gateway's internal server, where the control plane pushes the "
        "runtime (weights, node states, balancer per pool, cache namespace: `POST /kvgate/config`, no reload) and "
        "reads the one in force (`GET /kvgate/config`). `127.0.0.x:PORT`, `[::1]:PORT` or `unix:/absolute/path`; "
        "nginx also refuses any peer that is not loopback, and every call needs the secret in "
        "`<prefix>/conf/push.secret`. Give each gateway on one machine its own port.",
    )
    worker_processes: int = Field(2, ge=1, le=64, description="nginx worker processes.")
    load_sync_s: float = Field(
        0.05, ge=0.01, le=5,
        description="With several `gateways:` members, how often each gateway publishes its in-flight prefill per "
        "node to Redis and reads the others' (seconds; one small script call per round). The load bound of "
        "chash_bounded/prefix and the admission slots add the other gateways' figures, at most about two rounds "
        "old (docs/scale-out.md). Unused with one gateway.",
    )
    worker_connections: int = Field(4096, ge=64, description="nginx worker_connections.")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="Largest accepted request body in bytes; larger → 413. Bodies are kept in memory "
        "up to this size so the route key and cache key can be computed in the access phase.",
    )
    debug_headers: bool = Field(
        False, description="Add X-Kvgate-Node and X-Kvgate-Route-Key-Kind to responses."
    )
    auth: AuthMode = Field(
        "off", description="Client API keys (`kvgate keys create`): `off` = an open gateway (no tenants); "
        "`optional` = a request without a key is the tenant `default`'s, one with a key must carry a valid key; "
        "`required` = every request needs a valid key (401 `invalid_api_key` otherwise).",
    )
    public_metrics: bool | None = Field(
        None, description="Also serve `/metrics` on the client listener (`listen`). null (the default): only with "
        "`auth: off`. With tenants the metrics name every tenant and its tokens and cost, which no tenant may "
        "see: scrape the internal listener (`internal_listen`, loopback only) instead, as the control plane does.",
    )
    auth_cache_ttl_s: float = Field(
        5.0, gt=0, le=300, description="How long each nginx worker trusts what Redis said about an API key "
        "(seconds): a revocation or a new key takes effect within this time.",
    )
    auth_stale_s: float = Field(
        300.0, ge=0, le=86400, description="While Redis cannot be reached, a key a worker saw valid stays valid "
        "this long after its last check (seconds); keys never seen get 503 `auth_unavailable`.",
    )
    connect_timeout_s: float = Field(1.0, gt=0, description="Upstream connect timeout (seconds).")
    read_timeout_s: float = Field(600.0, gt=0, description="Upstream read timeout between two reads (seconds).")
    fallback_route_key: str = Field(
        "kvgate:fallback", min_length=1, max_length=128,
        description="Route key used when a request has none of the pool's affinity keys; counted in "
        "kvgate_requests_total{route_key_kind=\"fallback\"}.",
    )
    client_keepalive_timeout_s: int = Field(
        75, ge=0, le=3600,
        description="How long an idle client connection stays open (nginx `keepalive_timeout`). After a reload, "
        "old workers close their idle connections; a client that sends on one at that instant sees a connection "
        "reset (the OpenAI SDKs retry it). 0 closes every connection after its response: no reset, one TCP "
        "handshake per request.",
    )
    client_body_timeout_s: float = Field(
        30.0, ge=0.01, le=3600,
        description="How long the gateway waits for the next bytes of a request body (seconds; nginx "
        "`client_body_timeout`). A body that stops arriving is answered 408 `request_timeout` in OpenAI's format "
        "and the connection is closed. (A chunked body is read by nginx itself, which closes the connection "
        "without an answer.)",
    )
    client_body_deadline_s: float = Field(
        120.0, ge=0.01, le=3600,
        description="Longest a request may take to arrive, headers and body, from its first byte (seconds). A body "
        "that trickles in, never idle for `client_body_timeout_s`, is cut here with the same 408. At least "
        "`client_body_timeout_s`; size it for `max_body_bytes` over the slowest client link you serve. Chunked "
        "bodies have only the idle timeout.",
    )
    worker_shutdown_timeout_s: int = Field(
        900, ge=1, validate_default=True,
        description="How long old workers may finish streams after a reload (seconds, nginx "
        "`worker_shutdown_timeout`). Must be at least `read_timeout_s` + 1: a stream still sending "
        "`worker_shutdown_timeout_s - read_timeout_s - 1` s after the reload is ended with an error event "
        "(counted in `kvgate_stream_cuts_total`), and one silent then ends by the read timeout, so no stream "
        "is ever cut without a word. Default: `read_timeout_s` + 300 (900 with the default read timeout), so "
        "streams may run 299 s past a reload.",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _host_port(v)

    @field_validator("internal_listen")
    @classmethod
    def _check_internal_listen(cls, v: str) -> str:
        return _loopback_listen(v)

    @field_validator("client_body_deadline_s")
    @classmethod
    def _check_body_deadline(cls, v: float, info: ValidationInfo) -> float:
        # client_body_timeout_s is declared earlier: validated (or missing, when invalid) here
        idle = info.data.get("client_body_timeout_s")
        if idle is not None and v < idle:
            raise ValueError(f"must be at least client_body_timeout_s = {idle:g} s (the idle timeout would never "
                             "apply)")
        return v

    @field_validator("auth", mode="before")
    @classmethod
    def _auth_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `no`, `false`) as false
        return "off" if v is False else v

    @model_validator(mode="before")
    @classmethod
    def _default_grace(cls, data: Any) -> Any:
        # the grace follows the read timeout unless set: a policy that only raises read_timeout_s
        # must not end every stream at the first reload (cut_streams_after_s would be 0)
        if isinstance(data, dict) and "worker_shutdown_timeout_s" not in data:
            rt = data.get("read_timeout_s")
            if isinstance(rt, (int, float)) and not isinstance(rt, bool) and 0 < rt < 1e9:
                data = {**data, "worker_shutdown_timeout_s": math.ceil(rt) + GRACE_OVER_READ_TIMEOUT_S}
        return data

    @field_validator("worker_shutdown_timeout_s")
    @classmethod
    def _check_grace(cls, v: int, info: ValidationInfo) -> int:
        # read_timeout_s is declared earlier, so it is validated (or missing, when invalid) here
        read_timeout = info.data.get("read_timeout_s")
        if read_timeout is not None and v < read_timeout + 1:
            raise ValueError(
                f"must be at least read_timeout_s + 1 = {read_timeout + 1:g} s: a stream silent when the reload "
                "grace ends would otherwise be cut without an error event (lower read_timeout_s or raise this)"
            )
        return v


class RedisConfig(_Strict):
    """The Redis instance for the response cache (and, later, state and rate limits)."""

    url: str = Field(
        "redis://127.0.0.1:6390/0",
        description="redis://HOST:PORT/DB of the Redis to use. With `sentinels` set, clients connect to the master "
        "Sentinel names instead and only /DB is used from here (and, with `managed`, HOST:PORT is where `kvgate up` "
        "starts the first master; docs/sentinel.md).")
    timeout_ms: int = Field(200, ge=1, le=10_000, description="Connect/read timeout the data path allows Redis (ms).")
    sentinels: list[str] = Field(
        default_factory=list, max_length=16,
        description="HOST:PORT of each Redis Sentinel watching the master (several: any one that answers is "
        "enough to find it). Empty: a plain Redis at `url`. Set: the gateway and the Python side ask Sentinel for "
        "the current master of `master_name` and follow a failover (docs/sentinel.md); with `managed`, `kvgate up` "
        "starts the master at `url`'s HOST:PORT, one replica at PORT+1 and one redis-sentinel per address here.")
    master_name: str = Field(
        "kvgate", pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="The name the sentinels monitor the master under (`sentinel monitor <name> ...`); letters, "
        "digits, `.`, `_`, `-`. Used only with `sentinels`.")
    sentinel_timeout_ms: int = Field(
        250, ge=1, le=10_000,
        description="Connect/read timeout for one question to one sentinel (ms), on the data path and the Python "
        "side. Used only with `sentinels`.")
    pool_size: int = Field(64, ge=1, description="Keepalive connections per nginx worker.")
    managed: bool = Field(
        True, description="`kvgate up` starts a private redis-server on this address when true."
    )
    persist: bool = Field(
        False, description="The private redis-server (`managed`) keeps its data in the run dir (append-only "
        "file, fsync every second), so `kvgate down` and `up` keep node states, policy versions, API keys, "
        "usage rollups and Batch API batches. false: it keeps nothing on disk and every `up` starts afresh. "
        "An external Redis (`managed: false`) persists as it is configured.",
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

    @field_validator("sentinels")
    @classmethod
    def _check_sentinels(cls, v: list[str]) -> list[str]:
        for item in v:
            _host_port(item)
        if len(set(v)) != len(v):
            raise ValueError("each sentinel address once")
        return v

    @property
    def client_url(self) -> str:
        """The one connection string for Python clients (:func:`kvgate.redisconn.from_url`): ``url``
        without sentinels, else ``redis+sentinel://H1:P1,H2:P2/<master_name>/<db>``."""
        if not self.sentinels:
            return self.url
        return f"redis+sentinel://{','.join(self.sentinels)}/{self.master_name}/{self.db}"

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
    single_flight_wait_s: float = Field(
        10.0, ge=0, le=600,
        description="Single flight: identical cacheable requests (same exact key) that miss while the first is "
        "still computed wait up to this long (seconds) for its answer instead of each going to an engine, across "
        "workers and gateways (a lock key in Redis); past it they go to an engine themselves. 0: off.")
    credential_headers: list[str] = Field(
        default_factory=lambda: ["Authorization", "api-key", "x-api-key"],
        min_length=1, max_length=16,
        description="Request headers that carry a caller's credential (names are case-insensitive; 1-16). "
        "Every one of them that a request sends (its name and every value, in this order) is hashed into the "
        "cache key, so callers with different credentials, or with none, never share an entry and a hit never "
        "skips the engine's own authentication (`vllm serve --api-key`); a request with none of them shares "
        "the anonymous scope. List every header the engine, or the proxy in front of the gateway, accepts a "
        "credential in: one left out lets its callers' answers reach anonymous callers. The credential itself "
        "is never stored or logged.",
    )

    @field_validator("credential_headers")
    @classmethod
    def _check_credential_headers(cls, v: list[str]) -> list[str]:
        seen: set[str] = set()
        for name in v:
            if not _HEADER_RE.match(name):
                raise ValueError(f"invalid header name {name!r}")
            if name.lower() in seen:
                raise ValueError(f"{name.lower()!r} is listed twice (header names are case-insensitive)")
            seen.add(name.lower())
        return v


class NodeConfig(_Strict):
    """One inference server (one vLLM/SGLang replica)."""

    id: str = Field(description="Stable node id: lowercase letters, digits, '-' and '_'.")
    url: str = Field(description="Base URL of the engine's OpenAI-compatible server, e.g. http://10.0.0.5:8000.")
    weight: int = Field(
        1, ge=1, le=10,
        description="Base weight: relative share of keys (1-10). The control plane multiplies it by the node's "
        "capacity, load factor and ramp step and renders nginx `weight=` in units of 1/100; nginx builds "
        "160 ring points per unit, so the cap keeps the ring small (at most 640k points per node).",
    )
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


class WarmupPrompt(_Strict):
    """A prompt sent to a node before it takes traffic, so its prefix cache already holds the blocks
    many requests share (a system prompt, tool definitions, few-shot examples)."""

    name: str = Field(description="Label shown in events and warm-up results.")
    messages: list[dict[str, Any]] = Field(
        min_length=1,
        description="OpenAI chat messages (`role`, `content`), sent as `/v1/chat/completions` with "
        "`max_tokens: 1`. Put the shared part first: only a prompt *prefix* is cached.",
    )
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI tool definitions sent with the prompt.")

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
                raise ValueError(f"messages[{i}].role must be system, user, assistant, tool or developer")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        return v


class WarmupConfig(_Strict):
    """Warm-up of a node's prefix cache before it takes traffic (docs/control-plane.md, Warm-up)."""

    prompts: list[WarmupPrompt] = Field(default_factory=list, description="The pool's common prefixes, sent first.")
    hot_prefixes: int = Field(
        16, ge=0, le=1000,
        description="Also send the prompts of this many hottest prefix fingerprints of the pool from the request "
        "log (only those whose text was captured, see `capture_prefix_text`).",
    )
    capture_prefix_text: bool = Field(
        False,
        description="Opt-in: the gateway stores the prompt prefix (messages up to the first user message) of "
        "requests in Redis under their fingerprint, for warm-up. Prompt text is sensitive: off by default.",
    )
    capture_ttl_s: int = Field(3600, ge=60, description="Lifetime of a captured prefix text in Redis (seconds).")
    capture_max_bytes: int = Field(65536, ge=256, description="Prefixes larger than this are not captured (bytes).")
    hot_window_s: int = Field(3600, ge=60, description="How far back the request log counts a fingerprint's heat (seconds).")
    concurrency: int = Field(4, ge=1, le=64, description="Warm-up requests in flight at once per node.")
    timeout_s: float = Field(120.0, gt=0, description="Whole warm-up budget per node (seconds); the rest is skipped.")


class OverloadConfig(_Strict):
    """Overload degrade: a pool whose engines queue switches to `least_conn` until the queues drain."""

    enabled: bool = Field(True, description="Switch the pool to `least_conn` under sustained queueing.")
    high_queue: float = Field(
        32.0, gt=0, description="Mean waiting requests per node (vLLM `num_requests_waiting`) that counts as overload."
    )
    low_queue: float = Field(4.0, ge=0, description="Mean waiting requests per node below which the pool returns to its balancer.")
    for_s: float = Field(10.0, ge=0, description="How long the mean must stay above `high_queue` (or below `low_queue`) before a switch (seconds).")

    @model_validator(mode="after")
    def _check_marks(self) -> "OverloadConfig":
        if self.low_queue >= self.high_queue:
            raise ValueError("low_queue must be below high_queue (hysteresis)")
        return self


class PrefixIndexConfig(_Strict):
    """The `prefix` balancer's approximate prefix index (lua/kvgate/prefix_index.lua, docs/gateway.md)."""

    chunk_chars: int = Field(
        2048, ge=64, le=65536,
        description="Bytes of the canonical prompt per chunk; each chunk's hash covers the whole prompt before it "
        "(vLLM's block hashes). A multiple of 8. Smaller: finer matches, more shared-dict entries and reads per "
        "request.",
    )
    kv_capacity_tokens: int = Field(
        1_048_576, ge=1,
        description="KV-cache capacity of one node, in tokens (vLLM `num_gpu_blocks` × `block_size`, "
        "`vllm:cache_config_info`). The gateway does not receive the agents' figure, so it is set here: the index "
        "takes a chunk as evicted once the node was given this much newer prefix (its LRU).",
    )
    chars_per_token: float = Field(
        4.0, gt=0, le=64,
        description="Prompt bytes per token, to turn `kv_capacity_tokens` into bytes of prompt (about 4 for "
        "English text and BPE tokenisers).",
    )
    ttl_s: int = Field(3600, ge=1, description="Entries older than this are forgotten (a restarted engine's, a removed node's).")
    max_prompt_chars: int = Field(
        1_048_576, ge=64,
        description="The index covers at most this many bytes of a prompt (longer prompts match on that much); "
        "at most 8192 chunks.",
    )

    @model_validator(mode="after")
    def _check_chunks(self) -> "PrefixIndexConfig":
        if self.chunk_chars % 8:
            raise ValueError("chunk_chars must be a multiple of 8")
        if self.max_prompt_chars // self.chunk_chars > 8192:
            raise ValueError("max_prompt_chars / chunk_chars must be at most 8192 chunks")
        return self


class FailoverConfig(_Strict):
    """Failover, the nodes' circuit breakers and requests without a route key (lua/kvgate/breaker.lua,
    lua/kvgate/score.lua, docs/gateway.md "Failover and circuit breakers")."""

    breaker_failures: int = Field(
        1, ge=1, le=1000,
        description="Failed tries in a row (connection error, timeout, 502/503 passed on, or an answer with a "
        "status in `failure_statuses`; never a client abort) that open a node's breaker: the node is skipped by "
        "every worker. 1 (the default) is nginx's `max_fails=1`.",
    )
    breaker_open_s: float = Field(
        10.0, gt=0, le=3600,
        description="How long an opened breaker skips its node (seconds; nginx's `fail_timeout`). Then one trial "
        "request (half-open): its answer closes the breaker, its failure opens it again for twice as long.",
    )
    breaker_open_max_s: float = Field(
        60.0, gt=0, le=86400,
        description="The longest open time of the doubling (the exponential backoff of the trials to a node that "
        "keeps failing), seconds; at least `breaker_open_s`.",
    )
    failure_statuses: list[int] = Field(
        default_factory=lambda: [502, 503, 504],
        description="Statuses of a node's answer that count as a failure of the node (each 500-599; 500 is the default left out: an engine's 500 is an answer, judged by the passive health check). Tries nginx "
        "passes on to another node (502, 503, errors, timeouts) always count.",
    )
    keyless: Literal["p2c", "round_robin"] = Field(
        "p2c",
        description="Requests without a route key under `chash`: `p2c` (the default), the better of two nodes "
        "drawn at random by weight, by a load score (the engine's reported queue, else the gateway's requests in "
        "flight; the node's recent time to first byte; its KV-cache use); `round_robin`: smooth weighted round "
        "robin.",
    )
    latency_alpha: float = Field(
        0.3, gt=0, le=1,
        description="Weight of each new sample in the per-node average of the time to first byte "
        "(an exponentially weighted moving average).",
    )
    kv_weight: float = Field(
        1.0, ge=0, le=100,
        description="How much a node's KV-cache use (0..1) raises its load score: score × (1 + kv_weight × use).",
    )

    @field_validator("failure_statuses")
    @classmethod
    def _check_statuses(cls, v: list[int]) -> list[int]:
        bad = [s for s in v if not 500 <= s <= 599]
        if bad:
            raise ValueError(f"failure_statuses must be 5xx statuses, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError("failure_statuses must not repeat")
        return v

    @model_validator(mode="after")
    def _check_open(self) -> "FailoverConfig":
        if self.breaker_open_max_s < self.breaker_open_s:
            raise ValueError("breaker_open_max_s must be at least breaker_open_s")
        return self


class AdmissionConfig(_Strict):
    """The pool's admission queue at the gateway (docs/tenants.md, Admission queue): while every
    serving node has `node_capacity` requests in flight (counted by the gateway, all workers, and with
    several `gateways:` across all of them through Redis every `gateway.load_sync_s`), a request waits here instead of
    piling into the engines' queues."""

    node_capacity: int = Field(
        ge=1, strict=True, description="Requests in flight per serving node before requests queue "
        "(e.g. the engines' --max-num-seqs plus the queue they may hold).",
    )
    queue_length: int = Field(100, ge=0, strict=True, description="Requests that may wait per gateway; "
                              "beyond it 503 `overloaded` at once.")
    queue_timeout_s: float = Field(30.0, gt=0, le=3600, description="Longest wait in the queue (seconds); "
                                   "then 503 `overloaded` with Retry-After.")


class PoolConfig(_Strict):
    """A set of nodes serving the same models, with one balancer and one affinity-key order."""

    name: str = Field(description="Pool name (lowercase letters, digits, '-' and '_').")
    models: list[str] = Field(min_length=1, description="Model names (the request's `model`) served by this pool.")
    balancer: Balancer = Field(
        "chash_bounded",
        description="`chash_bounded` (the default): consistent hashing with bounded loads on chash's ring, "
        "\"sticky until saturated\": a key stays on its home node until that node's in-flight prefill work "
        "(estimated prompt tokens plus its engine's reported queue) is over `bound_factor` × its weighted share "
        "of the pool's, or its engine's queue is over `saturated_queue`, then walks the ring to the next node "
        "(counted in `kvgate_route_spill_total`); with no node over its bound, exactly chash's placement. "
        "`chash`: consistent hashing of the route key on a ketama ring built from node ids "
        "(kvgate's Lua balancer: a node keeps its keys when its address changes) with weights; "
        "`prefix`: the node holding the longest leading part of the prompt by the gateway's prefix index "
        "(`prefix_index`), among the nodes `chash_bounded` would let it stay on; ties and no match as "
        "`chash_bounded` (no `prefix_chars` window to tune); "
        "`round_robin` and `least_conn`: baselines.",
    )
    bound_factor: float = Field(
        1.25, gt=1, le=100,
        description="`chash_bounded`'s c: a node takes a key while its in-flight prefill work plus the request's "
        "is at most c × the pool's (plus the request's) × its share of the serving weights. Closer to 1 evens "
        "load out and spills more keys off their cache-warm homes; larger keeps more affinity. Must be > 1.",
    )
    bound_load: Literal["prefill_tokens", "requests"] = Field(
        "prefill_tokens",
        description="`chash_bounded`'s load: `prefill_tokens` (each request in flight counts its estimated prompt "
        "tokens, request body bytes ÷ 4; an engine's reported queue counts waiting × the mean request) or "
        "`requests` (each request in flight counts 1, the queue its waiting requests: the paper's balls).",
    )
    saturated_queue: int | None = Field(
        16, ge=0, le=1_000_000,
        description="`chash_bounded`: a node whose engine last reported more than this many waiting requests "
        "(vLLM `num_requests_waiting`, from its agent; reports older than 3 report intervals count as unknown, "
        "never as idle) is skipped by the keys whose home it is, as an over-bound node. null: never.",
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
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    overload: OverloadConfig = Field(default_factory=OverloadConfig)
    admission: AdmissionConfig | None = Field(
        None, description="The admission queue (omitted: none; requests go straight to the nodes).")
    prefix_index: PrefixIndexConfig = Field(default_factory=PrefixIndexConfig)
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    prices: PricesConfig | None = Field(
        None, description="What the pool's tokens cost (docs/costs.md); omitted: tokens are counted, money is not.")
    semantic: PoolSemanticConfig = Field(default_factory=PoolSemanticConfig)

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


class ControlConfig(_Strict):
    """The control plane (`kvgate control`) and its node agents."""

    listen: str = Field("127.0.0.1:9090", description="HOST:PORT of the admin API, `/metrics` and the admin page.")
    public_reads: bool = Field(
        False, description="Serve GET requests of the admin API without the admin token (mutations always need it)."
    )
    report_interval_s: float = Field(2.0, gt=0, le=300, description="How often each node agent reports (seconds).")
    tick_s: float = Field(1.0, gt=0, le=60, description="How often the control plane re-evaluates states and weights (seconds).")
    events_kept: int = Field(10000, ge=100, description="Events kept in Redis (oldest dropped first).")
    versions_kept: int = Field(100, ge=2, description="Applied policy versions kept for rollback.")
    gateway_sync_s: float = Field(
        1.0, gt=0, le=60, description="The sync interval of the gateway members beyond the first (`gateways:`, "
        "docs/scale-out.md): each `kvgate gateway` supervisor asks the control plane for its config at least this "
        "often (a change reaches it at once, through a long poll of this length) and reports its status; a "
        "member silent for 3 intervals is `lost`.",
    )
    gateway_sync_timeout_s: float = Field(
        15.0, ge=0, le=600, description="How long a policy apply (`kvgate apply`, `PUT /api/v1/policy`) waits for "
        "every live gateway member to run the new version before it answers with the laggards named (the policy "
        "is applied either way: a laggard follows when it catches up). 0: do not wait.",
    )
    admin_cookie_secure: bool = Field(
        False, description="Mark the admin page's session cookie `Secure` (sent over HTTPS only): set it when a "
        "TLS-terminating proxy serves the control plane. Off by default: the page is plain HTTP on loopback. "
        "With `tls` the cookie is `Secure` whatever this says."
    )
    tls: TlsConfig | None = Field(
        None, description="Serve the admin page, the API and `/metrics` over HTTPS with this certificate and key "
        "(`kvgate control` then runs cheroot instead of waitress; docs/tls.md). null: plain HTTP, which a "
        "`listen` beyond loopback only warns about unless `require_tls` is set.",
    )
    require_tls: bool = Field(
        False, description="Refuse a `listen` beyond loopback without `tls` (the admin token and the session "
        "cookie would cross the network in clear). Off by default: such a policy is applied with a warning at "
        "`kvgate control`'s start, as before.",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _host_port(v)

    @model_validator(mode="after")
    def _check_require_tls(self) -> "ControlConfig":
        if self.require_tls and self.tls is None and not is_loopback_listen(self.listen):
            raise ValueError(f"listen {self.listen} is beyond loopback and `tls` is not set (require_tls is on): "
                             "set control.tls, or listen on 127.0.0.1")
        return self


class PassiveHealthConfig(_Strict):
    """Passive health: a node whose answers at the gateway are mostly 5xx fails its health checks."""

    enabled: bool = Field(True, description="Judge serving nodes on their recent 5xx share at the gateway "
                          "(`kvgate_requests_total{node,status}`), besides probes and agent reports.")
    max_5xx_ratio: float = Field(
        0.5, gt=0, le=1, description="A serving node whose share of 5xx answers over the last `window_s` is above "
        "this fails the health check of that round (counted like a failed probe: `eject_after` in a row eject it).",
    )
    min_requests: int = Field(
        20, ge=1, description="Answers of the node within the window below which its share is not judged (too "
        "few to tell a failing node from one unlucky request).",
    )
    window_s: float = Field(
        30.0, gt=0, description="The window of answers judged (seconds). It starts again when the node is ejected "
        "and when it comes back: a returning node is judged on fresh traffic only.",
    )
    max_ejected_share: float = Field(
        0.5, gt=0, le=1, description="Passive health ejects a node only while at most this share of its pool's "
        "nodes (rounded down, at least 1) would be ejected (Envoy's `max_ejection_percent`): one client retrying "
        "a request that fails every engine follows its key from node to node, and must not empty the pool. A node "
        "whose probe or agent also fails is ejected regardless.",
    )


class HealthConfig(_Strict):
    """Ejection of failing nodes (agent reports, the control plane's own probe, the gateway's 5xx share)."""

    probe_interval_s: float = Field(2.0, gt=0, description="How often the control plane probes each engine's `/health` (seconds).")
    probe_timeout_s: float = Field(1.0, gt=0, description="Timeout of one probe (seconds).")
    eject_after: int = Field(3, ge=1, description="Consecutive failed checks before a node is ejected (N).")
    recover_after: int = Field(2, ge=1, description="Consecutive passed checks before an ejected node comes back (M).")
    missing_reports: int = Field(
        3, ge=1, description="A node whose agent has not reported for this many report intervals counts as failing (K)."
    )
    passive: PassiveHealthConfig = Field(default_factory=PassiveHealthConfig)


class WeightsConfig(_Strict):
    """Live weights: base weight × capacity × load factor, damped (docs/control-plane.md, Weights)."""

    dynamic: bool = Field(True, description="Follow capacity and load from the agents' reports; false keeps base weights.")
    queue_high: float = Field(
        16.0, gt=0, description="Waiting requests on a node at which its load factor reaches `min_factor`."
    )
    kv_high: float = Field(
        0.95, gt=0, le=1, description="KV-cache use (0-1) at which the load factor reaches `min_factor`; below 0.7 it costs nothing."
    )
    min_factor: float = Field(0.25, gt=0, le=1, description="Lowest load factor: a busy node keeps this share of its keys.")
    change_threshold: float = Field(
        0.2, ge=0, description="A computed weight is applied only when it differs from the applied one by more than "
        "this fraction: every weight change on a consistent-hash ring moves keys, and their cache.",
    )
    min_interval_s: float = Field(30.0, ge=0, description="Load-driven weight changes of a pool are applied at most this often (seconds).")


class RampConfig(_Strict):
    """How a warmed node's weight rises to its target."""

    steps: list[float] = Field(
        default_factory=lambda: [0.1, 0.25, 0.5, 1.0], min_length=1,
        description="Fractions of the target weight, in order; the last must be 1.",
    )
    step_interval_s: float = Field(10.0, ge=0, description="Time on each step before the next (seconds).")
    max_error_rate: float = Field(
        0.05, ge=0, le=1, description="The ramp holds while the node's share of 5xx answers at the gateway is above this."
    )
    max_queue: float = Field(16.0, ge=0, description="The ramp holds while the node has more waiting requests than this.")

    @field_validator("steps")
    @classmethod
    def _check_steps(cls, v: list[float]) -> list[float]:
        if any(not 0 < s <= 1 for s in v) or any(b <= a for a, b in zip(v, v[1:])) or v[-1] != 1:
            raise ValueError("steps must rise strictly within (0, 1] and end at 1")
        return v


class DrainConfig(_Strict):
    """Draining a node (`kvgate drain`)."""

    timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for a draining node's in-flight requests (streams included); "
        "after it the node is reported drained anyway, with the count it still had."
    )


PositiveInt = Annotated[int, Field(gt=0, strict=True)]
"""A limit: a whole number above 0 (``true``, ``"10"`` and ``1.5`` are refused, not coerced)."""


class KeyLimits(_Strict):
    """Limits of each API key of a tenant, on top of the tenant's own."""

    rpm: PositiveInt | None = Field(None, description="Requests per minute of each key.")
    tpm: PositiveInt | None = Field(None, description="Tokens per minute of each key (prompt + completion).")


class TenantLimits(_Strict):
    """A tenant's limits, shared by every gateway on the same Redis (token buckets that hold a
    minute's worth: a burst of the whole minute is allowed, then the rate). Omitted = unlimited."""

    rpm: PositiveInt | None = Field(None, description="Requests per minute.")
    tpm: PositiveInt | None = Field(
        None, description="Tokens per minute: the prompt estimate + `max_tokens` (or `limits.default_max_tokens`) "
        "are reserved at admission and settled to the answer's `usage`.",
    )
    concurrency: PositiveInt | None = Field(None, description="Requests in flight at once.")
    session_rpm: PositiveInt | None = Field(
        None, description="Requests per minute of each session (the route key's session id): a hot "
        "conversation is slowed down instead of taking its node.",
    )
    per_key: KeyLimits | None = Field(None, description="Limits of each API key of the tenant.")


class LimitsConfig(_Strict):
    """How the gateways enforce tenants' limits (docs/tenants.md, Limits)."""

    on_redis_error: Literal["allow", "deny"] = Field(
        "allow", description="Redis unreachable: `allow` admits under each gateway's own fallback limit "
        "(`fallback_factor` × the limit, counted in a shared dict), `deny` answers 429.",
    )
    fallback_factor: float = Field(
        1.0, gt=0, le=100, description="Each gateway's share of a limit while Redis is unreachable "
        "(1 = the whole limit per gateway).",
    )
    default_max_tokens: int = Field(
        1024, ge=1, strict=True, description="Completion tokens reserved for a request without `max_tokens` "
        "(settled to its `usage` when it ends).",
    )
    session_burst_s: float = Field(
        2.0, gt=0, le=60, description="A session's bucket holds this many seconds of its `session_rpm` (at least "
        "one request): a hot conversation is held to its rate within seconds, not after a minute's burst.",
    )
    slot_lease_s: float = Field(
        30.0, ge=2, le=3600, description="A concurrency slot is a lease of this many seconds that its gateway "
        "renews every third of it while the request runs: the slots of a gateway that died (or lost its "
        "releases to a Redis blip) free within this time.",
    )


class TenantConfig(_Strict):
    """A tenant: who a request is from (its API key's tenant), what it may use, whose cached
    answers it may receive (docs/tenants.md)."""

    id: str = Field(description="Tenant id (lowercase letters, digits, '-' and '_'); the id on API keys, "
                    "in the request log and in metric labels.")
    name: str = Field("", max_length=200, description="Display name (admin page).")
    models: list[str] | None = Field(
        None, description="Models (the request's `model`) this tenant may use; omitted = every model. "
        "Any other model answers 404 `model_not_found`, as an unknown one does.",
    )
    cache: Literal["private", "shared"] = Field(
        "private", description="`private`: the tenant's cached answers are its own; `shared`: shared with "
        "every tenant of the same `cache_group`.",
    )
    cache_group: str | None = Field(None, description="The group whose cache a `shared` tenant uses.")
    priority: Literal["interactive", "batch"] = Field(
        "interactive", description="The highest admission priority of the tenant's requests (`X-Kvgate-Priority` "
        "may lower it to batch; `batch` caps every request at batch: it waits while interactive ones do).",
    )
    limits: TenantLimits = Field(default_factory=TenantLimits)

    @field_validator("id", "cache_group")
    @classmethod
    def _check_id(cls, v: str | None) -> str | None:
        if v is not None and not _ID_RE.match(v):
            raise ValueError(f"invalid id {v!r}: use lowercase letters, digits, '-' and '_' (at most 63)")
        return v

    @model_validator(mode="after")
    def _check_cache(self) -> "TenantConfig":
        if self.cache == "shared" and not self.cache_group:
            raise ValueError("cache: shared needs a cache_group")
        if self.cache == "private" and self.cache_group:
            raise ValueError("cache_group is only for cache: shared")
        return self

    @property
    def cache_scope(self) -> str:
        """The response cache's scope of this tenant's entries: ``t.<id>`` or ``g.<group>``."""
        return f"g.{self.cache_group}" if self.cache == "shared" else f"t.{self.id}"


DEFAULT_TENANT = "default"
"""The tenant of a keyless request under ``gateway.auth: optional``."""

LOCAL_GATEWAY = "local"
"""The id of the one gateway member of a policy without ``gateways:``."""


class GatewayMember(_Strict):
    """One gateway instance (its own nginx) of a policy that lists several (docs/scale-out.md). Every
    other setting comes from `gateway:`."""

    id: str = Field(..., description="The member's id (lowercase letters, digits, `-`, `_`): its label on the "
                    "Fleet page, in `kvgate status` and `kvgate_control_gateway_up{gateway}`, and the `--id` of its "
                    "`kvgate gateway` supervisor.")
    listen: str = Field(..., description="HOST:PORT of this member's client listener. The first member is the "
                        "one the control plane drives itself: its `listen` is `gateway.listen` (filled in when "
                        "`gateway.listen` is not written).")
    internal_listen: str = Field(..., description="This member's loopback-only internal listener (runtime pushes, "
                                 "`/metrics`), on its own host: 127.0.0.1:PORT, [::1]:PORT or unix:/path.")

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError("gateway id must be lowercase letters, digits, '-' or '_' (max 63)")
        return v

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _host_port(v)

    @field_validator("internal_listen")
    @classmethod
    def _check_internal_listen(cls, v: str) -> str:
        return _loopback_listen(v)


class Policy(_Strict):
    """A whole routing policy file."""

    version: Literal[1] = Field(1, description="Policy schema version.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    pools: list[PoolConfig] = Field(min_length=1, description="Pools of nodes; each model belongs to one pool.")
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    ramp: RampConfig = Field(default_factory=RampConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    usage: UsageConfig = Field(default_factory=UsageConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    semantic_service: SemanticServiceConfig = Field(default_factory=SemanticServiceConfig)
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="Tenants (with `gateway.auth` optional or required); "
        "`optional` needs one with id `default`.",
    )
    gateways: list[GatewayMember] | None = Field(
        None, min_length=1, description="The gateway instances sharing this policy (docs/scale-out.md): ids and "
        "addresses unique, every other setting from `gateway:`. The first is driven by the control plane itself "
        "(`gateway.listen`/`internal_listen` are its addresses); each other runs `kvgate gateway --id ID` on its "
        "host. Absent: one member, id `local`, at `gateway.listen`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _first_member_listens(cls, data: Any) -> Any:
        """`gateway.listen`/`internal_listen` default to the first member's, so every part that reads
        `gateway.listen` (the control plane's own nginx, `kvgate up`, the batch worker) means that member."""
        if not isinstance(data, dict) or not isinstance(data.get("gateways"), list) or not data["gateways"]:
            return data
        first = data["gateways"][0]
        gw = data.get("gateway", {})
        if not isinstance(first, dict) or not isinstance(gw, dict):
            return data
        filled = dict(gw)
        for name, check in (("listen", _host_port), ("internal_listen", _loopback_listen)):
            if name not in filled and isinstance(first.get(name), str):
                try:
                    filled[name] = check(first[name])
                except ValueError:
                    pass  # reported once, at gateways[0]
        return {**data, "gateway": filled}

    def gateway_members(self) -> list[GatewayMember]:
        """The gateway members in policy order: ``gateways``, or one member :data:`LOCAL_GATEWAY` at
        ``gateway.listen``/``internal_listen``. The first is the control plane's own."""
        if self.gateways:
            return list(self.gateways)
        return [GatewayMember(id=LOCAL_GATEWAY, listen=self.gateway.listen, internal_listen=self.gateway.internal_listen)]

    def member_policy(self, member_id: str) -> "Policy":
        """A copy for one member: ``gateway.listen``/``internal_listen`` replaced by the member's (what
        :func:`kvgate.render.render` renders for that member's nginx). Raises KeyError for an unknown id."""
        for m in self.gateway_members():
            if m.id == member_id:
                if m.listen == self.gateway.listen and m.internal_listen == self.gateway.internal_listen:
                    return self
                gw = self.gateway.model_copy(update={"listen": m.listen, "internal_listen": m.internal_listen})
                return self.model_copy(update={"gateway": gw})
        raise KeyError(member_id)

    def member_of_listen(self, listen: str) -> GatewayMember:
        """The member whose client listener is ``listen`` (the first when none is: a policy rendered for
        an address that is no member's, e.g. a benchmark's own port)."""
        members = self.gateway_members()
        return next((m for m in members if m.listen == listen), members[0])

    @property
    def public_metrics(self) -> bool:
        """Whether the client listener serves ``/metrics`` (``gateway.public_metrics``, null = ``auth: off``)."""
        pm = self.gateway.public_metrics
        return self.gateway.auth == "off" if pm is None else pm

    def node(self, node_id: str) -> NodeConfig:
        """The node with this id. Raises KeyError for an unknown id."""
        for node in self.nodes():
            if node.id == node_id:
                return node
        raise KeyError(node_id)

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
