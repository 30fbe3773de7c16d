-- The exact response cache: lookup in access, capture in body_filter, write from
-- a timer started in the log phase (cosockets are not allowed in log/filters).
--
-- Failure policy: Redis errors fail open — the request is proxied as BYPASS, the
-- error is counted in kvgate_cache_errors_total{op} and logged at most once per
-- WARN_INTERVAL_S across workers. After an error, Redis is skipped for
-- kvgate.redis.BREAKER_S so an unreachable Redis costs one timeout per second, not one
-- per request.
-- Entries hold the final completion JSON (rebuilt from the chunks for streams),
-- so a hit is replayed as SSE to a streaming client and as JSON otherwise. Only whole
-- answers are stored (sse.finished), and every entry is scoped to the caller's
-- credential (cache_key.credential of cfg.cache.credential_headers).
local cjson = require "cjson.safe"
local json = require "kvgate.json"
local cache_key = require "kvgate.cache_key"
local sse = require "kvgate.sse"
local kredis = require "kvgate.redis"
local metrics = require "kvgate.metrics"
local config = require "kvgate.config"

local ngx = ngx
local type = type
local concat = table.concat
local find = string.find

local _M = {}

local STATE = "kvgate_state"
local WARN_INTERVAL_S = 10
-- policy.cache.credential_headers' default (a kvgate.json rendered without the list)
local DEFAULT_CREDENTIAL_HEADERS = { "authorization", "api-key", "x-api-key" }

local function cache_error(op, err)
    metrics.incr("kvgate_cache_errors_total", { op = op })
    local state = ngx.shared[STATE]
    if op == "get" or op == "set" then
        -- the breaker in kvgate.redis: Redis is skipped for BREAKER_S
        kredis.trip()
    end
    if state and state:add("warned:" .. op, true, WARN_INTERVAL_S) then
        ngx.log(ngx.WARN, "kvgate cache ", op, " failed (serving without the cache; next warning in ",
            WARN_INTERVAL_S, "s): ", err)
    end
end

--- lookup(cfg, ctx, req, endpoint, headers) -> cached completion JSON | nil
-- headers: ngx.req.get_headers() (every Cache-Control header counts, not only the first;
-- so does every value of each credential header).
-- Sets ctx.cache (HIT|MISS|BYPASS), ctx.cache_reason and, on a miss, ctx.cache_key.
function _M.lookup(cfg, ctx, req, endpoint, headers)
    ctx.cache = "BYPASS"
    local ccfg = cfg.cache
    if not ccfg.enabled then
        ctx.cache_reason = "disabled"
        return nil
    end
    local ok, why = cache_key.cacheable(req, endpoint, headers["cache-control"])
    if not ok then
        ctx.cache_reason = why
        return nil
    end
    if kredis.down() then
        ctx.cache_reason = "redis-down"
        metrics.incr("kvgate_cache_errors_total", { op = "skipped" })
        return nil
    end
    -- Entries are scoped to the caller's credential (one sha256 of every credential header
    -- sent), so a hit never answers a caller the engine would have refused, and
    -- X-Kvgate-Cache tells a caller only about its own requests. The values go no further.
    local cred, kerr = cache_key.credential(headers, ccfg.credential_headers or DEFAULT_CREDENTIAL_HEADERS,
        ngx.var.args)
    local key
    if cred then
        -- the namespace version in force is the runtime's (pushed without a reload)
        local rt = config.runtime()
        key, kerr = cache_key.key(req, endpoint, cfg.tenant, rt and rt.cache.namespace_version
            or ccfg.namespace_version, cred)
    end
    if not key then
        cache_error("key", kerr)
        ctx.cache_reason = "key-error"
        return nil
    end
    if cache_key.revalidate(headers["cache-control"]) then
        ctx.cache = "MISS"
        ctx.cache_reason = "no-cache"
        ctx.cache_key = key
        return nil
    end
    local v, err = kredis.get(cfg.redis, key)
    if v == nil then
        cache_error("get", err)
        ctx.cache_reason = "redis-error"
        return nil
    end
    if v then
        ctx.cache = "HIT"
        return v
    end
    ctx.cache = "MISS"
    ctx.cache_key = key
    return nil
end

--- serve(ctx, entry, req, endpoint) -> sends the cached answer and ends the request
function _M.serve(ctx, entry, req, endpoint)
    if req.stream == true then
        -- decode_keep: `[]` in the entry (e.g. top_logprobs) must replay as `[]`, not `{}`
        local obj = json.decode_keep(entry)
        if type(obj) ~= "table" then
            cache_error("decode", "cached entry is not JSON")
            ctx.cache = "BYPASS"
            ctx.cache_reason = "bad-entry"
            return false
        end
        local so = req.stream_options
        local include_usage = type(so) == "table" and so.include_usage == true
        ngx.status = 200
        ngx.header["Content-Type"] = "text/event-stream"
        ngx.header["Cache-Control"] = "no-cache"
        ngx.print(sse.from_completion(obj, endpoint, include_usage))
    else
        ngx.status = 200
        ngx.header["Content-Type"] = "application/json"
        ngx.print(entry)
    end
    ngx.exit(200)
    return true
end

--- header_filter(ctx): start capturing a 200 response to a cache miss
function _M.header_filter(ctx)
    if ctx.cache ~= "MISS" or ngx.status ~= 200 then
        return
    end
    local ct = ngx.header["Content-Type"] or ""
    if type(ct) == "table" then
        ct = ct[1] or ""
    end
    ctx.capture = true
    ctx.sse = find(ct, "text/event-stream", 1, true) ~= nil
    ctx.buf = {}
    ctx.size = 0
end

--- body_filter(ctx, max_bytes, chunk, eof): keep a copy of the body (the chunk as it
-- is sent on, ngx.arg[1] and ngx.arg[2] by default); give up past max_bytes (headers are
-- gone by then, so the skip shows only in the metric)
function _M.body_filter(ctx, max_bytes, chunk, eof)
    if not ctx.capture then
        return
    end
    if chunk == nil then
        chunk, eof = ngx.arg[1], ngx.arg[2]
    end
    if chunk and chunk ~= "" then
        local size = ctx.size + #chunk
        if size > max_bytes then
            ctx.capture = false
            ctx.buf = nil
            metrics.incr("kvgate_cache_store_skipped_total", { reason = "too-large" })
            return
        end
        ctx.size = size
        local buf = ctx.buf
        buf[#buf + 1] = chunk
    end
    if eof then
        ctx.eof = true
    end
end

local function write(premature, rcfg, key, value, ttl)
    if premature then
        return
    end
    local ok, err = kredis.set(rcfg, key, value, ttl)
    if not ok then
        cache_error("set", err)
        return
    end
    metrics.incr("kvgate_cache_stores_total", {})
end

local function last_status(s)
    return s and s:match("(%d+)%s*$")
end

local function skipped(reason)
    metrics.incr("kvgate_cache_store_skipped_total", { reason = reason })
end

--- log(cfg, ctx): store a complete 200 response (never a partial one); ctx.endpoint
-- tells chat from completions when a stream is rebuilt
function _M.log(cfg, ctx)
    -- A client abort still runs the log phase with status 200 and a partial buffer:
    -- only a body that reached eof, from a node that answered 200, is stored.
    if not (ctx.capture and ctx.eof and ngx.status == 200) then
        return
    end
    if last_status(ngx.var.upstream_status) ~= "200" then
        return
    end
    local body = concat(ctx.buf)
    local value, obj, err
    if ctx.sse then
        obj = sse.to_completion(body, ctx.endpoint)
        if not obj then
            -- no [DONE], an error chunk, or logprobs/tool calls that do not merge
            skipped("bad-stream")
            return
        end
        value, err = json.encode_keep(obj)
        if not value then
            skipped("encode-error")
            ngx.log(ngx.INFO, "kvgate cache: cannot encode the rebuilt stream: ", err)
            return
        end
    else
        obj = cjson.decode(body)
        if type(obj) ~= "table" or obj.error then
            skipped("bad-body")
            return
        end
        value = body
    end
    -- Only a whole answer is replayed: at least one choice, each ended by the engine.
    local done, why = sse.finished(obj)
    if not done then
        skipped(why)
        return
    end
    -- A hit must carry the token usage clients account with; a stream sent without
    -- stream_options.include_usage has none, so it is served but not stored.
    if type(obj.usage) ~= "table" then
        skipped("no-usage")
        return
    end
    -- a rebuilt stream is re-encoded, so its size is checked again
    if #value > cfg.cache.max_entry_bytes then
        skipped("too-large")
        return
    end
    local ok, err = ngx.timer.at(0, write, cfg.redis, ctx.cache_key, value, cfg.cache.ttl_s)
    if not ok then
        cache_error("timer", err)
    end
end

return _M
