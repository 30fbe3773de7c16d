-- The chash_bounded balancer: consistent hashing with bounded loads (Mirrokni, Thorup,
-- Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018) on chash's ring
-- (kvgate.balancer.ring, the same points: kvgate.balancer.chash builds it), "sticky until
-- saturated". A route key walks the ring from its home to the first node that is
--   * taking traffic, not tried by this request, not marked failed (as chash);
--   * not saturated: its engine's last reported queue (`waiting`, kvgate.node_load) is at
--     most the pool's saturated_queue (unknown or stale reports never saturate);
--   * under its bound: load(node) < c × (total + cost) × w(node) / W
--     the paper's rule: with m balls placed, a node holding j takes the next one while
--     j + 1 <= ceil(c × (m + 1) / n), which for whole j is j < c × (m + 1) / n; with requests of
--     unequal sizes the node is judged by what it holds before this one (a 40k-token prompt is
--     not refused by its idle home for its own size; `load + cost <= c × (total + cost) ...`
--     without the ceiling spilled 23 % of the demo's requests and lost a third of chash's
--     hits: docs/benchmarks.md)
--     c     the pool's bound_factor (> 1; the runtime's, default BOUND_FACTOR); SHARED_FACTOR
--           for a key the route stage flagged as covering only a prefix many conversations
--           share (kctx.route.shared: a window inside the system prompt, a hot completions
--           prefix): such a key carries no affinity worth a queue (every node soon holds
--           the shared prefix), so it goes to the first node of its walk under its plain
--           share of the pool's load
--     load  (bound_load "prefill_tokens", the default) the node's in-flight prefill work: the
--           estimated prompt tokens of the requests
--           routed to it and not yet ended (kvgate.balancer.load, all workers), plus its
--           engine's reported queue converted to tokens: waiting × the pool's mean estimated
--           request (an average over this worker's recent picks)
--     total the pool's in-flight prefill work (the same two terms over the pool)
--     cost  this request's estimated prompt tokens (load.estimate of its body's length),
--           less what the node already holds of the prompt (the prefix-index hook: held())
--     (bound_load "requests": every request costs 1 and a queue counts its waiting requests)
--     w, W  the node's serving weight, the sum of the pool's serving weights.
-- With no node over its bound (and none saturated), every key lands where chash puts it.
-- Some node is always under its bound (c > 1); when every node is skipped (all failed,
-- tried or saturated), chash's own choice is taken. A keyless request goes by chash's round
-- robin and is counted in the load like any other.
--
-- A spill (the key's home on the routing ring skipped for its bound or its queue, on the
-- first try) is counted in kvgate_route_spill_total{pool,node = the home that gave way} and
-- kept in kctx.balancer.spill ("bound" | "queue"; the request log's `spill`). Failovers,
-- failure marks and the in-flight count: kvgate.balancer.peers. Load: taken at the first
-- try's pick, moved by a failover's pick, released in the log phase (kvgate.balancer.load).
--
-- Cost in a request (bench_chash_bounded.lua): the home's check is two shared-dict gets
-- (the node's load, the pool's total) and two incr for the take; a walk adds one get per
-- node it passes.
local ring = require "kvgate.balancer.ring"
local peers = require "kvgate.balancer.peers"
local chash = require "kvgate.balancer.chash"
local load = require "kvgate.balancer.load"
local node_load = require "kvgate.node_load"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local find = ring.find
local skip_failed = peers.skip_failed
local skip_down = peers.skip_down
local rr = peers.rr
local waiting = node_load.waiting
local pool_waiting = node_load.pool_waiting
local take = load.take
local move = load.move
local estimate = load.estimate
local of = load.of
local ipairs = ipairs
local tonumber = tonumber
local huge = math.huge

local _M = {}

_M.NAME = "chash_bounded"
_M.BOUND_FACTOR = 1.25
_M.SHARED_FACTOR = 1
-- the weight of a new pick in this worker's mean request estimate (an EWMA over ~32 picks)
_M.AVG_ALPHA = 1 / 32

local spills = metrics.counter(keys.METRICS.route_spill, { "pool", "node" })

local the_dict
local function dict()
    local d = the_dict
    if d == nil then
        d = ngx.shared[load.DICT] or false
        the_dict = d
    end
    return d
end

--- eligible(load, cost, total, c, w, W) -> true when a node of serving weight w with `load`
-- in flight may take a request of `cost` (PURE): load < c × (total + cost) × w / W
local function eligible(l, cost, total, c, w, W)
    if W <= 0 then
        return true
    end
    return l < c * (total + cost) * w / W
end
_M.eligible = eligible

--- held(b, st, kctx) -> nil | {[node id] = tokens of this prompt the node already holds}
-- The prefix index's hook (kvgate.prefix_index, another balancer): a node's cost for the
-- request is its estimate less what it holds (at least 0). nil here: no discount.
function _M.held(_, _, _)
    return nil
end

--- new(pool, prt, prev) -> balancer | nil, err: chash's instance (its ring, kept across
-- runtimes that change no ring weight) plus the bound's fields from the pool's runtime
-- (bound_factor, saturated_queue: absent = BOUND_FACTOR, no saturation)
function _M.new(pool, prt, prev)
    local b, err = chash.new(pool, prt, prev)
    if not b then
        return nil, err
    end
    local c = tonumber(prt and prt.bound_factor) or _M.BOUND_FACTOR
    if c <= 1 then
        return nil, "bound_factor must be > 1, got " .. c
    end
    b.c = c
    b.sat = tonumber(prt and prt.saturated_queue) or huge
    b.requests = prt ~= nil and prt.bound_load == "requests"
    local W = 0
    for _, node in ipairs(b.nodes) do
        node.load_key = load.key(pool.name, node.id)
        node.remote_key = load.remote_key(node.load_key)
        W = W + node.w
    end
    b.W = W
    b.total_key = load.total_key(pool.name)
    b.remote_total_key = load.remote_key(b.total_key)
    b.avg = prev and prev.avg or 0
    -- the walk's state, reused by every pick of this worker (no table per request)
    b.walk = { pool = pool.name, tried = nil, held = nil, cost = 0, total = 0, c = c, W = W, sat = b.sat,
               avg = 0, calls = 0, why = nil }
    return b
end

--- start(b, st, kctx): the key's point (peers.start), the request's estimated prompt tokens
-- (st.cost: its body's length, else Content-Length on a bare nginx; 1 for bound_load
-- "requests"), the holder of its load (kctx.log) and the prefix hook's discounts (st.held)
function _M.start(b, st, kctx)
    peers.start(b, st, kctx)
    st.holder = kctx.log
    st.c = kctx.route.shared and _M.SHARED_FACTOR or b.c
    if b.requests then
        st.cost = 1
        return
    end
    local body = kctx.req.body
    st.cost = estimate(body and #body or ngx.var.content_length)
    st.held = _M.held(b, st, kctx)
end

-- cost_on(s, node) -> the request's cost on node (the estimate less what the node holds)
local function cost_on(cost, held, node)
    if held then
        local h = held[node.id]
        if h then
            cost = cost - h
            if cost < 0 then
                return 0
            end
        end
    end
    return cost
end

-- skip(node, s) -> true when the walk passes node; s.why: why the first node (the home)
-- was passed for its load ("queue" | "bound")
local function skip(node, s)
    local first = s.calls == 0
    s.calls = s.calls + 1
    local tried = s.tried
    if node.down or node.failed or (tried ~= nil and tried[node.id] ~= nil) then
        return true
    end
    local q = waiting(s.pool, node.id)
    if q and q > s.sat then
        if first then
            s.why = "queue"
        end
        return true
    end
    local d = dict()
    local l = d and of(d, node.load_key, node.remote_key) or 0
    if q then
        l = l + q * s.avg
    end
    local cost = cost_on(s.cost, s.held, node)
    if not eligible(l, cost, s.total, s.c, node.w, s.W) then
        if first then
            s.why = "bound"
        end
        return true
    end
    return false
end

-- account(b, st, node, tried): the request's load goes on node (first try) or moves there
local function account(b, st, node, tried)
    local h = st.holder
    if not h then
        return
    end
    if tried == nil then
        local cost = st.cost
        local avg = b.avg
        b.avg = avg == 0 and cost or avg + (cost - avg) * _M.AVG_ALPHA
        take(h, node.load_key, b.total_key, cost_on(cost, st.held, node))
    else
        move(h, node.load_key)
    end
end

--- pick(b, st, tried) -> node, home | nil[, home]
-- st.point: the key's CRC-32 (nil: round robin); st.cost: estimated tokens; tried: node id -> true
function _M.pick(b, st, tried)
    local point = st.point
    if not point then
        local node = rr(b.nodes, tried, skip_failed) or rr(b.nodes, tried, skip_down)
        if node then
            account(b, st, node, tried)
        end
        return node
    end
    local s = b.walk
    s.tried = tried
    s.held = st.held
    s.cost = st.cost or 1
    s.calls = 0
    s.why = nil
    s.avg = b.avg
    s.c = st.c or b.c
    local d = dict()
    s.total = (d and of(d, b.total_key, b.remote_total_key) or 0) + pool_waiting(b.pool) * b.avg
    local node, home = find(b.ring, point, skip, s)
    local why = s.why
    s.tried = nil
    s.held = nil
    if not node then
        -- every node passed: chash's choice (failed nodes last)
        why = nil
        node = find(b.ring, point, skip_failed, tried)
        if not node then
            node = find(b.ring, point, skip_down, tried)
        end
    end
    if why and tried == nil and node ~= home then
        st.spill = why
        spills(1, b.pool, home.id)
    end
    if node then
        account(b, st, node, tried)
    end
    if not b.home_is_ring then
        home = peers.home(b, point)
    end
    return node, home
end

--- balance(b): balancer_by_lua for one try of the request
function _M.balance(b)
    return peers.balance(_M, b)
end

return _M
