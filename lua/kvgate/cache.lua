-- The exact response cache: lookup in access, capture in body_filter, write from
-- a timer started in the log phase (cosockets are not allowed in log/filters; one timer and
-- one pipeline for the stores queued meanwhile in this worker).
--
-- The word "capture" here means the copy of a miss's response kept for the cache (the
-- warm-up's prompt prefixes are "sampled": kvgate.warm.sample).
-- Failure policy: Redis errors fail open — the request is proxied as BYPASS, the
-- error is counted in kvgate_cache_errors_total{op} and logged at most once per
-- WARN_INTERVAL_S across workers (kvgate.log.warn_every). After an error, Redis is skipped for
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
local flight = require "kvgate.flight"
local semantic = require "kvgate.semantic"

local keys = require "kvgate.keys"
local klog = require "kvgate.log"

local ngx = ngx
local type = type
local concat = table.concat
local find = string.find

local M = keys.METRICS

local _M = {}

local WARN_INTERVAL_S = 10
-- policy.cache.credential_headers' default (a kvgate.json rendered without the list)
local DEFAULT_CREDENTIAL_HEADERS = { "authorization", "api-key", "x-api-key" }

local function cache_error(op, err, n)
    metrics.incr(M.cache_errors, { op = op }, n or 1)
    if op == "get" or op == "set" then
        -- the breaker in kvgate.redis: Redis is skipped for BREAKER_S
        kredis.trip()
    end
    klog.warn_every("cache:" .. op, WARN_INTERVAL_S, "kvgate cache ", op,
        " failed (serving without the cache; next warning in ", WARN_INTERVAL_S, "s): ", err)
end

--- lookup(cfg, c, req, endpoint, headers, scope) -> cached completion JSON | nil
-- c: the request's kctx.cache; headers: ngx.req.get_headers() (every Cache-Control header
-- counts, not only the first; so does every value of each credential header); scope: the
-- tenant's cache scope (kctx.tenant.scope; nil with gateway.auth off: cfg.tenant).
-- Sets c.outcome (HIT|MISS|BYPASS), c.reason and, on a miss, c.key. The key (a digest of
-- the whole request) is worked out only for a cacheable request.
function _M.lookup(cfg, c, req, endpoint, headers, scope)
    c.outcome = "BYPASS"
    local ccfg = cfg.cache
    if not ccfg.enabled then
        c.reason = "disabled"
        return nil
    end
    local cc = headers["cache-control"]
    local ok, why = cache_key.cacheable(req, endpoint, cc)
    if not ok then
        c.reason = why
        return nil
    end
    if kredis.down() then
        c.reason = "redis-down"
        metrics.incr(M.cache_errors, { op = "skipped" })
        return nil
    end
    -- Entries are scoped to the caller's credential (one sha256 of every credential header
    -- sent), so a hit never answers a caller the engine would have refused, and
    -- X-Kvgate-Cache tells a caller only about its own requests. The values go no further.
    -- With tenants (gateway.auth on), the tenant's scope (its own, or its cache group's) and
    -- the credential headers left after the auth stage removed the tenant's key (every key of
    -- one tenant shares its entries; another tenant never reaches them).
    local cred, kerr = cache_key.credential(headers, ccfg.credential_headers or DEFAULT_CREDENTIAL_HEADERS,
        ngx.var.args)
    local key
    if cred then
        -- the namespace version in force is the runtime's (pushed without a reload)
        local rt = config.runtime()
        key, kerr = cache_key.key(req, endpoint, scope or cfg.tenant,
            rt and rt.cache.namespace_version or ccfg.namespace_version, cred)
    end
    if not key then
        cache_error("key", kerr)
        c.reason = "key-error"
        return nil
    end
    -- the semantic scope has the same credential digest (kvgate.semantic.scope); the entry's
    -- tags (X-Kvgate-Cache-Tags) are filed with it when it is stored
    c.cred = cred
    if headers[semantic.TAGS_HEADER] ~= nil then
        c.tags = semantic.tags(headers)
    end
    if cc ~= nil and cache_key.revalidate(cc) then
        c.outcome = "MISS"
        c.reason = "no-cache"
        c.key = key
        return nil
    end
    local wait_ms = ccfg.single_flight_wait_ms or 0
    if wait_ms > 0 and req.stream == true then
        -- a stream is stored only with its usage (stream_options.include_usage): one without it
        -- never leaves an entry to wait for, so its duplicates would take turns at the lock
        local so = req.stream_options
        if not (type(so) == "table" and so.include_usage == true) then
            wait_ms = 0
        end
    end
    local v, err, how
    if wait_ms > 0 then
        -- the GET and, on a miss, the key's flight lock in one script (kvgate.flight)
        v, how = flight.lookup(cfg.redis, key, wait_ms)
        err = how
    else
        v, err = kredis.get_batched(cfg.redis, key)
    end
    if v == nil then
        cache_error("get", err)
        c.reason = "redis-error"
        return nil
    end
    if v then
        c.outcome = "HIT"
        if how == "flight" then
            c.reason = "flight"
        end
        return v
    end
    c.outcome = "MISS"
    c.key = key
    if how == "leader" or how == "takeover" then
        c.leader = true
    elseif how == "timeout" then
        c.reason = "flight-timeout"
    end
    return nil
end

--- serve(c, entry, req, endpoint) -> sends the cached answer and ends the request; false
-- (and c.outcome BYPASS) when the entry cannot be replayed
function _M.serve(c, entry, req, endpoint)
    if req.stream == true then
        -- decode_keep: `[]` in the entry (e.g. top_logprobs) must replay as `[]`, not `{}`
        local obj = json.decode_keep(entry)
        if type(obj) ~= "table" then
            cache_error("decode", "cached entry is not JSON")
            c.outcome = "BYPASS"
            c.reason = "bad-entry"
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
        -- known length: no chunked encoding for a body sent in one piece
        ngx.header["Content-Length"] = #entry
        ngx.print(entry)
    end
    ngx.exit(200)
    return true
end

--- access(kctx, cfg): stage "cache": look the request up; a hit is answered here
function _M.access(kctx, cfg)
    local r = kctx.req
    local c = kctx.cache
    local entry = _M.lookup(cfg, c, r.parsed, r.endpoint, r.headers, kctx.tenant.scope)
    local pc = kctx.route.pool_cfg
    if not entry and c.outcome == "MISS" and pc and pc.semantic then
        if c.reason == nil then
            -- an exact miss of a pool with the semantic cache or static answers (kvgate.semantic);
            -- a single-flight leader answered here releases its lock in the log phase
            entry = semantic.lookup(kctx, cfg)
        elseif semantic.static_applies(pc.semantic, r.parsed, r.endpoint) then
            -- no lookup (no-cache, flight-timeout): the answer may not shadow a static one
            c.static_unchecked = true
        end
    end
    if entry then
        -- the log phase reads the tokens the hit avoided from it (kvgate.usage.read)
        c.entry = entry
        _M.serve(c, entry, r.parsed, r.endpoint)
    end
end

--- header_filter(c): start capturing a 200 response to a cache miss (c: kctx.cache)
function _M.header_filter(c)
    if c.outcome ~= "MISS" or ngx.status ~= 200 then
        return
    end
    local ct = ngx.header["Content-Type"] or ""
    if type(ct) == "table" then
        ct = ct[1] or ""
    end
    c.capture = true
    c.sse = find(ct, "text/event-stream", 1, true) ~= nil
    c.buf = {}
    c.size = 0
end

--- body_filter(c, max_bytes, chunk, eof): keep a copy of the body (the chunk as it
-- is sent on, ngx.arg[1] and ngx.arg[2] by default); give up past max_bytes (headers are
-- gone by then, so the skip shows only in the metric)
function _M.body_filter(c, max_bytes, chunk, eof)
    if not c.capture then
        return
    end
    if chunk == nil then
        chunk, eof = ngx.arg[1], ngx.arg[2]
    end
    if chunk and chunk ~= "" then
        local size = c.size + #chunk
        if size > max_bytes then
            c.capture = false
            c.buf = nil
            metrics.incr(M.cache_store_skipped, { reason = "too-large" })
            return
        end
        c.size = size
        local buf = c.buf
        buf[#buf + 1] = chunk
    end
    if eof then
        c.eof = true
    end
end

-- The writes of this worker's complete misses wait here for one timer, which sends them all in
-- one pipeline: under load many misses share a timer and a Redis round trip (a timer and a
-- connection per entry cost ~40 µs a miss); alone, an entry is written at once as before.
local pending, npending = {}, 0
local scheduled = false
local MAX_PENDING = 10000

local function flush(premature, rcfg)
    scheduled = false -- a write queued while this one talks to Redis starts the next timer
    local batch, n = pending, npending
    pending, npending = {}, 0
    if premature or n == 0 then
        return
    end
    local cmds = {}
    for i = 1, n do
        local w = batch[i]
        cmds[i] = { "set", w[1], w[2], "EX", w[3] }
    end
    -- the flight locks of the leaders among them (kvgate.flight): after their entries, in the same
    -- pipeline, so a waiting duplicate finds the entry before the lock is gone
    local ncmds = n
    local inserts
    for i = 1, n do
        local w = batch[i]
        if w[4] then
            ncmds = ncmds + 1
            cmds[ncmds] = { "del", flight.lock_key(w[1]) }
        end
        local sem = w[5]
        if sem then
            -- the entry's tags (a set per tag: kvgate cache invalidate --tag)
            if sem.tags then
                local tc = semantic.tag_commands(w[1], sem.tags, w[3])
                for j = 1, #tc do
                    ncmds = ncmds + 1
                    cmds[ncmds] = tc[j]
                end
            end
            if sem.scope then
                inserts = inserts or {}
                inserts[i] = sem
            end
        end
    end
    local replies, err = kredis.pipeline(rcfg, cmds)
    if not replies then
        cache_error("set", err, n)
        return
    end
    local stored, failed, ferr = 0, 0, nil
    for i = 1, n do
        local r = replies[i]
        if r == nil or (type(r) == "table" and r[1] == false) then
            failed = failed + 1
            ferr = type(r) == "table" and r[2] or "no reply"
        else
            stored = stored + 1
        end
    end
    if stored > 0 then
        metrics.incr(M.cache_stores, {}, stored)
    end
    if inserts then
        -- the semantic entries of the stored answers, to the service (kvgate.semantic.insert)
        local cfg = config.get()
        for i = 1, n do
            local sem = inserts[i]
            local r = replies[i]
            if sem and not (r == nil or (type(r) == "table" and r[1] == false)) then
                semantic.insert(cfg, sem, batch[i][1])
            end
        end
    end
    if failed > 0 then
        cache_error("set", ferr, failed)
    end
end

-- write(rcfg, key, value, ttl, leader, sem): queue a store for this worker's next flush (leader:
-- the key's flight lock goes with it; sem: {tags, and the semantic insert's payload} or nil)
local function write(rcfg, key, value, ttl, leader, sem)
    if npending >= MAX_PENDING then
        cache_error("timer", "too many stores waiting for Redis")
        return
    end
    npending = npending + 1
    pending[npending] = { key, value, ttl, leader, sem }
    if not scheduled then
        local ok, err = ngx.timer.at(0, flush, rcfg)
        if not ok then
            local n = npending
            pending, npending = {}, 0
            cache_error("timer", err, n)
            return
        end
        scheduled = true
    end
    return true
end

local function last_status(s)
    return s and s:match("(%d+)%s*$")
end

local function skipped(reason)
    metrics.incr(M.cache_store_skipped, { reason = reason })
end

-- store(cfg, c, endpoint) -> true when the answer was queued for Redis
local function store(cfg, c, endpoint)
    -- A client abort still runs the log phase with status 200 and a partial buffer:
    -- only a body that reached eof, from a node that answered 200, is stored.
    if not (c.capture and c.eof and ngx.status == 200) then
        return
    end
    if last_status(ngx.var.upstream_status) ~= "200" then
        return
    end
    local buf = c.buf
    local body = #buf == 1 and buf[1] or concat(buf)
    local value, obj, err
    if c.sse then
        obj = sse.to_completion(body, endpoint)
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
    -- Only a whole answer is replayed: at least one choice, each ended by the engine (an
    -- embedding: a list with at least one vector)
    local done, why
    if endpoint == "embeddings" then
        local d = obj.data
        done = type(d) == "table" and d[1] ~= nil
        why = "no-data"
    else
        done, why = sse.finished(obj)
    end
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
    if c.static_unchecked then
        -- a single-turn question of a static pool whose static lookup did not run or failed
        -- (kvgate.semantic.static_applies): stored, it would answer before the static lookup
        skipped("static-unchecked")
        return
    end
    local sem = c.sem
    if not sem and c.tags then
        sem = { tags = c.tags }
    end
    return write(cfg.redis, c.key, value, cfg.cache.ttl_s, c.leader, sem)
end

--- log(cfg, c, endpoint): store a complete 200 response (never a partial one); endpoint
-- ("chat" | "completions" | "embeddings") tells how a stream is rebuilt and what is whole.
-- A single-flight leader (c.leader) that stores nothing releases its lock (kvgate.flight).
function _M.log(cfg, c, endpoint)
    if not store(cfg, c, endpoint) and c.leader then
        flight.release(cfg.redis, c.key)
    end
end

return _M
