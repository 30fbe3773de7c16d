-- The prefix balancer: a request goes to the eligible node that holds the longest leading
-- part of its prompt, by the pool's approximate prefix index (kvgate.prefix_index: chained
-- chunk hashes of the canonical prompt -> nodes that recently computed them), so no
-- `prefix_chars` window has to be tuned. Runs in balancer_by_lua (kvgate.balancer.balance).
-- The instance is a chash_bounded instance (chash's ring and home ring, the bound's fields)
-- plus the index; eligibility, load and spills are chash_bounded's.
--
-- First try of a request:
--   1. start: chash_bounded's (the key's point, the estimated prompt tokens, the load's
--      holder), the chain of the request's canonical prompt (kvgate.prefix_index.prepare), and
--      per node taking traffic the chunks it still holds (st.held: the tokens chash_bounded's
--      load discounts, in its units: kvgate.balancer.load.BYTES_PER_TOKEN).
--   2. pick: a node is eligible when chash_bounded would let the request stay there (taking
--      traffic, not failed or tried, its engine's queue at most saturated_queue, in-flight
--      prefill work + this request's uncached tokens within bound_factor × its weighted share:
--      chash_bounded.eligible); the node that alone holds the longest match keeps it up to
--      STICKY_BOUND × its share ("sticky until saturated": a spill recomputes what it alone
--      holds; a part every node holds, a system prompt, gives no such right).
--      The eligible node with the longest match wins; a node ties with it when what it leaves
--      to compute is within TIE (10 %) and a chunk of the longest match's (a shared system
--      prompt held by 2 of 4 nodes is no reason to keep the other 2 idle). Ties (and no match:
--      every eligible node ties) of a request with a session or user key walk the ring from
--      the key's point to the first tied node (chash_bounded's choice among them); without
--      such a key they walk the ring to the first tied node loaded at most as much as the tied
--      nodes' mean (in-flight prefill per unit of weight: a tie is no cache reason to prefer a
--      node, so the request evens out the load), from the point of the request's first chunk
--      that no node holds (what tells this conversation from the others sharing its system
--      prompt: the window, found per request; a later turn whose history the index forgot
--      goes where the first went, while that node is not above the mean). A longest match
--      given up for the bound or the queue is a spill (kvgate_route_spill_total{node = the
--      node given up}).
--   3. record: the picked node's chain goes into the index (shared-dict writes, allowed in
--      balancer_by_lua), the request's tokens less what the node holds into its load.
-- A retry (failover), a request without a full chunk of prompt, and a pool without the
-- kvgate_prefix dict are chash_bounded's. Measured cost: tests/lua/bench_prefix.lua.
local chash_bounded = require "kvgate.balancer.chash_bounded"
local peers = require "kvgate.balancer.peers"
local ring = require "kvgate.balancer.ring"
local load = require "kvgate.balancer.load"
local node_load = require "kvgate.node_load"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"
local index_mod = require "kvgate.prefix_index"

local ngx = ngx
local find = ring.find
local skip_failed = peers.skip_failed
local prepare = index_mod.prepare
local match = index_mod.match
local record = index_mod.record
local chain_point = index_mod.point
local eligible = chash_bounded.eligible
local waiting = node_load.waiting
local pool_waiting = node_load.pool_waiting
local take = load.take
local tonumber = tonumber
local ipairs = ipairs
local crc32_long = ngx.crc32_long
local ffi_string = require("ffi").string
local chain_hashes = index_mod.hashes

local _M = {}

_M.NAME = "prefix"
-- the bound of the sole holder of the longest match (× its share of the pool's in-flight
-- prefill; the pool's bound_factor when that is looser). Demo replay, 2,000 requests at
-- bound_factor 1.25: the bound itself (1.25) spilled 54-63 continuations and kept 0.95 of
-- the pooled ceiling, 2.5 spilled 1 and kept 1.01, imbalance 1.02-1.03 either way.
_M.STICKY_BOUND = 2.5
local STICKY_BOUND = _M.STICKY_BOUND
-- nodes whose part of the prompt left to compute is within TIE of the longest match's (and a
-- chunk) tie with it: a few percent of prefill is no reason to pile requests on a node
_M.TIE = 0.1
local TIE = _M.TIE

local spills = metrics.counter(keys.METRICS.route_spill, { "pool", "node" })

local the_dict
local function load_dict()
    local d = the_dict
    if d == nil then
        d = ngx.shared[load.DICT] or false
        the_dict = d
    end
    return d
end

--- new(pool, prt, prev) -> balancer | nil, err (see kvgate.balancer.peers): chash_bounded's
-- instance plus the index (pool.prefix_index: kvgate.prefix_index.new's settings), kept with
-- each node's slot across runtimes
function _M.new(pool, prt, prev)
    local b, err = chash_bounded.new(pool, prt, prev)
    if not b then
        return nil, err
    end
    local idx
    if prev and prev.index and prev.index_opts == pool.prefix_index then
        idx = prev.index
    else
        idx, err = index_mod.new(pool.name, pool.prefix_index)
        if not idx then
            return nil, err
        end
    end
    b.index = idx
    b.index_opts = pool.prefix_index
    -- tokens per held chunk, in the load's units (its estimate of a body's tokens)
    b.chunk_tokens = idx.chunk / load.BYTES_PER_TOKEN
    -- st.held of the request in this worker's balancer call (no table per request: only the
    -- first try reads it, in the same call as start)
    b.held = {}
    for _, node in ipairs(b.nodes) do
        local old = prev and prev.by_id and prev.by_id[node.id]
        node.pfx = old and old.pfx or index_mod.slot(idx, node.id)
        node.depth, node.head, node.ok, node.tie = 0, nil, false, false
    end
    return b
end

--- start(b, st, kctx): chash_bounded's start, the chain of the prompt (st.n chunks), the
-- chunks each node taking traffic holds (node.depth) and the tokens that makes (st.held)
function _M.start(b, st, kctx)
    chash_bounded.start(b, st, kctx)
    local route = kctx.route
    local kind = route.kind
    if not st.point and kind == "prefix" and route.fp then
        st.point = crc32_long("p:" .. route.fp)
    end
    st.keyed = kind == "session" or kind == "user"
    local r = kctx.req
    local req = r and r.parsed
    local idx = b.index
    if not (req and idx.dict) then
        return
    end
    local n = prepare(idx, req, r.endpoint)
    st.n = n
    if n == 0 then
        return
    end
    -- the request log's block hashes are this chain (kvgate.usage.blocks): kept (8 bytes a
    -- chunk, 0.1 us) rather than computed again in the log phase (19 us for 48 KB); whole
    -- unless the index's max_chars cut the prompt
    st.chain, st.chain_whole = ffi_string(chain_hashes, 8 * n), n < idx.max_chunks
    local held, ct = b.held, b.chunk_tokens
    for _, node in ipairs(b.nodes) do
        local depth, head = 0, nil
        if node.w > 0 and not node.failed then
            depth, head = match(idx, node.pfx, n)
        end
        node.depth, node.head = depth, head
        held[node.id] = depth * ct
    end
    st.held = held
end

-- cost_at(cost, depth, ct) -> the tokens left to compute of a request of `cost` tokens on a
-- node holding `depth` chunks of ct tokens
local function cost_at(cost, depth, ct)
    local left = cost - depth * ct
    return left > 0 and left or 0
end

-- near(a, b, ct) -> true when computing a tokens is about as good as computing b (b <= a):
-- within TIE of b, and a chunk
local function near(a, b, ct)
    return a <= b * (1 + TIE) + ct
end

local function skip_not_tie(node)
    return not node.tie
end

--- held_tokens(b, st, node) -> prompt tokens of this request the node already holds by the
-- index, in the load's units; valid in the balancer call that ran start
function _M.held_tokens(b, st, node)
    local held = st.held
    return held and held[node.id] or 0
end

-- account(b, st, node, cost): the first try's load on node (chash_bounded's take and its mean
-- request estimate)
local function account(b, st, node, cost)
    local h = st.holder
    if not h then
        return
    end
    local c = st.cost
    local avg = b.avg
    b.avg = avg == 0 and c or avg + (c - avg) * chash_bounded.AVG_ALPHA
    take(h, node.load_key, b.total_key, cost)
end

--- pick(b, st, tried) -> node, home | nil[, home]
function _M.pick(b, st, tried)
    local n = st.n
    if tried or not n or n == 0 then
        -- failover, or nothing to match: chash_bounded's walk from the route key (a retry's
        -- held figures may be another request's: dropped)
        st.held = nil
        return chash_bounded.pick(b, st, tried)
    end
    local nodes = b.nodes
    local d = load_dict()
    local total = (d and load.of(d, b.total_key, b.remote_total_key) or 0) + pool_waiting(b.pool) * b.avg
    local c, W, sat, avg, cost0, ct = b.c, b.W, b.sat, b.avg, st.cost or 1, b.chunk_tokens
    local best, top, top_why = 0, nil, nil
    -- the deepest and second deepest match among the candidates: the deepest holds the
    -- longest match alone when the second leaves more than TIE more of the prompt to compute
    local d1, d2 = 0, 0
    for i = 1, #nodes do
        local node = nodes[i]
        if node.w > 0 and not skip_failed(node, tried) then
            local depth = node.depth
            if depth > d1 then
                d1, d2 = depth, d1
            elseif depth > d2 then
                d2 = depth
            end
        end
    end
    for i = 1, #nodes do
        local node = nodes[i]
        node.ok, node.tie = false, false
        if node.w > 0 and not skip_failed(node, tried) then
            local why
            local q = waiting(b.pool, node.id)
            if q and q > sat then
                why = "queue"
            else
                local l = d and load.of(d, node.load_key, node.remote_key) or 0
                if q then
                    l = l + q * avg
                end
                local cost = cost0 - node.depth * ct
                if cost < 0 then
                    cost = 0
                end
                node.cost = cost
                node.share = l / node.w
                -- sticky until saturated: the node that alone holds the longest match keeps the
                -- request up to STICKY_BOUND x its share (or the bound, if looser): a spill
                -- recomputes what it alone holds; a part every node holds, a system prompt,
                -- gives no such right
                local sole = node.depth == d1 and not near(cost_at(cost0, d2, ct), cost, ct)
                local cn = (sole and STICKY_BOUND > c) and STICKY_BOUND or c
                if not eligible(l, cost, total, cn, node.w, W) then
                    why = "bound"
                end
            end
            if not why then
                node.ok = true
                if node.depth > best then
                    best = node.depth
                end
            end
            if node.depth > 0 and (not top or node.depth > top.depth) then
                top, top_why = node, why
            end
        end
    end
    local keyed = st.keyed and st.point
    local point = keyed and st.point or chain_point(best < n and best or n - 1)
    -- the candidates: the eligible nodes whose part of the prompt left to compute is near the
    -- longest match's (within TIE of it, and a chunk), every eligible node when none matches;
    -- without a session/user key only those loaded at most as much as their mean (load per
    -- weight): a few percent of prefill is no cache reason to prefer a node (a shared system
    -- prompt held by two of four nodes would otherwise keep the other two idle), so the
    -- request evens out the load, and among those the ring from the request's own point keeps
    -- a conversation whose history the index forgot where its first turn went
    local best_cost = cost_at(cost0, best, ct)
    local limit
    if not keyed then
        local sum, cnt = 0, 0
        for i = 1, #nodes do
            local nd = nodes[i]
            if nd.ok and near(nd.cost, best_cost, ct) then
                sum, cnt = sum + nd.share, cnt + 1
            end
        end
        limit = cnt > 0 and sum / cnt or nil
    end
    local ties, last = 0, nil
    for i = 1, #nodes do
        local nd = nodes[i]
        if nd.ok and near(nd.cost, best_cost, ct) and (not limit or nd.share <= limit) then
            nd.tie = true
            ties = ties + 1
            last = nd
        end
    end
    local node
    if ties == 1 then
        node = last
    elseif ties > 1 then
        node = find(b.ring, point, skip_not_tie)
    end
    if not node then
        -- none eligible (every node saturated): chash_bounded's own fallback
        return chash_bounded.pick(b, st, tried)
    end
    if top and top_why and top.depth > node.depth then
        -- the longest match gave way to its bound or its engine's queue
        st.spill = top_why
        spills(1, b.pool, top.id)
    end
    record(b.index, node.pfx, n, node.depth, node.head)
    account(b, st, node, node.cost)
    st.depth = node.depth
    local home
    if st.point then
        home = peers.home(b, st.point)
    end
    return node, home
end

--- balance(b): balancer_by_lua for one try of the request
function _M.balance(b)
    return peers.balance(_M, b)
end

return _M
