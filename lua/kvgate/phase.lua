-- Phase entry points: nginx.conf only calls these. Each runs the stages of its phase in
-- order over the request context (kvgate.ctx: one namespaced sub-table per stage):
--
--   access         request (kvgate.stage.request)  method, Content-Type, body, JSON, model → pool
--                  route   (kvgate.stage.route)    headers, route key, fingerprint (once), stash
--                  warm    (kvgate.warm.sample)    warm-up sample of the prompt prefix (opt-in)
--                  cache   (kvgate.cache)          lookup; a hit is answered here
--                  usage   (kvgate.usage)          a stream asks the engine for its usage
--   balancer       kvgate.balancer (upstreams.conf: balancer_by_lua) → kctx.balancer
--   header filter  upstream (kvgate.stage.upstream) node, decision headers, stream guard
--                  cache   start capturing a miss's 200
--   body filter    usage: the answer's end and first byte (kvgate.usage), the usage the
--                  client did not ask for stripped; upstream: mid-stream failure / shutdown
--                  cut; cache: the response copy
--   log            in-flight release; log (kvgate.stage.log) counter + request-log entry,
--                  warm (sample → entry), route (fallback/shared counters), upstream
--                  (response time, failovers), cache (store a whole 200 from a timer)
--
-- A stage that answers the request itself (an error, a cache hit) ends it with ngx.exit;
-- the stages after it do not run. Content handlers for nginx's own errors and the small
-- endpoints are at the end.
local cjson = require "cjson.safe"
local config = require "kvgate.config"
local kvctx = require "kvgate.ctx"
local errors = require "kvgate.errors"
local metrics = require "kvgate.metrics"
local inflight = require "kvgate.inflight"
local load = require "kvgate.balancer.load"
local reqlog = require "kvgate.reqlog"
local shutdown = require "kvgate.shutdown"
local balancer = require "kvgate.balancer"
local body_reader = require "kvgate.body"
local keys = require "kvgate.keys"
local cache = require "kvgate.cache"
local warm = require "kvgate.warm.sample"
local stage_auth = require "kvgate.stage.auth"
local tenant = require "kvgate.tenant"
local stage_request = require "kvgate.stage.request"
local stage_route = require "kvgate.stage.route"
local stage_limit = require "kvgate.stage.limit"
local stage_admission = require "kvgate.stage.admission"
local admission = require "kvgate.admission"
local limits = require "kvgate.limits"
local stage_upstream = require "kvgate.stage.upstream"
local stage_log = require "kvgate.stage.log"
local usage = require "kvgate.usage"
-- preloaded here, in the master, so workers never read the file system
require "kvgate.cache_key"
require "kvgate.prompt"
require "kvgate.sse"
local kredis = require "kvgate.redis"
require "kvgate.json"
require "kvgate.hash"

local ngx = ngx
local var = ngx.var
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local match = string.match
local now = ngx.now
local feed = usage.feed
local strip_usage = limits.strip_usage

local M = keys.METRICS

local _M = {}

-- the access phase's stages, in order (each: access(kctx, cfg))
_M.ACCESS = { stage_auth, stage_request, stage_route, stage_limit, warm, cache, usage, stage_admission }
local ACCESS = _M.ACCESS
local NACCESS = #ACCESS

--- init(): init_by_lua (master, root): kvgate.json and the runtime; fail nginx start/-t if bad
function _M.init()
    local cfg, err = config.init() -- kvgate.json + the runtime (runtime.json or its defaults)
    if not cfg then
        -- init_by_lua is the one place an error is wanted: nginx refuses the config
        error("kvgate: " .. err)
    end
    -- the balancer instances (chash rings), built once here: workers inherit them by fork
    local ok, berr = balancer.init(cfg)
    if not ok then
        error("kvgate: " .. berr)
    end
end

--- init_worker(): per-worker state and timers (request-log flush, runtime sync, balancer
-- refresh, shutdown watch)
function _M.init_worker()
    warm.init_worker()
    stage_route.init_worker()
    reqlog.start()
    config.init_worker() -- the runtime's sync timer (every 0.2 s)
    balancer.init_worker()
    shutdown.start()
    tenant.init_worker(config.get) -- API keys' last use, to Redis every few seconds
    kredis.start_batches() -- one pipeline per batch of the requests' GETs and ADMITs
    limits.start(config.get) -- concurrency slots' leases renewed while their requests run
end

--- access(): the access stages in order; any of them may answer the request itself
function _M.access()
    local cfg = config.get()
    local kctx = kvctx.get()
    for i = 1, NACCESS do
        ACCESS[i].access(kctx, cfg)
    end
end

--- header_filter(): decision headers, stream guard, start of the cache's response copy
function _M.header_filter()
    local kctx = kvctx.peek()
    if not (kctx and kctx.route.routed) then
        return
    end
    stage_upstream.header_filter(kctx, config.get())
    cache.header_filter(kctx.cache)
end

--- body_filter(): mid-stream failure → SSE error event; the cache's copy of the body; the
-- node's in-flight count and load end with its answer's last byte
function _M.body_filter()
    local kctx = kvctx.peek()
    if not kctx then
        return
    end
    local c = kctx.cache
    local log = kctx.log
    local guard = log.guard
    local eof
    if log.inflight then
        eof = ngx.arg[2]
        if eof then
            -- the node has answered: released here, before the last bytes are written. The log
            -- phase runs after them (and after a lingering close): a client that sends its next
            -- request at once found the node still busy, and least_conn sent that one elsewhere
            inflight.finish(log)
            load.finish(log)
            admission.release(kctx.admission)
        end
    end
    -- the answer's end, where its usage is (tokens, cost, the TPM settlement), and the time of
    -- its first byte (TTFT)
    local chunk = ngx.arg[1]
    feed(log, chunk, now())
    if log.strip then
        -- the usage the gateway asked for on the client's behalf: taken out again, so the
        -- client (and the cache's copy) get exactly the stream they asked for
        if eof == nil then
            eof = ngx.arg[2]
        end
        chunk = strip_usage(log, chunk, eof)
        ngx.arg[1] = chunk
    end
    if not guard and not c.capture then
        return
    end
    if eof == nil then
        eof = ngx.arg[2]
    end
    if guard then
        local cut
        chunk, eof, cut = stage_upstream.body_filter(kctx, chunk, eof)
        if cut then
            c.capture = false
            return
        end
    end
    if c.capture then
        cache.body_filter(c, config.get().cache.max_entry_bytes, chunk, eof)
    end
end

--- log(): in-flight release, counters, request log; a complete miss goes to the cache writer
function _M.log()
    -- after an internal redirect nobody restored: the stash still holds the context
    local kctx = kvctx.peek() or kvctx.restore()
    if not kctx then
        return
    end
    kvctx.release(kctx)
    -- also on a client abort: the log phase always runs
    inflight.finish(kctx.log)
    load.finish(kctx.log) -- the bounded balancers' prefill tokens (kvgate.balancer.load)
    admission.release(kctx.admission) -- the pool's admission slot (or its place in the queue)
    -- the answer's usage (a hit: its entry's, the tokens it avoided), once (kvgate.usage)
    local klog = kctx.log
    local hit = kctx.cache.outcome == "HIT"
    if hit or ngx.status == 200 then
        klog.prompt, klog.completion, klog.cached = usage.read(klog, hit and kctx.cache.entry,
            kctx.req.endpoint == "embeddings")
    end
    local l = kctx.limit
    if l.buckets then
        -- the concurrency slot back; reserved tokens settled to the answer's usage (a hit and
        -- a refused or failed request used none; an answer without usage keeps the reservation)
        local used
        if l.tpm then
            if hit or ngx.status ~= 200 then
                used = 0
            elseif klog.prompt then
                used = klog.prompt + klog.completion
            end
        end
        limits.settle(l, used, config.get)
    end
    local addr = var.upstream_addr
    if kctx.log.log_only then
        -- every node failed (@kvgate_upstream_error): counted there, logged here
        local status = ngx.status
        local entry = stage_log.entry(kctx, "", status, "BYPASS", addr, config.get())
        warm.log(kctx, entry, status)
        stage_log.record(entry)
        cache.log(config.get(), kctx.cache, kctx.req.endpoint) -- a single-flight leader's lock goes
        return
    end
    local rejected = kctx.req.rejected
    if rejected then
        metrics.incr(M.bad_requests, { status = tostring(rejected) })
        return
    end
    local route = kctx.route
    if not route.routed then
        return
    end
    local cfg = config.get()
    local outcome = kctx.cache.outcome or "BYPASS"
    local node
    if outcome == "HIT" then
        node = "cache"
    else
        node = kctx.balancer.node or stage_upstream.node_of(cfg, addr)
    end
    local status = ngx.status
    -- a semantic or static hit is a HIT to every lever; its label tells which (kvgate.semantic)
    local label = kctx.cache.label or outcome
    stage_log.count(route.pool, node, status, label, route.kind, kctx.tenant.id)
    local entry = stage_log.entry(kctx, node == "none" and "" or node, status, outcome, addr, cfg)
    entry.cache = label
    stage_log.count_usage(entry)
    warm.log(kctx, entry, status)
    stage_log.record(entry)
    stage_route.log(kctx)
    stage_upstream.log(kctx, cfg, node, addr)
    cache.log(cfg, kctx.cache, route.endpoint)
end

--- upstream_error(): content for nginx's own 502/504 (every node failed)
function _M.upstream_error()
    local status = ngx.status
    if status < 500 then
        status = 502
    end
    local cfg = config.get()
    -- the internal redirect gave the request a fresh ngx.ctx: the route stage stashed it
    local kctx = kvctx.restore()
    local up = var.kvgate_upstream or ""
    -- the last node failed too: no retry ran the balancer to record it
    balancer.failed_last(up, var.upstream_addr)
    local pool = cfg.upstream_pools[up]
    stage_log.count(pool or "none", "none", status, "BYPASS", "none")
    -- the request did reach the routing step: it goes to the request log too
    if kctx and pool and kctx.route.kind then
        kctx.log.log_only = true
    end
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["X-Kvgate-Cache"] = "BYPASS"
    ngx.print(errors.body("No inference node could answer the request", "upstream_unavailable", nil,
        "server_error"))
    return ngx.exit(status)
end

--- too_large(): content for nginx's own 413 (body over client_max_body_size: the location's
-- $kvgate_body_limit where it sets one, e.g. /v1/files, else gateway.max_body_bytes)
function _M.too_large()
    local limit = tonumber(var.kvgate_body_limit) or config.get().max_body_bytes
    return errors.send(413, "Request body is larger than " .. limit .. " bytes", "request_too_large")
end

--- control_unavailable(): content for a 502/504 of the Batch API's locations (/v1/files,
-- /v1/batches): the control plane did not answer
function _M.control_unavailable()
    -- (not errors.send: a control plane that is down is no bad request of the client's)
    ngx.status = 503
    ngx.header["Content-Type"] = "application/json"
    ngx.header["Retry-After"] = "5"
    ngx.print(errors.body("The Batch API (the control plane) is not reachable right now; retry shortly.",
        "control_plane_unavailable", nil, "server_error"))
    return ngx.exit(503)
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
    -- the tenant's models only (gateway.auth on): the same key checks as a completion
    local cfg = config.get()
    local kctx = kvctx.get()
    stage_auth.access(kctx, cfg)
    local allowed = kctx.tenant.models
    ngx.header["Content-Type"] = "application/json"
    local data = {}
    for _, m in ipairs(cfg.model_list) do
        if not allowed or allowed[m] then
            data[#data + 1] = { id = m, object = "model", created = 0, owned_by = "kvgate" }
        end
    end
    if #data == 0 then
        -- cjson writes an empty table as an object
        return ngx.print('{"object":"list","data":[]}')
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
    local cfg = config.get()
    local extra = admission.lines(cfg)
    extra[inflight.NAME] = inflight.lines(cfg)
    extra[load.NAME] = load.lines(cfg)
    extra[load.REMOTE_NAME] = load.remote_lines(cfg)
    ngx.print(metrics.render(extra))
end

return _M
