-- Stage "log" (log phase, last): the request's counters (kvgate_requests_total; the usage
-- counters: tokens, cost, savings by lever) and its request-log entry (kvgate.reqlog buffers
-- it; keys.LOG_FIELDS lists the fields; the usage fields from kvgate.usage). Runs for every
-- routed request, also after a client abort or every node failing.
local metrics = require "kvgate.metrics"
local reqlog = require "kvgate.reqlog"
local hash = require "kvgate.hash"
local keys = require "kvgate.keys"
local usage = require "kvgate.usage"

local ngx = ngx
local var = ngx.var
local find = string.find
local sub = string.sub
local floor = math.floor
local tonumber = tonumber
local tostring = tostring
local crc32_long = ngx.crc32_long
local start_time = ngx.req.start_time

local M = keys.METRICS

local _M = {}

-- memoized sample keys (metrics.counter): the log phase of every request writes this one
local requests = metrics.counter(M.requests, { "tenant", "pool", "node", "status", "cache", "route_key_kind" })
local tokens = metrics.counter(M.tokens, { "tenant", "pool", "kind" })
local avoided = metrics.counter(M.tokens_avoided, { "tenant", "pool", "kind" })
local cost_usd = metrics.counter(M.cost_usd, { "tenant", "pool" })
local saved_usd = metrics.counter(M.saved_usd, { "tenant", "pool", "lever" })
local NANO = 1e-9

-- key_hash(route_key) -> 16 hex digits of sha256(route key), "" for an empty key
local function key_hash(key)
    if not key or key == "" then
        return ""
    end
    local h = hash.sha256_hex(key)
    return h and sub(h, 1, 16) or ""
end

--- tries(addr) -> nodes tried: the addresses in $upstream_addr ("a:1, b:2", " : " between
-- upstream groups after an internal redirect); 0 without an upstream (cache hit)
function _M.tries(addr)
    if not addr or addr == "" then
        return 0
    end
    local count, init = 1, 1
    while true do
        local at = find(addr, "[,:] ", init)
        if not at then
            return count
        end
        count = count + 1
        init = at + 2
    end
end

--- entry(kctx, node, status, outcome, addr[, cfg]) -> the request-log entry of a routed request
-- (node: "" for none; cfg: the data config, for the pool's prices and usage.log_blocks)
function _M.entry(kctx, node, status, outcome, addr, cfg)
    local route = kctx.route
    local rk = route.key
    local kl = kctx.log
    local hit = outcome == "HIT"
    local p, c, cached = kl.prompt, kl.completion, kl.cached
    local pool_cfg = route.pool_cfg
    -- batch: the Batch API's id, from a verified X-Kvgate-Batch only (kvgate.stage.auth)
    local b = kctx.batch
    local batch = b and b.id or ""
    local cost, s_cache, s_prefix, s_batch = usage.costs(pool_cfg and pool_cfg.prices, p, c, cached, hit,
        batch ~= "")
    local first = kl.first
    local r = kctx.req
    local req = r.parsed
    local blocks = ""
    local ub = cfg and cfg.usage
    if req and ub and pool_cfg then
        local pi = pool_cfg.prefix_index
        local st = kctx.balancer
        blocks = usage.blocks(req, r.endpoint, route.pool, pi and pi.chunk_chars, ub.log_blocks, st.chain,
            st.chain_whole)
    end
    return {
        ts = start_time(),
        pool = route.pool,
        node = node,
        status = status,
        cache = outcome,
        kind = route.kind or "",
        fp = route.fp or "",
        key = key_hash(rk),
        ms = floor((tonumber(var.request_time) or 0) * 1000 + 0.5),
        -- the key's place on the chash ring (kvgate.balancer.ring hashes it with crc32 too)
        point = (rk and rk ~= "") and crc32_long(rk) or nil,
        tries = _M.tries(addr),
        home = node ~= "cache" and kctx.balancer.home or nil,
        -- "bound" | "queue": a bounded balancer sent the key past its home (kvgate.balancer.chash_bounded)
        spill = node ~= "cache" and kctx.balancer.spill or nil,
        -- the tenant's id ("" with gateway.auth off)
        tenant = kctx.tenant.id,
        key_id = kctx.tenant.key_id,
        model = req and req.model,
        prompt = p,
        cached = cached,
        completion = c,
        -- an engine's first byte (not a hit's, nor the gateway's own error)
        ttft = (first and not hit and node ~= "") and floor((first - start_time()) * 1000 + 0.5) or nil,
        batch = batch,
        blocks = blocks,
        cost = cost,
        saved_cache = s_cache,
        saved_prefix = s_prefix,
        saved_batch = s_batch,
    }
end

-- the request log's cache values that are hits, and the lever their savings count under
-- (kvgate_saved_usd_total{lever}): an exact hit's is "cache", a semantic or static one's its own
local HITS = { HIT = "cache", SEMANTIC = "semantic", STATIC = "static" }

--- count_usage(e): the usage counters of a request-log entry: tokens an engine computed
-- (kind prompt | cached | completion) or a hit avoided (prompt | completion), its cost and
-- savings in dollars (lever cache | prefix | batch); nothing for what is 0 or unknown
function _M.count_usage(e)
    local t = e.tenant or "none"
    local pool = e.pool
    local p = e.prompt
    if p then
        -- (a usage object may lack a member: nil counts as 0, never an error in the log phase)
        local c, cached = e.completion or 0, e.cached or 0
        if HITS[e.cache] then
            if p > 0 then avoided(p, t, pool, "prompt") end
            if c > 0 then avoided(c, t, pool, "completion") end
        else
            if p > 0 then tokens(p, t, pool, "prompt") end
            if cached > 0 then tokens(cached, t, pool, "cached") end
            if c > 0 then tokens(c, t, pool, "completion") end
        end
    end
    local cost = e.cost
    if cost then
        if cost > 0 then cost_usd(cost * NANO, t, pool) end
        if (e.saved_cache or 0) > 0 then saved_usd(e.saved_cache * NANO, t, pool, HITS[e.cache] or "cache") end
        if (e.saved_prefix or 0) > 0 then saved_usd(e.saved_prefix * NANO, t, pool, "prefix") end
        if (e.saved_batch or 0) > 0 then saved_usd(e.saved_batch * NANO, t, pool, "batch") end
    end
end

--- count(pool, node, status, outcome, kind, tenant): kvgate_requests_total (tenant "none"
-- with gateway.auth off; tenants are the policy's, so the label set stays bounded)
function _M.count(pool, node, status, outcome, kind, tenant)
    requests(1, tenant or "none", pool or "none", node or "none", tostring(status), outcome or "BYPASS", kind or "none")
end

--- record(entry): into the request log (never blocks)
_M.record = reqlog.record

return _M
