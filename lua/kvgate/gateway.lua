-- Phase entry points; nginx.conf only calls these. Each stays thin and delegates
-- to one module per concern.
local cjson = require "cjson.safe"
local config = require "kvgate.config"
local errors = require "kvgate.errors"
local route_key = require "kvgate.route_key"
local cache = require "kvgate.cache"
local metrics = require "kvgate.metrics"
-- preloaded here, in the master, so workers never read the file system
require "kvgate.cache_key"
require "kvgate.prompt"
require "kvgate.sse"
require "kvgate.redis"
require "kvgate.json"
require "kvgate.hash"

local ngx = ngx
local var = ngx.var
local type = type
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local lower = string.lower
local find = string.find
local match = string.match

local _M = {}

-- 0 = every header: a limit would let a client hide Cache-Control or a second session
-- header behind filler headers. nginx's large_client_header_buffers bounds the total.
local ALL_HEADERS = 0

local ENDPOINTS = {
    ["/v1/chat/completions"] = "chat",
    ["/v1/completions"] = "completions",
}

--- init(): init_by_lua (master, root): read kvgate.json; fail nginx start/-t if bad
function _M.init()
    local cfg, err = config.load()
    if not cfg then
        -- init_by_lua is the one place an error is wanted: nginx refuses the config
        error("kvgate: " .. err)
    end
end

local function node_of(cfg, addr)
    if not addr or addr == "" then
        return "none"
    end
    -- "$upstream_addr" lists every node tried ("a:1, b:2", " : " across redirects)
    local last = match(addr, "([^%s,]+)$")
    return cfg.nodes_by_addr[last] or "unknown"
end

local function is_json(ct)
    if type(ct) ~= "string" then
        return false
    end
    ct = lower(ct)
    return match(ct, "^%s*application/json%s*$") ~= nil or match(ct, "^%s*application/json%s*;") ~= nil
end

-- read-only stand-in when neither the session affinity nor the cache needs headers
local NO_HEADERS = {}

--- access(): validate, route (pool + route key), cache lookup; may answer itself
function _M.access()
    local cfg = config.get()
    local ctx = ngx.ctx
    -- the location regex admits only these two URIs
    local endpoint = ENDPOINTS[var.uri]
    if ngx.req.get_method() ~= "POST" then
        ngx.header["Allow"] = "POST"
        return errors.send(405, "Use POST for " .. var.uri, "method_not_allowed")
    end
    if not is_json(var.content_type) then
        return errors.send(400, "Content-Type must be application/json", "invalid_content_type")
    end
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if not body then
        if ngx.req.get_body_file() then
            -- bodies are kept in memory up to max_body_bytes; a file means it was larger
            return errors.send(413, "Request body is larger than " .. cfg.max_body_bytes .. " bytes",
                "request_too_large")
        end
        return errors.send(400, "The request body is empty; expected a JSON object", "invalid_json")
    end
    local req, derr = cjson.decode(body)
    -- cjson decodes [] and {} alike: the first byte tells an object from an array
    if type(req) ~= "table" or not find(body, "^%s*{") then
        return errors.send(400, "The request body is not a valid JSON object" ..
            (derr and (": " .. derr) or ""), "invalid_json")
    end
    local model = req.model
    if type(model) ~= "string" or model == "" then
        return errors.send(400, "You must provide a model parameter", "missing_model", "model")
    end
    local pool_name = cfg.models[model]
    if not pool_name then
        return errors.send(404, "The model `" .. model .. "` does not exist", "model_not_found", "model")
    end
    local pool = cfg.pools[pool_name]
    -- One header table per request, and only when something reads it: $http_* holds
    -- only the first of repeated headers, but every session value is forwarded (so all
    -- are checked) and a no-store in any Cache-Control header counts. Lookups in it are
    -- case-insensitive (ngx_lua's metatable).
    local headers = NO_HEADERS
    if pool.uses_session or cfg.cache.enabled then
        headers = ngx.req.get_headers(ALL_HEADERS)
    end
    -- round_robin/least_conn do not read the key: only its kind is worked out
    local key, kind, kerr, shared_only = route_key.compute(req, endpoint, headers, pool,
        cfg.fallback_route_key, not pool.hashes_key)
    if not key then
        return errors.send(400, kerr, "invalid_session_id")
    end
    var.kvgate_route_key = key
    var.kvgate_upstream = pool.upstream
    ctx.routed = true
    ctx.pool = pool_name
    ctx.kind = kind
    ctx.endpoint = endpoint
    ctx.shared_prefix = shared_only

    local entry = cache.lookup(cfg, ctx, req, endpoint, headers)
    if entry then
        cache.serve(ctx, entry, req, endpoint)
    end
end

--- header_filter(): decision headers; start the cache capture
function _M.header_filter()
    local ctx = ngx.ctx
    if not ctx.routed then
        return
    end
    local cfg = config.get()
    local h = ngx.header
    h["X-Kvgate-Cache"] = ctx.cache or "BYPASS"
    if cfg.debug_headers then
        h["X-Kvgate-Node"] = ctx.cache == "HIT" and "cache" or node_of(cfg, var.upstream_addr)
        h["X-Kvgate-Route-Key-Kind"] = ctx.kind
        if ctx.cache_reason then
            h["X-Kvgate-Cache-Reason"] = ctx.cache_reason
        end
    end
    if ctx.cache ~= "HIT" then
        cache.header_filter(ctx)
    end
end

--- body_filter(): capture for the cache
function _M.body_filter()
    local ctx = ngx.ctx
    if ctx.capture then
        cache.body_filter(ctx, config.get().cache.max_entry_bytes)
    end
end

--- log(): metrics; hand a complete response to the cache writer
function _M.log()
    local ctx = ngx.ctx
    if ctx.rejected then
        metrics.incr("kvgate_bad_requests_total", { status = tostring(ctx.rejected) })
        return
    end
    if not ctx.routed then
        return
    end
    local cfg = config.get()
    local addr = var.upstream_addr
    local hit = ctx.cache == "HIT"
    local node = hit and "cache" or node_of(cfg, addr)
    metrics.incr("kvgate_requests_total", {
        pool = ctx.pool, node = node, status = tostring(ngx.status),
        cache = ctx.cache or "BYPASS", route_key_kind = ctx.kind,
    })
    if ctx.kind == "fallback" then
        metrics.incr("kvgate_route_key_fallback_total", { pool = ctx.pool })
    elseif ctx.shared_prefix then
        metrics.incr("kvgate_route_key_shared_prefix_total", { pool = ctx.pool })
        local state = ngx.shared.kvgate_state
        if state and state:add("warned:shared_prefix:" .. ctx.pool, true, 60) then
            ngx.log(ngx.WARN, "kvgate pool ", ctx.pool, ": prefix route keys cover only the system prompt/tools ",
                "(prefix_chars too small?); conversations sharing them all land on one node")
        end
    end
    if not hit and addr then
        local t = tonumber(match(var.upstream_response_time or "", "([%d.]+)%s*$"))
        if t then
            metrics.observe("kvgate_upstream_response_seconds", { pool = ctx.pool, node = node }, t)
        end
        if find(addr, ",", 1, true) then
            metrics.incr("kvgate_failovers_total", { pool = ctx.pool })
        end
    end
    cache.log(cfg, ctx)
end

--- upstream_error(): content for nginx's own 502/504 (every node failed)
function _M.upstream_error()
    local status = ngx.status
    if status < 500 then
        status = 502
    end
    local ctx = ngx.ctx
    -- ngx.ctx was reset by the internal redirect; the variables survive it
    local cfg = config.get()
    local up = var.kvgate_upstream or ""
    ctx.routed = false
    metrics.incr("kvgate_requests_total", {
        pool = cfg.upstream_pools[up] or "none", node = "none", status = tostring(status),
        cache = "BYPASS", route_key_kind = "none",
    })
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["X-Kvgate-Cache"] = "BYPASS"
    ngx.print(errors.body("No inference node could answer the request", "upstream_unavailable", nil,
        "server_error"))
    return ngx.exit(status)
end

--- too_large(): content for nginx's own 413 (body over client_max_body_size)
function _M.too_large()
    return errors.send(413, "Request body is larger than " .. config.get().max_body_bytes .. " bytes",
        "request_too_large")
end

--- header_too_large(): content for nginx's own 494 (a header over large_client_header_buffers)
function _M.header_too_large()
    return errors.send(400, "A request header is too large", "request_header_too_large")
end

--- uri_too_long(): content for nginx's own 414 (a request line over the header buffers)
function _M.uri_too_long()
    return errors.send(414, "The request URI is too long", "uri_too_long")
end

--- not_found(): content for any path the gateway does not serve
function _M.not_found()
    return errors.send(404, "Unknown path " .. var.uri, "not_found")
end

--- models(): GET /v1/models from the config
function _M.models()
    local method = ngx.req.get_method()
    if method ~= "GET" and method ~= "HEAD" then
        ngx.header["Allow"] = "GET, HEAD"
        return errors.send(405, "Use GET for /v1/models", "method_not_allowed")
    end
    ngx.header["Content-Type"] = "application/json"
    local data = {}
    for i, m in ipairs(config.get().model_list) do
        data[i] = { id = m, object = "model", created = 0, owned_by = "kvgate" }
    end
    ngx.print(cjson.encode({ object = "list", data = data }))
end

--- health(): GET /kvgate/health
function _M.health()
    local cfg = config.get()
    ngx.header["Content-Type"] = "application/json"
    ngx.print(cjson.encode({ status = "ok", digest = cfg.digest, pools = cfg.pool_names, pid = ngx.worker.pid() }))
end

--- metrics(): GET /metrics
function _M.metrics()
    ngx.header["Content-Type"] = "text/plain; version=0.0.4"
    ngx.print(metrics.render())
end

return _M
