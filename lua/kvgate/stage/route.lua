-- Stage "route" (access, after "request"): the request's headers (when anything reads them),
-- its route key and kind (kvgate.route_key: session, user, prefix or the fallback), its
-- prefix fingerprint (computed once: the prefix route key is the fingerprint), the shared-
-- prefix flag, the pool's upstream. Stashes the context (kvgate.ctx) before the request can
-- be proxied: @kvgate_upstream_error gets it back after nginx's internal redirect.
--   kctx.req.headers = ngx.req.get_headers() or an empty table
--   kctx.route = {key, kind, fp, shared, routed = true, ...(request stage)}
local errors = require "kvgate.errors"
local route_key = require "kvgate.route_key"
local hot_prefix = require "kvgate.hot_prefix"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"
local klog = require "kvgate.log"
local kvctx = require "kvgate.ctx"

local ngx = ngx
local var = ngx.var
local get_headers = ngx.req.get_headers
local now = ngx.now
local sub = string.sub

local M = keys.METRICS

local _M = {}

-- 0 = every header: a limit would let a client hide Cache-Control or a second session
-- header behind filler headers. nginx's large_client_header_buffers bounds the total.
local ALL_HEADERS = 0
-- read-only stand-in when neither the session affinity nor the cache needs headers
local NO_HEADERS = {}
local WARN_S = 60

local hot -- per worker: the completions shared-prefix detector (hot_prefix.lua)

--- init_worker(): this worker's shared-prefix detector
function _M.init_worker()
    hot = hot_prefix.new()
end

-- a placeholder session id or `user` ("null", "undefined", ...) was taken as absent
local function count_sentinels(pool_name, pool, s_sentinel, u_sentinel)
    if s_sentinel then
        metrics.incr(M.route_key_sentinel, { pool = pool_name, source = "session", value = s_sentinel })
    end
    if u_sentinel then
        metrics.incr(M.route_key_sentinel, { pool = pool_name, source = "user", value = u_sentinel })
    end
    klog.warn_every("sentinel:" .. pool_name, WARN_S, "kvgate pool ", pool_name, ": a placeholder ",
        s_sentinel and (pool.session_header .. " (" .. s_sentinel .. ")") or ("user (" .. u_sentinel .. ")"),
        " was treated as absent; the next affinity source routed it (a client sends str(None)/undefined?)")
end

--- access(kctx, cfg): route the request; a bad session header is answered 400 here
function _M.access(kctx, cfg)
    local route = kctx.route
    local pool = route.pool_cfg
    local pool_name = route.pool
    local r = kctx.req
    local req, endpoint = r.parsed, r.endpoint
    -- One header table per request, and only when something reads it: $http_* holds
    -- only the first of repeated headers, but every session value is forwarded (so all
    -- are checked) and a no-store in any Cache-Control header counts. Lookups in it are
    -- case-insensitive (ngx_lua's metatable).
    local headers = NO_HEADERS
    if pool.uses_session or cfg.cache.enabled then
        headers = get_headers(ALL_HEADERS)
    end
    r.headers = headers
    -- round_robin/least_conn do not read the key: only its kind is worked out
    local key, kind, kerr, shared_only, s_sentinel, u_sentinel = route_key.compute(req, endpoint, headers, pool,
        cfg.fallback_route_key, not pool.hashes_key)
    if not key then
        return errors.send(400, kerr, "invalid_session_id")
    end
    if s_sentinel or u_sentinel then
        count_sentinels(pool_name, pool, s_sentinel, u_sentinel)
    end
    -- the prefix fingerprint, whatever decided the route: the prefix route key is one
    local fp
    if kind == "prefix" and key ~= "" then
        fp = sub(key, 3)
    else
        -- (only a prefix route key is flagged hot when its window is shared)
        fp = route_key.prefix_key(req, endpoint, pool.prefix_chars)
    end
    if kind == "prefix" and endpoint == "completions" and key ~= "" and hot then
        -- no structure to read: many different prompts on one fingerprint (hot_prefix.lua)
        shared_only = hot_prefix.observe(hot, pool_name .. ":" .. fp, req.prompt, pool.prefix_chars, now())
    end
    route.key = key
    route.kind = kind
    route.fp = fp
    route.shared = shared_only
    route.routed = true
    var.kvgate_upstream = pool.upstream
    kvctx.stash(kctx)
end

--- log(kctx): the shared-prefix and fallback counters of a routed request
function _M.log(kctx)
    local route = kctx.route
    if route.kind == "fallback" then
        metrics.incr(M.route_key_fallback, { pool = route.pool })
    elseif route.shared then
        local endpoint = route.endpoint
        local pool = route.pool
        metrics.incr(M.route_key_shared_prefix, { pool = pool, endpoint = endpoint })
        if endpoint == "completions" then
            klog.warn_every("shared_prefix:" .. pool .. ":" .. endpoint, WARN_S, "kvgate pool ", pool,
                ": many different completions prompts share their first prefix_chars bytes (prefix_chars ",
                "too small for a shared template?); they all land on one node")
        else
            klog.warn_every("shared_prefix:" .. pool .. ":" .. endpoint, WARN_S, "kvgate pool ", pool,
                ": prefix route keys cover only the system prompt/tools (prefix_chars too small?); ",
                "conversations sharing them all land on one node")
        end
    end
end

return _M
