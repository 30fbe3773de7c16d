-- Stage "limit" (access, after the route key, before the cache): the tenant's limits
-- (kvgate.limits). A tenant without limits costs one table lookup. Answers 429
-- `rate_limit_exceeded` (OpenAI's format and type: "requests" or "tokens") with Retry-After;
-- every answer of a limited tenant carries OpenAI's x-ratelimit-* headers for its rpm and tpm.
--   kctx.limit = {buckets, how ("redis" | "local"), taken (local), tpm (settled to the
--                 answer's usage, kvgate.usage), settled}
local errors = require "kvgate.errors"
local limits = require "kvgate.limits"
local load = require "kvgate.balancer.load"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local var = ngx.var
local type = type
local ceil = math.ceil
local floor = math.floor
local tostring = tostring

local M = keys.METRICS

local _M = {}

local NAMES = {
    rpm = "requests per min (RPM)", tpm = "tokens per min (TPM)", session_rpm = "requests per min of one session",
    key_rpm = "requests per min of one API key", key_tpm = "tokens per min of one API key",
    concurrency = "requests in flight",
}

local function headers(buckets, left)
    local h = ngx.header
    for i = 1, #buckets do
        local bk = buckets[i]
        local l = left[i]
        if l then
            if bk.name == "rpm" then
                h["x-ratelimit-limit-requests"] = bk.cap
                h["x-ratelimit-remaining-requests"] = l
                h["x-ratelimit-reset-requests"] = limits.duration((bk.cap - l) * bk.win / bk.cap)
            elseif bk.name == "tpm" then
                h["x-ratelimit-limit-tokens"] = bk.cap
                h["x-ratelimit-remaining-tokens"] = l
                h["x-ratelimit-reset-tokens"] = limits.duration((bk.cap - l) * bk.win / bk.cap)
            end
        end
    end
end

local function refuse(tenant, bk, retry_ms, message)
    metrics.incr(M.ratelimited, { tenant = tenant, limit = bk.name })
    if retry_ms then
        ngx.header["Retry-After"] = tostring(ceil(retry_ms / 1000))
    end
    local typ = (bk.name == "tpm" or bk.name == "key_tpm") and "tokens" or "requests"
    return errors.send(429, message, "rate_limit_exceeded", nil, typ)
end

--- access(kctx, cfg): admits (kctx.limit filled) or answers 429 and ends the request
function _M.access(kctx, cfg)
    local kt = kctx.tenant
    local id = kt.id
    if not id then
        return
    end
    local lim = cfg.tenants[id].limits
    if not lim then
        return
    end
    local r = kctx.req
    local req = r.parsed
    local mt = req.max_completion_tokens or req.max_tokens
    if r.endpoint == "embeddings" then
        mt = 0 -- an embedding generates no token
    elseif type(mt) ~= "number" or mt < 1 then
        mt = cfg.limits.default_max_tokens
    end
    local n = req.n
    if type(n) ~= "number" or n < 1 then
        n = 1
    end
    local tokens = load.estimate(#r.body) + floor(mt) * floor(n)
    local buckets = limits.plan(id, lim, kt, kctx.route, tokens,
        floor((cfg.limits.slot_lease_s or cfg.limits.slot_ttl_s) * 1000),
        var.request_id, cfg.limits.session_burst_s)
    for i = 1, #buckets do
        local bk = buckets[i]
        if bk.kind == "b" and bk.cost > bk.cap then
            -- never admissible: a bucket holds at most one minute's worth
            -- no Retry-After: it never succeeds, retrying does not help
            return refuse(id, bk, nil, "Request too large for " .. NAMES[bk.name] .. ": Limit " .. bk.cap ..
                ", Requested " .. bk.cost .. " (the prompt estimate + max_tokens). Send a shorter prompt or a " ..
                "smaller max_tokens.")
        end
    end
    local ok, detail, how = limits.admit(cfg, buckets)
    if how ~= "redis" then
        metrics.incr(M.ratelimit_redis_errors, { tenant = id })
    end
    if ok then
        local l = kctx.limit
        l.buckets = buckets
        l.how = how
        -- settled to the answer's usage (a stream's usage chunk: kvgate.usage asks for it)
        l.tpm = lim.tpm ~= nil or (lim.key_tpm ~= nil and kt.key_id ~= nil)
        if how == "redis" then
            headers(buckets, detail)
        else
            l.taken = detail
        end
        return
    end
    local i, retry_ms, left = detail[1], detail[2], detail[3]
    if how == "deny" then
        return refuse(id, buckets[1], retry_ms, "Rate limits cannot be checked right now (limits.on_redis_error: " ..
            "deny); retry in a few seconds.")
    end
    local bk = buckets[i]
    if how == "redis" then
        local l = {}
        l[i] = left
        headers(buckets, l)
    end
    return refuse(id, bk, retry_ms, "Rate limit reached for " .. NAMES[bk.name] .. ": Limit " .. bk.limit ..
        ". Please try again in " .. limits.duration(retry_ms) .. ".")
end

return _M
