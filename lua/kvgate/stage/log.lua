-- Stage "log" (log phase, last): the request's counter (kvgate_requests_total) and its
-- request-log entry (kvgate.reqlog buffers it; keys.LOG_FIELDS lists the fields). Runs for
-- every routed request, also after a client abort or every node failing.
local metrics = require "kvgate.metrics"
local reqlog = require "kvgate.reqlog"
local hash = require "kvgate.hash"
local keys = require "kvgate.keys"

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

--- entry(kctx, node, status, outcome, addr) -> the request-log entry of a routed request
-- (node: "" for none)
function _M.entry(kctx, node, status, outcome, addr)
    local route = kctx.route
    local rk = route.key
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
    }
end

--- count(pool, node, status, outcome, kind, tenant): kvgate_requests_total (tenant "none"
-- with gateway.auth off; tenants are the policy's, so the label set stays bounded)
function _M.count(pool, node, status, outcome, kind, tenant)
    requests(1, tenant or "none", pool or "none", node or "none", tostring(status), outcome or "BYPASS", kind or "none")
end

--- record(entry): into the request log (never blocks)
_M.record = reqlog.record

return _M
