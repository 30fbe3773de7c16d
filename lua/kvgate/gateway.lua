-- Phase entry points; nginx.conf only calls these. Each stays thin and delegates
-- to one module per concern.
local cjson = require "cjson.safe"
local config = require "kvgate.config"
local errors = require "kvgate.errors"
local route_key = require "kvgate.route_key"
local cache = require "kvgate.cache"
local metrics = require "kvgate.metrics"
local inflight = require "kvgate.inflight"
local reqlog = require "kvgate.reqlog"
local prefix_doc = require "kvgate.warm.prefix_doc"
local sse_guard = require "kvgate.sse_guard"
local shutdown = require "kvgate.shutdown"
local hash = require "kvgate.hash"
local balancer = require "kvgate.balancer"
local hot_prefix = require "kvgate.hot_prefix"
local body_reader = require "kvgate.body"
local request = require "kvgate.request"
-- pureffi: the plain resty.lrucache rehashes its key table on inserts once full (~43 µs per new
-- key at 4096 items against 0.4 µs: luajit tests/lua/bench_lrucache.lua)
local lrucache = require "resty.lrucache.pureffi"
-- preloaded here, in the master, so workers never read the file system
require "kvgate.cache_key"
require "kvgate.prompt"
require "kvgate.sse"
require "kvgate.redis"
require "kvgate.json"

local ngx = ngx
local var = ngx.var
local type = type
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local lower = string.lower
local find = string.find
local match = string.match
local sub = string.sub
local floor = math.floor
local crc32_long = ngx.crc32_long

local _M = {}

-- 0 = every header: a limit would let a client hide Cache-Control or a second session
-- header behind filler headers. nginx's large_client_header_buffers bounds the total.
local ALL_HEADERS = 0

local ENDPOINTS = {
    ["/v1/chat/completions"] = "chat",
    ["/v1/completions"] = "completions",
}

-- prefix capture: on the second sighting of a pool+fingerprint in a worker, then not again
-- for SEEN_TTL_S, so a one-off prefix is never stored and a hot one is not re-encoded and
-- re-sent on every request (the SET is NX anyway)
local SEEN_TTL_S = 60
local SEEN_ITEMS = 4096
local seen -- per worker (created in init_worker)
local hot -- per worker: the completions shared-prefix detector (hot_prefix.lua)

--- init(): init_by_lua (master, root): read kvgate.json; fail nginx start/-t if bad
function _M.init()
    local cfg, err = config.init() -- kvgate.json + the runtime (runtime.json or its defaults)
    if not cfg then
        -- init_by_lua is the one place an error is wanted: nginx refuses the config
        error("kvgate: " .. err)
    end
    -- the chash rings, built once here: workers inherit them by fork
    local ok, berr = balancer.init(cfg)
    if not ok then
        error("kvgate: " .. berr)
    end
end

--- init_worker(): per-worker state and the request-log flush timer
function _M.init_worker()
    seen = lrucache.new(SEEN_ITEMS)
    hot = hot_prefix.new()
    reqlog.start()
    config.init_worker() -- the runtime's sync timer (every 0.2 s)
    balancer.init_worker()
    shutdown.start()
end

local function node_of(cfg, addr)
    if not addr or addr == "" then
        return "none"
    end
    -- "$upstream_addr" lists every node tried ("a:1, b:2", " : " across redirects)
    local last = match(addr, "([^%s,]+)$")
    return cfg.nodes_by_addr[last] or "unknown"
end

-- key_hash(route_key) -> 16 hex digits of sha256(route key), "" for an empty key
local function key_hash(key)
    if not key or key == "" then
        return ""
    end
    local h = hash.sha256_hex(key)
    return h and sub(h, 1, 16) or ""
end

-- the prompt prefix for warm-up, when the pool captures (opt-in); on its second sighting
-- per worker, then at most once per SEEN_TTL_S
local function capture_prefix(ctx, pool, pool_name, endpoint, fp, body)
    local cap = pool.capture
    if not (cap and cap.enabled and fp) then
        return
    end
    -- Only a prefix seen again is captured: a one-off conversation never puts its text in
    -- Redis (the second sighting in this worker within SEEN_TTL_S captures; later ones skip).
    local sk = pool_name .. ":" .. fp
    if seen then
        local n = seen:get(sk)
        if n == nil then
            seen:set(sk, 1, SEEN_TTL_S)
            return
        elseif n == "done" then
            return
        end
        seen:set(sk, "done", SEEN_TTL_S)
    end
    if endpoint ~= "chat" then
        metrics.incr("kvgate_prefix_capture_skipped_total", { reason = "not-chat" })
        return
    end
    local doc, why = prefix_doc.build(body, cap.max_bytes)
    if not doc then
        metrics.incr("kvgate_prefix_capture_skipped_total", { reason = why })
        return
    end
    ctx.cap = doc
    ctx.cap_ttl = cap.ttl_s
    ctx.cap_seen = sk
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

-- a placeholder session id or `user` ("null", "undefined", ...) was taken as absent
local function count_sentinels(pool_name, pool, s_sentinel, u_sentinel)
    if s_sentinel then
        metrics.incr("kvgate_route_key_sentinel_total", { pool = pool_name, source = "session", value = s_sentinel })
    end
    if u_sentinel then
        metrics.incr("kvgate_route_key_sentinel_total", { pool = pool_name, source = "user", value = u_sentinel })
    end
    local state = ngx.shared.kvgate_state
    if state and state:add("warned:sentinel:" .. pool_name, true, 60) then
        ngx.log(ngx.WARN, "kvgate pool ", pool_name, ": a placeholder ",
            s_sentinel and (pool.session_header .. " (" .. s_sentinel .. ")") or ("user (" .. u_sentinel .. ")"),
            " was treated as absent; the next affinity source routed it (a client sends str(None)/undefined?)")
    end
end

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
    -- under an idle timeout and a total deadline (408); then UTF-8, JSON, model and prompt
    -- shape (400): a refused body reaches neither a node nor the cache
    local body, status, berr, bcode = body_reader.read(cfg)
    if not body then
        return body_reader.reject(status, berr, bcode)
    end
    local req, verr, vparam, vcode = request.parse(body, endpoint)
    if not req then
        return errors.send(400, verr, vcode, vparam)
    end
    local model = req.model
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
    local key, kind, kerr, shared_only, s_sentinel, u_sentinel = route_key.compute(req, endpoint, headers, pool,
        cfg.fallback_route_key, not pool.hashes_key)
    if not key then
        return errors.send(400, kerr, "invalid_session_id")
    end
    if s_sentinel or u_sentinel then
        count_sentinels(pool_name, pool, s_sentinel, u_sentinel)
    end
    var.kvgate_route_key = key
    -- kvgate.balancer.chash reads the key from here (ngx.var costs it ~1.5 us a read)
    ctx.route_key = key
    var.kvgate_upstream = pool.upstream
    ctx.routed = true
    ctx.pool = pool_name
    ctx.kind = kind
    ctx.endpoint = endpoint
    ctx.shared_prefix = shared_only
    -- the prefix fingerprint for the request log, whatever decided the route
    local fp
    if kind == "prefix" and key ~= "" then
        fp = sub(key, 3)
    else
        fp = route_key.prefix_key(req, endpoint, pool.prefix_chars)
    end
    ctx.fp = fp
    if kind == "prefix" and endpoint == "completions" and key ~= "" and hot then
        -- no structure to read: many different prompts on one fingerprint (hot_prefix.lua)
        ctx.shared_prefix = hot_prefix.observe(hot, pool_name .. ":" .. fp, req.prompt, pool.prefix_chars,
            ngx.now())
    end
    -- survives the internal redirect to @kvgate_upstream_error (ngx.ctx does not); the
    -- route key's hash for the log is worked out in the log phase, off the request's path
    var.kvgate_log = kind .. " " .. (fp or "-")
    capture_prefix(ctx, pool, pool_name, endpoint, fp, body)

    local entry = cache.lookup(cfg, ctx, req, endpoint, headers)
    if entry then
        cache.serve(ctx, entry, req, endpoint)
    end
end

local function is_sse(ct)
    if type(ct) == "table" then
        ct = ct[1]
    end
    return type(ct) == "string" and find(lower(ct), "text/event-stream", 1, true) ~= nil
end

--- header_filter(): decision headers; in-flight gauge; start the cache capture and the
-- stream guard
function _M.header_filter()
    local ctx = ngx.ctx
    if not ctx.routed then
        return
    end
    local cfg = config.get()
    local h = ngx.header
    local hit = ctx.cache == "HIT"
    local node
    if not hit then
        local addr = var.upstream_addr
        if addr and addr ~= "" then
            node = node_of(cfg, addr)
            ctx.node = node
            inflight.begin(ctx, ctx.pool, node)
        end
    end
    h["X-Kvgate-Cache"] = ctx.cache or "BYPASS"
    if cfg.debug_headers then
        h["X-Kvgate-Node"] = hit and "cache" or node or "none"
        h["X-Kvgate-Route-Key-Kind"] = ctx.kind
        if ctx.cache_reason then
            h["X-Kvgate-Cache-Reason"] = ctx.cache_reason
        end
    end
    if not hit then
        if node and ngx.status == 200 and is_sse(h["Content-Type"]) then
            ctx.guard = sse_guard.new()
        end
        cache.header_filter(ctx)
    end
end

-- upstream_finished() -> true when nginx has closed the books on the last node: its
-- $upstream_response_time is set only at finalization ("-" while it is sending)
local function upstream_finished()
    local t = var.upstream_response_time
    return t ~= nil and match(t, "[%d.]+%s*$") ~= nil
end

--- body_filter(): mid-stream failure → SSE error event; capture for the cache
function _M.body_filter()
    local ctx = ngx.ctx
    local guard = ctx.guard
    if not guard and not ctx.capture then
        return
    end
    local chunk, eof = ngx.arg[1], ngx.arg[2]
    if guard then
        local finished = chunk == "" and not eof and upstream_finished()
        local out, failed = sse_guard.step(guard, chunk, eof, finished, ctx.node)
        if out then
            ngx.arg[1] = out
            chunk = out
        end
        if failed then
            ctx.stream_failed = true
            metrics.incr("kvgate_stream_errors_total", { pool = ctx.pool, node = ctx.node or "unknown" })
            ngx.log(ngx.WARN, "kvgate: node ", ctx.node, " (", var.upstream_addr, ") failed mid-stream; ",
                "sent an error event to the client")
        elseif not eof and shutdown.cut_due(config.get().shutdown.cut_streams_after_s) then
            local last = sse_guard.cut(guard, chunk)
            if last then
                -- eof set here: ngx_lua then drops what the node still sends, without calling
                -- this filter again (seen_last_in_filter)
                ngx.arg[1] = last
                ngx.arg[2] = true
                ctx.stream_failed = true
                ctx.capture = false
                metrics.incr("kvgate_stream_cuts_total", { pool = ctx.pool, reason = "shutdown-grace" })
                ngx.log(ngx.WARN, "kvgate: a stream from node ", ctx.node, " outlived the reload grace; ",
                    "ended it with an error event before worker_shutdown_timeout")
                return
            end
        end
    end
    if ctx.capture then
        cache.body_filter(ctx, config.get().cache.max_entry_bytes, chunk, eof)
    end
end

-- tries(addr) -> nodes tried: the addresses in $upstream_addr ("a:1, b:2", " : " between
-- upstream groups after an internal redirect); 0 without an upstream (cache hit)
local function tries(addr)
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

-- the request-log entry of a routed request
local function log_entry(ctx, node, status, cache_outcome)
    local rk = var.kvgate_route_key
    local e = {
        ts = ngx.req.start_time(),
        pool = ctx.pool,
        node = node,
        status = status,
        cache = cache_outcome,
        kind = ctx.kind or "",
        fp = ctx.fp or "",
        key = key_hash(rk),
        ms = floor((tonumber(var.request_time) or 0) * 1000 + 0.5),
        -- the key's place on the chash ring (nginx hashes it with ngx_crc32_long too)
        point = (rk and rk ~= "") and crc32_long(rk) or nil,
        tries = tries(var.upstream_addr),
    }
    if ctx.cap then
        if status < 400 then
            e.cap = ctx.cap
            e.cap_ttl = ctx.cap_ttl
        else
            -- a prompt the node refused is no warm-up material; let the next one try
            metrics.incr("kvgate_prefix_capture_skipped_total", { reason = "error-status" })
            if seen and ctx.cap_seen then
                seen:delete(ctx.cap_seen)
            end
        end
    end
    reqlog.record(e)
end

--- log(): in-flight gauge, metrics, request log; hand a complete response to the cache writer
function _M.log()
    local ctx = ngx.ctx
    -- also on a client abort: the log phase always runs
    inflight.finish(ctx)
    if ctx.log_only then
        -- every node failed (@kvgate_upstream_error): counted there, logged here
        log_entry(ctx, "", ngx.status, "BYPASS")
        return
    end
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
    local status = ngx.status
    metrics.incr("kvgate_requests_total", {
        pool = ctx.pool, node = node, status = tostring(status),
        cache = ctx.cache or "BYPASS", route_key_kind = ctx.kind,
    })
    log_entry(ctx, node == "none" and "" or node, status, ctx.cache or "BYPASS")
    if ctx.kind == "fallback" then
        metrics.incr("kvgate_route_key_fallback_total", { pool = ctx.pool })
    elseif ctx.shared_prefix then
        local endpoint = ctx.endpoint
        metrics.incr("kvgate_route_key_shared_prefix_total", { pool = ctx.pool, endpoint = endpoint })
        local state = ngx.shared.kvgate_state
        if state and state:add("warned:shared_prefix:" .. ctx.pool .. ":" .. endpoint, true, 60) then
            if endpoint == "completions" then
                ngx.log(ngx.WARN, "kvgate pool ", ctx.pool, ": many different completions prompts share their ",
                    "first prefix_chars bytes (prefix_chars too small for a shared template?); they all land ",
                    "on one node")
            else
                ngx.log(ngx.WARN, "kvgate pool ", ctx.pool, ": prefix route keys cover only the system prompt/tools ",
                    "(prefix_chars too small?); conversations sharing them all land on one node")
            end
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
    local guard = ctx.guard
    if guard and not guard.done and not guard.failed then
        -- a stream that ended without [DONE]: a client abort, or nginx's forced close at the
        -- end of the grace (which the cut in body_filter exists to prevent: counted if seen)
        local since = shutdown.since()
        if since and ngx.now() - since >= cfg.shutdown.grace_s - 0.5 then
            metrics.incr("kvgate_stream_cuts_total", { pool = ctx.pool, reason = "shutdown-forced" })
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
    -- the last node failed too: no retry ran the balancer to record it
    balancer.failed_last(up, var.upstream_addr)
    ctx.routed = false
    local pool = cfg.upstream_pools[up]
    metrics.incr("kvgate_requests_total", {
        pool = pool or "none", node = "none", status = tostring(status),
        cache = "BYPASS", route_key_kind = "none",
    })
    -- the request did reach the routing step: it goes to the request log too
    local kind, fp = match(var.kvgate_log or "", "^(%S+) (%S+)$")
    if pool and kind then
        ctx.log_only = true
        ctx.pool = pool
        ctx.kind = kind
        ctx.fp = fp ~= "-" and fp or nil
    end
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

--- malformed(): content for nginx's own 400 (a malformed request line, Transfer-Encoding
-- with Content-Length, a bad Host)
function _M.malformed()
    return errors.send(400, "The HTTP request is malformed (request line or headers)", "malformed_request")
end

-- nginx's own refusals that reach /kvgate/errors/status: status → code, message
local NGINX_STATUS = {
    [404] = { "not_found", function() return "Unknown path " .. (match(var.request_uri or "", "^[^?]*") or "") end },
    [405] = { "method_not_allowed", function() return "The method " .. ngx.req.get_method() .. " is not allowed" end },
    [501] = { "unsupported_transfer_encoding", function()
        return "Transfer-Encoding " .. (var.http_transfer_encoding or "?") ..
            " is not supported: send the body with Content-Length or chunked"
    end },
    [505] = { "http_version_not_supported", function()
        return "HTTP version not supported: use HTTP/1.1 (or HTTP/1.0)"
    end },
}

--- nginx_status(): content for nginx's own 404/405/501/505 (error_page … /kvgate/errors/status),
-- in OpenAI's format with nginx's status kept
function _M.nginx_status()
    local status = ngx.status
    local e = NGINX_STATUS[status]
    if not e then
        status = 400
        return errors.send(status, "The HTTP request is malformed", "malformed_request")
    end
    return errors.send(status, e[2](), e[1])
end

--- body_timeout(): content for /kvgate/errors/408, where the access phase sends a request
-- whose body stalled (?why=idle) or passed its deadline (?why=deadline)
function _M.body_timeout()
    return errors.send(408, body_reader.timeout_message(config.get(), var.arg_why), "request_timeout")
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
    ngx.print(metrics.render({ [inflight.NAME] = inflight.lines(config.get()) }))
end

return _M
