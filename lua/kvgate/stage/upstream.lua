-- Stage "upstream" (header filter, body filter, log): what the node's answer needs on its
-- way to the client. The node that answers (kctx.balancer.node, from the balancer), the
-- decision headers, the stream guard (a node failing mid-stream becomes an SSE error event:
-- kvgate.sse_guard) and the cut of a stream that outlives a reloading worker's grace
-- (kvgate.shutdown); the answering node's status for its circuit breaker (a status the pool's
-- failover.failure_statuses counts is a failure, any other a success: kvgate.breaker); in the
-- log phase the node's response time, its time to first byte for the load score (kvgate.score)
-- and failovers.
--   kctx.log = {node = node id | "cache" | nil, guard = stream guard, stream_failed, inflight}
local config = require "kvgate.config"
local metrics = require "kvgate.metrics"
local sse_guard = require "kvgate.sse_guard"
local shutdown = require "kvgate.shutdown"
local keys = require "kvgate.keys"
local semantic = require "kvgate.semantic"
local peers = require "kvgate.balancer.peers"
local score = require "kvgate.score"

local ngx = ngx
local var = ngx.var
local type = type
local tonumber = tonumber
local find = string.find
local lower = string.lower
local match = string.match

local M = keys.METRICS

local _M = {}

-- memoized sample keys (metrics.counter/histogram) for what every proxied request writes
local response_seconds = metrics.histogram(M.upstream_response, { "pool", "node" })
local failovers = metrics.counter(M.failovers, { "pool" })

--- node_of(cfg, addr) -> the node id of the last address in $upstream_addr ("none" without one)
function _M.node_of(cfg, addr)
    if not addr or addr == "" then
        return "none"
    end
    -- "$upstream_addr" lists every node tried ("a:1, b:2", " : " across redirects)
    local last = match(addr, "([^%s,]+)$")
    return cfg.nodes_by_addr[last] or "unknown"
end

-- node(kctx, cfg) -> the answering node's id: the balancer's pick, else from $upstream_addr
local function node(kctx, cfg)
    local n = kctx.balancer.node
    if n then
        return n
    end
    local addr = var.upstream_addr
    if addr and addr ~= "" then
        return _M.node_of(cfg, addr)
    end
    return nil
end

local function is_sse(ct)
    if type(ct) == "table" then
        ct = ct[1]
    end
    return type(ct) == "string" and find(lower(ct), "text/event-stream", 1, true) ~= nil
end

local the_balancer
-- instance(pool) -> this worker's balancer instance of the pool (kvgate.balancer, required late:
-- it requires this module's neighbours)
local function instance(pool)
    local bal = the_balancer
    if not bal then
        bal = require "kvgate.balancer"
        the_balancer = bal
    end
    return bal.instance(pool)
end

--- header_filter(kctx, cfg): decision headers; the stream guard for a streamed 200; the
-- answering node's breaker
function _M.header_filter(kctx, cfg)
    local h = ngx.header
    local outcome = kctx.cache.outcome
    local hit = outcome == "HIT"
    local log = kctx.log
    local n
    if hit then
        log.node = "cache"
    else
        n = node(kctx, cfg)
        log.node = n
    end
    h["X-Kvgate-Cache"] = outcome or "BYPASS"
    if kctx.cache.label then
        -- a semantic or static hit (kvgate.semantic): SEMANTIC | STATIC, the similarity
        semantic.header(kctx.cache, h)
    end
    if cfg.debug_headers then
        h["X-Kvgate-Node"] = hit and "cache" or n or "none"
        h["X-Kvgate-Route-Key-Kind"] = kctx.route.kind
        local reason = kctx.cache.reason
        if reason then
            h["X-Kvgate-Cache-Reason"] = reason
        end
    end
    local status = ngx.status
    local picked = not hit and kctx.balancer.node
    if picked then
        -- the balancer's node answered (not nginx itself: @kvgate_upstream_error has no filter)
        local b = instance(kctx.route.pool)
        if b then
            peers.answered(b, picked, status)
        end
    end
    if not hit and n and status == 200 and is_sse(h["Content-Type"]) then
        log.guard = sse_guard.new()
    end
end

-- upstream_finished() -> true when nginx has closed the books on the last node: its
-- $upstream_response_time is set only at finalization ("-" while it is sending)
local function upstream_finished()
    local t = var.upstream_response_time
    return t ~= nil and match(t, "[%d.]+%s*$") ~= nil
end

--- body_filter(kctx, chunk, eof) -> chunk, eof as sent on (the guard may replace them), and
-- true when the stream was cut here (nothing more is to be captured)
function _M.body_filter(kctx, chunk, eof)
    local log = kctx.log
    local guard = log.guard
    local pool = kctx.route.pool
    local finished = chunk == "" and not eof and upstream_finished()
    local out, failed = sse_guard.step(guard, chunk, eof, finished, log.node)
    if out then
        ngx.arg[1] = out
        chunk = out
    end
    if failed then
        log.stream_failed = true
        metrics.incr(M.stream_errors, { pool = pool, node = log.node or "unknown" })
        ngx.log(ngx.WARN, "kvgate: node ", log.node, " (", var.upstream_addr, ") failed mid-stream; ",
            "sent an error event to the client")
    elseif not eof and shutdown.cut_due(config.get().shutdown.cut_streams_after_s) then
        local last = sse_guard.cut(guard, chunk)
        if last then
            -- eof set here: ngx_lua then drops what the node still sends, without calling
            -- this filter again (seen_last_in_filter)
            ngx.arg[1] = last
            ngx.arg[2] = true
            log.stream_failed = true
            metrics.incr(M.stream_cuts, { pool = pool, reason = "shutdown-grace" })
            ngx.log(ngx.WARN, "kvgate: a stream from node ", log.node, " outlived the reload grace; ",
                "ended it with an error event before worker_shutdown_timeout")
            return chunk, eof, true
        end
    end
    return chunk, eof, false
end

--- log(kctx, cfg, node, addr): the node's response time, failovers, a stream that ended
-- without [DONE] at the end of the grace
function _M.log(kctx, cfg, n, addr)
    local pool = kctx.route.pool
    if n ~= "cache" and addr then
        local t = tonumber(match(var.upstream_response_time or "", "([%d.]+)%s*$"))
        if t then
            response_seconds(t, pool, n)
        end
        if find(addr, ",", 1, true) then
            failovers(1, pool)
        end
        -- the node's time to first byte, for the keyless requests' load score
        local ht = tonumber(match(var.upstream_header_time or "", "([%d.]+)%s*$"))
        if ht and kctx.balancer.node == n then
            local pcfg = cfg.pools[pool]
            local f = pcfg and pcfg.failover
            score.observe(pool, n, ht, f and f.latency_alpha)
        end
    end
    local guard = kctx.log.guard
    if guard and not guard.done and not guard.failed then
        -- a stream that ended without [DONE]: a client abort, or nginx's forced close at the
        -- end of the grace (which the cut in body_filter exists to prevent: counted if seen)
        local since = shutdown.since()
        if since and ngx.now() - since >= cfg.shutdown.grace_s - 0.5 then
            metrics.incr(M.stream_cuts, { pool = pool, reason = "shutdown-forced" })
        end
    end
end

return _M
