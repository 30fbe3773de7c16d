-- The admission queue (issue 12 item 4; docs/tenants.md, Admission queue).
--
-- A pool with `admission` admits at most node_capacity × (its serving nodes, weight > 0 in the
-- runtime in force) requests at once, counted across every worker of this gateway in the
-- kvgate_state dict (one atomic incr: take a slot, give it back when over) and, with several
-- gateway members, less the slots the other gateways held at their last sync through Redis
-- (kvgate.gwload, every gateway.load_sync_s, 50 ms: a burst arriving at several gateways at once may overshoot by
-- what arrives within one sync, then the tier is held to the pool's slots). A request that
-- finds no slot waits: at most queue_length of them per pool, each at most queue_timeout_s,
-- polling for a slot every 2-20 ms (a slot freed anywhere is taken within a poll). Interactive
-- requests go first: a batch request takes a slot only while no interactive one waits. Beyond
-- the queue's length or its timeout: 503 `overloaded` with Retry-After. The slot is given back
-- when the node has answered (the body's last byte) or in the log phase, once.
--
-- A burst is smoothed at the gateway: the engines see at most node_capacity requests each (the
-- balancer spreads them; a bounded balancer keeps every node within its bound), instead of a
-- queue that grows until clients time out.
local config = require "kvgate.config"
local metrics = require "kvgate.metrics"

local ngx = ngx
local now = ngx.now
local sleep = ngx.sleep
local on_abort = ngx.on_abort
local pairs = pairs
local min = math.min

local _M = {}

_M.DICT = "kvgate_state"
_M.POLL_MIN_S = 0.002
_M.POLL_MAX_S = 0.02
_M.WAITING = "kvgate_admission_waiting"
_M.INFLIGHT = "kvgate_admission_inflight"

local function dict()
    return ngx.shared[_M.DICT]
end

-- capacity(pool, node_capacity) -> slots of the pool now (its serving nodes in the runtime),
-- memoized per runtime table (a new version is a new table)
local cap_rt, cap_of = nil, {}
local function capacity(pool, node_capacity)
    local rt = config.runtime()
    if rt ~= cap_rt then
        cap_rt, cap_of = rt, {}
    end
    local c = cap_of[pool]
    if c == nil then
        local n = 0
        local prt = rt and rt.pools and rt.pools[pool]
        if prt then
            for _, node in pairs(prt.nodes) do
                if (node.weight or 0) > 0 then
                    n = n + 1
                end
            end
        else
            n = #config.get().pools[pool].nodes
        end
        c = node_capacity * n
        cap_of[pool] = c
    end
    return c
end

local function key(pool, what)
    return "adm:" .. pool .. ":" .. what
end

--- inflight_key(pool) -> the kvgate_state key of the pool's admitted requests at this gateway
function _M.inflight_key(pool)
    return key(pool, "inflight")
end

--- remote_key(pool) -> the kvgate_state key of the other gateways' admitted requests of the
-- pool (kvgate.gwload: summed through Redis every load_sync_s, lapses after 4 rounds without one)
function _M.remote_key(pool)
    return key(pool, "remote")
end

-- try(d, pool, cap) -> true when a slot was taken: this gateway's admitted requests stay
-- within the pool's slots less those the other gateways hold (as of their last sync)
local function try(d, pool, cap)
    local k = key(pool, "inflight")
    local v = d:incr(k, 1, 0)
    if v and v + (d:get(key(pool, "remote")) or 0) <= cap then
        return true
    end
    d:incr(k, -1, 0)
    return false
end

--- enter(a, pool, adm, priority) -> true | nil, why ("full" | "timeout" | "aborted")
-- a: kctx.admission (the slot and the wait are recorded there for release()); adm: the
-- pool's admission config; priority: "interactive" | "batch". Waits (ngx.sleep) while queued;
-- a client that closes its connection meanwhile (lua_check_client_abort, ngx.on_abort) leaves
-- the queue at the next poll, "aborted", and never takes a slot.
function _M.enter(a, pool, adm, priority)
    local d = dict()
    local cap = capacity(pool, adm.node_capacity)
    local interactive = priority ~= "batch"
    if (interactive or (d:get(key(pool, "waiting_i")) or 0) == 0) and try(d, pool, cap) then
        a.pool = pool
        return true
    end
    local wk = key(pool, "waiting")
    local w = d:incr(wk, 1, 0)
    if not w or w > adm.queue_length then
        d:incr(wk, -1, 0)
        return nil, "full"
    end
    a.waiting = pool
    local ik = key(pool, "waiting_i")
    if interactive then
        d:incr(ik, 1, 0)
        a.interactive = true
    end
    local start = now()
    local deadline = start + adm.queue_timeout_s
    local poll = _M.POLL_MIN_S
    local ok = false
    -- the callback runs in its own light thread; only the queued pay for it (registered once:
    -- nothing else in the access phase registers one)
    local aborted = false
    on_abort(function()
        aborted = true
    end)
    repeat
        sleep(poll)
        poll = min(poll * 1.5, _M.POLL_MAX_S)
        if not aborted and (interactive or (d:get(ik) or 0) == 0) then
            ok = try(d, pool, capacity(pool, adm.node_capacity))
        end
    until ok or aborted or now() >= deadline
    _M.leave_queue(a)
    metrics.observe("kvgate_admission_wait_seconds", { pool = pool }, now() - start)
    if aborted then
        if ok then
            -- the slot of a client gone in the same poll goes back at once
            dict():incr(key(pool, "inflight"), -1, 0)
        end
        return nil, "aborted"
    end
    if not ok then
        return nil, "timeout"
    end
    a.pool = pool
    return true
end

--- leave_queue(a): no longer waiting (once)
function _M.leave_queue(a)
    local pool = a.waiting
    if not pool then
        return
    end
    a.waiting = nil
    local d = dict()
    d:incr(key(pool, "waiting"), -1, 0)
    if a.interactive then
        a.interactive = nil
        d:incr(key(pool, "waiting_i"), -1, 0)
    end
end

--- release(a): the request's slot back (once; also for a request still waiting, e.g. a
-- worker that exits while it sleeps)
function _M.release(a)
    _M.leave_queue(a)
    local pool = a.pool
    if not pool then
        return
    end
    a.pool = nil
    dict():incr(key(pool, "inflight"), -1, 0)
end

--- lines(cfg) -> {[family] = sample lines}: the waiting and admitted gauges per pool with a queue
function _M.lines(cfg)
    local d = dict()
    local waiting, inflight = {}, {}
    for name, p in pairs(cfg.pools) do
        if p.admission and d then
            local l = metrics.labels({ pool = name })
            waiting[l] = d:get(key(name, "waiting")) or 0
            inflight[l] = d:get(key(name, "inflight")) or 0
        end
    end
    return { [_M.WAITING] = metrics.gauge_lines(_M.WAITING, waiting),
             [_M.INFLIGHT] = metrics.gauge_lines(_M.INFLIGHT, inflight) }
end

return _M
