-- The contract between the data path and the control plane: every Redis key the gateway
-- writes, the request-log entry's fields, the gateway's metric names. PURE.
-- Mirrored by control/kvgate/keys.py; tests/unit/test_keys_contract.py compares the two.
local format = string.format
local floor = math.floor

local _M = {}

-- Redis key prefixes (the Python side owns everything under CONTROL_PREFIX)
_M.RESP_PREFIX = "kvgate:resp:"       -- response cache: kvgate:resp:v<N>:<scope>:<sha256 hex>
_M.LOG_STREAM = "kvgate:log"          -- request log (XADD, MAXLEN ~ LOG_MAXLEN)
_M.LOG_MAXLEN = 100000
_M.HOT_PREFIX = "kvgate:hot:"         -- hot prefixes: kvgate:hot:<pool>:<minute> (ZINCRBY fp)
_M.PREFIX_TEXT_PREFIX = "kvgate:prefix:" -- warm-up prefix documents: kvgate:prefix:<pool>:<fp>
_M.CONTROL_PREFIX = "kvgate:control:" -- the control plane's state (nodes, events, versions)
-- engines' last reported load, written by the control plane, read by the gateway's timer
-- (kvgate.node_load): a hash per pool, field = node id, value = NODE_LOAD_FIELDS in order,
-- space-separated, "-" for unknown: "<received_at> <interval_s> <waiting> <running> <kv_use>"
_M.NODE_LOAD_PREFIX = "kvgate:load:"
-- API keys (written by the control plane, read by kvgate.tenant): a hash per key under
-- APIKEY_PREFIX .. sha256 hex of the secret {id, tenant, name, created, revoked "0"|"1",
-- last_used}; the gateway only reads it and sets last_used
_M.APIKEY_PREFIX = "kvgate:apikey:"
_M.APIKEY_INDEX = "kvgate:apikeys" -- hash: key id -> sha256 hex (the control plane's listing)
-- tenants' limits (kvgate.limits): token buckets kvgate:rl:<tenant>:<rpm|tpm>, per session
-- kvgate:rl:<tenant>:s:<16 hex>:rpm, per key kvgate:rl:<tenant>:k:<key id>:<rpm|tpm>, the
-- concurrency set kvgate:rl:<tenant>:concurrency; each with a TTL of at most one window
_M.RATELIMIT_PREFIX = "kvgate:rl:"
-- single flight (kvgate.flight): kvgate:flight:<exact-cache key>, SET NX PX <wait bound> by the
-- first miss of a key, deleted with its stored entry
_M.FLIGHT_PREFIX = "kvgate:flight:"
-- cache tags (kvgate.semantic, X-Kvgate-Cache-Tags): a set kvgate:tag:<tag> of exact-cache keys,
-- its TTL the entries'; read and deleted by `kvgate cache invalidate --tag` (control/semcache.py)
_M.TAG_PREFIX = "kvgate:tag:"
-- in-flight prefill per gateway (kvgate.gwload): a hash kvgate:gwload:<gateway id>, field =
-- "<pool>\t<node>" or "<pool>\t" (the pool's total), value = tokens; replaced every gateway.load_sync_s
-- (50 ms) by the gateway's worker 0, TTL 4 rounds; every gateway sums the other members' hashes
_M.GWLOAD_PREFIX = "kvgate:gwload:"
_M.NODE_LOAD_FIELDS = { "received_at", "interval_s", "waiting", "running", "kv_use" }

--- node_load(pool) -> "kvgate:load:<pool>"
function _M.node_load(pool)
    return _M.NODE_LOAD_PREFIX .. pool
end

--- apikey(digest) -> "kvgate:apikey:<sha256 hex of the secret>"
function _M.apikey(digest)
    return _M.APIKEY_PREFIX .. digest
end

--- resp(version, scope, digest) -> "kvgate:resp:v<N>:<scope>:<digest>" (scope already escaped)
function _M.resp(version, scope, digest)
    return _M.RESP_PREFIX .. "v" .. version .. ":" .. scope .. ":" .. digest
end

--- hot(pool, ts) -> "kvgate:hot:<pool>:<minute>" (minute = floor(ts / 60))
function _M.hot(pool, ts)
    return _M.HOT_PREFIX .. pool .. ":" .. format("%d", floor(ts / 60))
end

--- prefix_text(pool, fp) -> "kvgate:prefix:<pool>:<fp>"
function _M.prefix_text(pool, fp)
    return _M.PREFIX_TEXT_PREFIX .. pool .. ":" .. fp
end

-- The request-log entry's fields, in XADD order (every entry has all of them; "" = none):
--   ts      request start, epoch seconds with ms ("%.3f")
--   pool    pool name;  node  the node that answered ("cache" for a hit, "" none)
--   status  HTTP status sent;  cache  HIT | MISS | BYPASS
--   kind    route-key kind (session | user | prefix | fallback)
--   fp      prefix fingerprint (sha256 hex of the window; "" without a prompt)
--   key     first 16 hex digits of sha256(route key);  ms  request time in ms
--   point   crc32 of the route key (its place on the ring; "" without a key)
--   tries   nodes tried (0 = none, 2 = a failover)
--   home    the key's home node on the ring (kctx.balancer.home; "" = not balanced)
--   spill   why a bounded balancer sent the key past its home: "bound" (the home over its
--           load bound) | "queue" (the home's engine queue over saturated_queue) | ""
--   tenant  the tenant's id (kctx.tenant.id; "" with gateway.auth off)
-- The usage record (issue 13, kvgate.usage; integers as decimal strings, "" = unknown):
--   key_id  the API key's id ("" without a key);  model  the request's model
--   prompt, cached, completion  the answer's usage.prompt_tokens, its
--           prompt_tokens_details.cached_tokens (0 without details) and completion_tokens;
--           a cache HIT: the cached answer's prompt and completion (tokens avoided), cached 0
--   ttft    ms from the request's start to the engine's first body byte ("" none, a hit)
--   batch   the Batch API's batch id (issue 14; "" otherwise): from a verified X-Kvgate-Batch only
--   blocks  the chain of block hashes of the canonical prompt (kvgate.prefix_index.chain:
--           the pool's chunk_chars, its name as seed), 16 hex digits per full chunk, at most
--           usage.log_blocks; "" none
--   cost    n$ (nano-dollars) the request cost at the pool's prices (HIT 0; "" without
--           prices or usage);  saved_cache  a HIT's full price, else 0;  saved_prefix
--           cached × (input - cached price);  saved_batch  a batch request's discount, else 0
_M.LOG_FIELDS = { "ts", "pool", "node", "status", "cache", "kind", "fp", "key", "ms", "point", "tries", "home",
                  "spill", "tenant", "key_id", "model", "prompt", "cached", "completion", "ttft", "batch",
                  "blocks", "cost", "saved_cache", "saved_prefix", "saved_batch" }

-- The gateway's metric families (/metrics), by short name
_M.METRICS = {
    requests = "kvgate_requests_total",
    upstream_response = "kvgate_upstream_response_seconds",
    failovers = "kvgate_failovers_total",
    cache_errors = "kvgate_cache_errors_total",
    cache_stores = "kvgate_cache_stores_total",
    cache_store_skipped = "kvgate_cache_store_skipped_total",
    route_key_fallback = "kvgate_route_key_fallback_total",
    route_key_shared_prefix = "kvgate_route_key_shared_prefix_total",
    route_key_sentinel = "kvgate_route_key_sentinel_total",
    bad_requests = "kvgate_bad_requests_total",
    upstream_inflight = "kvgate_upstream_inflight",
    upstream_load = "kvgate_upstream_load_tokens",
    upstream_load_remote = "kvgate_upstream_load_tokens_remote",
    redis_master_changes = "kvgate_redis_master_changes_total",
    route_spill = "kvgate_route_spill_total",
    upstream_failover = "kvgate_upstream_failover_total",
    upstream_breaker = "kvgate_upstream_breaker_state",
    stream_errors = "kvgate_stream_errors_total",
    stream_cuts = "kvgate_stream_cuts_total",
    request_log_written = "kvgate_request_log_written_total",
    request_log_dropped = "kvgate_request_log_dropped_total",
    prefix_captures = "kvgate_prefix_captures_total",
    prefix_capture_skipped = "kvgate_prefix_capture_skipped_total",
    config_loads = "kvgate_gateway_config_loads",
    config_version = "kvgate_config_version",
    config_pushes = "kvgate_config_pushes_total",
    ratelimited = "kvgate_ratelimited_total",
    ratelimit_redis_errors = "kvgate_ratelimit_redis_errors_total",
    admission_waiting = "kvgate_admission_waiting",
    admission_inflight = "kvgate_admission_inflight",
    admission_wait = "kvgate_admission_wait_seconds",
    admission_rejected = "kvgate_admission_rejected_total",
    tokens = "kvgate_tokens_total",
    tokens_avoided = "kvgate_tokens_avoided_total",
    cost_usd = "kvgate_cost_usd_total",
    saved_usd = "kvgate_saved_usd_total",
}

return _M
