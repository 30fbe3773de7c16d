-- A circuit breaker per node, shared by every nginx worker (lua_shared_dict kvgate_state).
--
--   closed     the node takes traffic; its consecutive failed tries are counted
--   open       `failures` failures in a row (the pool's failover.breaker_failures): skipped by
--              every balancer until open_until (breaker_open_s)
--   half-open  open_until has passed: still skipped, except by one trial request (the first
--              request of any worker that claims the trial with an atomic add). The trial's
--              success closes the breaker; its failure opens it again for twice as long as the
--              last time (exponential backoff of the trials to a failing node, up to
--              breaker_open_max_s). A trial that ends without an answer (its client went away)
--              leaves the claim to expire after open_s, then another request is the trial.
--
-- A failure: a try that failed (connect error, timeout, 502/503 passed on: ngx.balancer's
-- get_last_failure() = "failed", kvgate.balancer.peers), the last try when every try failed
-- (@kvgate_upstream_error), or an answer whose status the pool counts (failover.failure_statuses,
-- seen in the header filter: kvgate.stage.upstream). A client abort is none: the request ends
-- without a retry or an answer. A success: any other answer from the node.
--
-- Keys in kvgate_state ("<k>:<pool>:<node id>"): bf (consecutive failures, incr), bo (open
-- until, unix s; absent = closed), bn (opens in a row, the backoff's exponent), bt (the trial's
-- claim, TTL open_s). The request path reads none of them: each worker's view (node.failed,
-- node.half, node.brk) is refreshed every kvgate.balancer.peers.REFRESH_S (refresh()), and the
-- worker that records a transition updates its own view at once. A success in a worker whose
-- view has no failure for the node writes nothing (one table read per request); so failures of
-- other workers in the last refresh interval may survive one success ("consecutive" within
-- about 0.2 s). Worker 0's refresh writes the gauge kvgate_upstream_breaker_state{pool,node}
-- (0 closed, 1 open, 2 half-open) into kvgate_metrics.
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local shared = ngx.shared
local tostring = tostring
local min = math.min

local _M = {}

_M.DICT = "kvgate_state"
_M.CLOSED, _M.OPEN, _M.HALF_OPEN = 0, 1, 2
_M.STATE_NAMES = { [0] = "closed", [1] = "open", [2] = "half-open" }
-- the defaults of kvgate.json's pool.failover (the policy's; nginx's max_fails=1 fail_timeout=10s)
_M.DEFAULTS = { breaker_failures = 1, breaker_open_s = 10, breaker_open_max_s = 60 }

local GAUGE = keys.METRICS.upstream_breaker

--- keys_for(pool, id) -> {bf, bo, bn, bt, gauge}: a node's keys (built once per node table)
function _M.keys_for(pool, id)
    local s = ":" .. pool .. ":" .. tostring(id)
    return { bf = "bf" .. s, bo = "bo" .. s, bn = "bn" .. s, bt = "bt" .. s,
             gauge = GAUGE .. metrics.labels({ pool = pool, node = id }) }
end

--- settings(pool_cfg) -> failures, open_s, open_max_s from kvgate.json's pool.failover
function _M.settings(pcfg)
    local f = pcfg and pcfg.failover or _M.DEFAULTS
    local d = _M.DEFAULTS
    return f.breaker_failures or d.breaker_failures, f.breaker_open_s or d.breaker_open_s,
        f.breaker_open_max_s or d.breaker_open_max_s
end

--- open_for(opens, open_s, open_max_s) -> seconds the breaker stays open at its opens-th opening
-- in a row (PURE): open_s, 2 × open_s, 4 × open_s ... at most open_max_s
function _M.open_for(opens, open_s, open_max_s)
    if opens < 1 then
        opens = 1
    end
    return min(open_s * 2 ^ (opens - 1), open_max_s)
end

--- failure(b, node, now) -> the state after it: one failed try of node (b: a balancer
-- instance with b.pool and b.breaker = {failures, open_s, open_max_s}; node.bk: its keys)
function _M.failure(b, node, now)
    local d = shared[_M.DICT]
    node.brk = true
    if not d then
        node.failed = true
        return _M.OPEN
    end
    local k = node.bk
    local until_ = d:get(k.bo)
    if until_ and now < until_ then
        -- already open: the failures of requests that were in flight when it opened
        node.failed = true
        return _M.OPEN
    end
    local bc = b.breaker
    local fails = d:incr(k.bf, 1, 0) or 1
    if not until_ and fails < bc.failures then
        return _M.CLOSED
    end
    -- closed with N failures in a row, or a half-open trial that failed: open (again)
    local opens = d:incr(k.bn, 1, 0) or 1
    local t = _M.open_for(opens, bc.open_s, bc.open_max_s)
    d:set(k.bo, now + t)
    d:set(k.bf, 0)
    d:delete(k.bt)
    node.failed = true
    node.half = false
    ngx.log(ngx.WARN, "kvgate pool ", b.pool, ": node ", node.id, "'s breaker is open for ", t, " s (",
        until_ and "its half-open trial failed" or (fails .. " failures in a row"), ")")
    return _M.OPEN
end

--- success(b, node): node answered (not a counted failure): a half-open breaker closes, the
-- failure count restarts. Nothing is written when this worker's view knows no failure.
function _M.success(b, node)
    if not node.brk then
        return
    end
    local d = shared[_M.DICT]
    node.brk = false
    node.failed = false
    node.half = false
    if not d then
        return
    end
    local k = node.bk
    d:delete(k.bf)
    if d:get(k.bo) then
        d:delete(k.bo)
        d:delete(k.bn)
        d:delete(k.bt)
        ngx.log(ngx.WARN, "kvgate pool ", b.pool, ": node ", node.id, "'s breaker is closed (it answered)")
    end
end

--- claim_trial(b, node) -> true when this request is node's half-open trial (one per open_s)
function _M.claim_trial(b, node)
    local d = shared[_M.DICT]
    if not d then
        return false
    end
    local ok = d:add(node.bk.bt, true, b.breaker.open_s)
    return ok == true
end

--- state(d, k, now) -> CLOSED | OPEN | HALF_OPEN, consecutive failures (from the dict)
function _M.state(d, k, now)
    local until_ = d:get(k.bo)
    local fails = d:get(k.bf) or 0
    if not until_ then
        return _M.CLOSED, fails
    end
    return now < until_ and _M.OPEN or _M.HALF_OPEN, fails
end

--- refresh(b, now, write_gauge) -> number of half-open nodes: this worker's view of b's
-- breakers (node.failed = open or half-open, node.half, node.brk = any failure known);
-- write_gauge: also the gauge samples (worker 0)
function _M.refresh(b, now, write_gauge)
    local d = shared[_M.DICT]
    if not d then
        return 0
    end
    local m = write_gauge and shared.kvgate_metrics
    local half = 0
    local nodes = b.nodes
    for i = 1, #nodes do
        local node = nodes[i]
        local st, fails = _M.state(d, node.bk, now)
        node.failed = st ~= _M.CLOSED
        node.half = st == _M.HALF_OPEN
        node.brk = st ~= _M.CLOSED or fails > 0
        if node.half then
            half = half + 1
        end
        if m then
            m:set(node.bk.gauge, st)
        end
    end
    return half
end

--- forget(b, node): close node's breaker and forget its failures (a node back in service)
function _M.forget(_, node)
    local d = shared[_M.DICT]
    node.failed = false
    node.half = false
    node.brk = false
    if d then
        local k = node.bk
        d:delete(k.bf)
        d:delete(k.bo)
        d:delete(k.bn)
        d:delete(k.bt)
    end
end

return _M
