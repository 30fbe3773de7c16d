-- The prefix balancer: a request goes to the eligible node that holds the longest leading
-- part of its prompt, by the pool's approximate prefix index (kvgate.prefix_index: chained
-- chunk hashes of the canonical prompt -> nodes that recently computed them), so no
-- `prefix_chars` window has to be tuned. Runs in balancer_by_lua (kvgate.balancer.balance);
-- tries, failure marks and the in-flight count are kvgate.balancer.peers', the ring and the
-- home ring kvgate.balancer.chash's (this instance is a chash instance plus the index).
--
-- First try of a request:
--   1. start: the chain of the request's canonical prompt (kvgate.prefix_index.prepare: ~19 us
--      of hashing for 48 KB, no allocation; tests/lua/bench_prefix.lua), the route key's point.
--   2. pick: for every node taking traffic (not down, failed or tried) its matched depth
--      (chunks it still holds) and its load (bytes of uncached prompt it was given over the
--      last LOAD_WINDOW_S, a sliding window across every worker). A node is eligible while
--      load < bound × (pool's load + this request's uncached bytes there) × weight ÷
--      total weight (bounded loads, Mirrokni et al. SODA 2018; bound = the pool's
--      bound_factor, DEFAULT_BOUND without one). The eligible node with the longest match
--      wins; ties and no match walk the ring to the first eligible (tied) node, from the point
--      of the session/user key when the client sent one, else of the request's first chunk
--      that no node holds (the part of the prompt that tells this conversation from the
--      others that share its system prompt: the window, found per request).
--   3. record: the picked node's chain goes into the index (shared-dict writes, allowed in
--      balancer_by_lua) and its uncached bytes into its load.
-- A retry (failover) goes to the key's next node on the ring, as chash's; a request with no
-- prompt (or no full chunk) is chash's.
-- TODO(issue 11): eligibility from kvgate.balancer.chash_bounded (in-flight prefill work and
-- the engines' queues) once it lands; the window load here stands in for it.
local chash = require "kvgate.balancer.chash"
local peers = require "kvgate.balancer.peers"
local ring = require "kvgate.balancer.ring"
local index_mod = require "kvgate.prefix_index"

local ngx = ngx
local find = ring.find
local skip_failed = peers.skip_failed
local prepare = index_mod.prepare
local match = index_mod.match
local record = index_mod.record
local chain_point = index_mod.point
local floor = math.floor
local tonumber = tonumber
local ipairs = ipairs
local crc32_long = ngx.crc32_long

local _M = {}

_M.NAME = "prefix"
_M.DEFAULT_BOUND = 1.25
-- the load's sliding window (seconds): two slots of this length, the older one weighted by
-- the part of it still inside the window
_M.LOAD_WINDOW_S = 4

--- new(pool, prt, prev) -> balancer | nil, err (see kvgate.balancer.peers); pool.prefix_index:
-- the index's settings (kvgate.prefix_index.new), pool.bound_factor: the load bound
function _M.new(pool, prt, prev)
    local b, err = chash.new(pool, prt, prev)
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
    local bound = tonumber(pool.bound_factor) or _M.DEFAULT_BOUND
    b.bound = bound > 1 and bound or _M.DEFAULT_BOUND
    for _, node in ipairs(b.nodes) do
        local old = prev and prev.by_id and prev.by_id[node.id]
        node.pfx = old and old.pfx or index_mod.slot(idx, node.id)
        node.lkeys = old and old.lkeys or { "l:" .. pool.name .. ":" .. node.id .. ":0",
                                            "l:" .. pool.name .. ":" .. node.id .. ":1" }
        node.depth, node.oldest, node.load, node.cost = 0, nil, 0, 0
        node.ok, node.tie = false, false
    end
    return b
end

--- start(b, st, kctx): the route key's point (chash's; the fingerprint's key when the route
-- stage left the prefix key unhashed) and the chain of the prompt (st.n chunks, st.chars bytes)
function _M.start(b, st, kctx)
    peers.start(b, st, kctx)
    local route = kctx.route
    local kind = route.kind
    if not st.point and kind == "prefix" and route.fp then
        st.point = crc32_long("p:" .. route.fp)
    end
    st.keyed = kind == "session" or kind == "user"
    local r = kctx.req
    local req = r and r.parsed
    if req and b.index.dict then
        st.n, st.chars = prepare(b.index, req, r.endpoint)
    end
end

-- the load window's slot at `now`: parity of the current slot (1 or 2: lkeys index), the
-- older slot's weight, the current slot's key lifetime (to the end of the next slot)
local function slot(now)
    local w = _M.LOAD_WINDOW_S
    local s = floor(now / w)
    local frac = (now - s * w) / w
    return s % 2 + 1, 1 - frac, (s + 2) * w - now
end

local function load(d, node, cur, older_weight)
    local k = node.lkeys
    local a = tonumber(d:get(k[cur])) or 0
    local o = tonumber(d:get(k[3 - cur])) or 0
    return a + o * older_weight
end

local function skip_not_ok(node)
    return not node.ok
end

local function skip_not_tie(node)
    return not node.tie
end

--- held_tokens(b, st, node) -> prompt tokens of this request the node already holds by the
-- index (the discount of a load count in tokens); valid in the balancer call that ran start
function _M.held_tokens(b, st, node)
    local n = st.n
    if not n or n == 0 then
        return 0
    end
    return index_mod.held_tokens(b.index, (match(b.index, node.pfx, n)))
end

--- pick(b, st, tried) -> node, home | nil[, home]
function _M.pick(b, st, tried)
    local n = st.n
    if tried or not n or n == 0 then
        -- failover, or nothing to match: chash's walk from the route key
        return chash.pick(b, st, tried)
    end
    local idx = b.index
    local d = idx.dict
    local nodes = b.nodes
    local now = ngx.now()
    local cur, older_weight, ttl = slot(now)
    local chars, chunk = st.chars, idx.chunk
    local total_load, total_w, best, any = 0, 0, 0, false
    for i = 1, #nodes do
        local node = nodes[i]
        node.ok, node.tie = false, false
        if node.w > 0 and not skip_failed(node, tried) then
            local depth, oldest = match(idx, node.pfx, n)
            node.depth, node.oldest = depth, oldest
            node.cost = chars - depth * chunk
            node.load = load(d, node, cur, older_weight)
            total_load = total_load + node.load
            total_w = total_w + node.w
            any = true
        end
    end
    if not any then
        -- every node taking traffic failed: chash tries them again
        return chash.pick(b, st, tried)
    end
    local bound = b.bound
    for i = 1, #nodes do
        local node = nodes[i]
        if node.w > 0 and not skip_failed(node, tried) then
            -- a node under its bound takes the request, whatever its size (the continuous
            -- form of the paper's ceil(c × (m + 1) / n) balls: a request larger than a
            -- node's share still goes to an idle node)
            if node.load < bound * (total_load + node.cost) * node.w / total_w then
                node.ok = true
                if node.depth > best then
                    best = node.depth
                end
            end
        end
    end
    local point = st.point
    if not st.keyed or not point then
        point = chain_point(best < n and best or n - 1)
    end
    local node
    if best > 0 then
        local ties, last = 0, nil
        for i = 1, #nodes do
            local nd = nodes[i]
            if nd.ok and nd.depth == best then
                nd.tie = true
                ties = ties + 1
                last = nd
            end
        end
        node = ties == 1 and last or find(b.ring, point, skip_not_tie)
    else
        node = find(b.ring, point, skip_not_ok)
    end
    if not node then
        -- no node under the bound (uneven weights): chash's choice among the candidates
        node = find(b.ring, st.point or point, skip_failed)
        if not node then
            return chash.pick(b, st, tried)
        end
    end
    record(idx, node.pfx, n, node.depth, node.oldest)
    if node.cost > 0 then
        d:incr(node.lkeys[cur], node.cost, 0, ttl)
    end
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
