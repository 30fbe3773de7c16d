-- balancer/round_robin.lua, least_conn.lua and the shared try logic (balancer/peers.lua:
-- tries, failure marks, the in-flight count, kctx.balancer) against stand-ins for ngx
-- (ctx, shared dicts, exit) and ngx.balancer; the real thing runs in tests/integration.
local H = dofile("tests/lua/helper.lua")
local ring = require "kvgate.balancer.ring"

local now = 0
local function new_dict()
    local store = {}
    local d = {}
    function d.get(_, k)
        local e = store[k]
        if e and (not e.exp or e.exp > now) then
            return e.v
        end
        return nil
    end
    function d.set(_, k, v, ttl)
        store[k] = { v = v, exp = ttl and ttl > 0 and now + ttl or nil }
        return true
    end
    function d.add(self, k, v, ttl)
        if self:get(k) ~= nil then
            return false, "exists"
        end
        return self:set(k, v, ttl)
    end
    function d.delete(_, k)
        store[k] = nil
    end
    function d.incr(self, k, v, init)
        local cur = self:get(k)
        if cur == nil then
            if init == nil then
                return nil, "not found"
            end
            cur = init
        end
        self:set(k, cur + v)
        return cur + v
    end
    function d.get_keys()
        local out = {}
        for k in pairs(store) do
            out[#out + 1] = k
        end
        return out
    end
    function d.reset()
        store = {}
    end
    return d
end
local state, inflight_dict = new_dict(), new_dict()
_G.ngx = {
    var = {}, ctx = {}, shared = { kvgate_state = state, kvgate_inflight = inflight_dict },
    crc32_long = ring.crc32,
    log = function() end, WARN = 4, ERR = 3,
    exit = function(code) return "exit", code end,
}
local B = { peer = nil, more = nil, failure = nil }
package.loaded["ngx.balancer"] = {
    set_current_peer = function(host, port)
        B.peer = port and (host .. ":" .. port) or host
        return true
    end,
    set_more_tries = function(n)
        B.more = n
        return true
    end,
    get_last_failure = function()
        return B.failure
    end,
}
local peers = require "kvgate.balancer.peers"
local rr = require "kvgate.balancer.round_robin"
local lc = require "kvgate.balancer.least_conn"
local chash = require "kvgate.balancer.chash"
local inflight = require "kvgate.inflight"

local KEY -- the route key of the next request (where the route stage leaves it)

local function pool(weights)
    local nodes, prt = {}, { nodes = {} }
    for i, w in ipairs(weights) do
        local id = string.char(96 + i) -- a, b, c, ...
        nodes[i] = { id = id, address = "127.0.0.1:" .. (9000 + i) }
        prt.nodes[id] = { weight = w, state = w > 0 and "active" or "down" }
    end
    return { name = "p", nodes = nodes }, prt
end

local function id_of(peer)
    return string.char(96 + tonumber(peer:match(":(%d+)$")) - 9000)
end

-- one request: first try, then one retry per failure ("failed"/"next"); -> ids tried; the
-- request's context stays in ngx.ctx (for the in-flight checks) until the next request
local function request(impl, b, failures, keep)
    if not keep then
        ngx.ctx = {}
    end
    require("kvgate.ctx").get().route.key = KEY
    local out = {}
    for t = 1, 1 + #(failures or {}) do
        B.failure = t > 1 and failures[t - 1] or nil
        B.peer = nil
        if impl.balance(b) == "exit" then
            out[#out + 1] = "busy"
            break
        end
        out[#out + 1] = id_of(B.peer)
    end
    return out
end

local function reset()
    state.reset()
    inflight_dict.reset()
    now = 0
    B.more = nil
end

H.test("round_robin: nginx's smooth weighted sequence (5, 1, 1 -> a a b a c a a)", function()
    reset()
    local b = assert(rr.new(pool({ 5, 1, 1 })))
    local seq = {}
    for i = 1, 14 do
        seq[i] = request(rr, b)[1]
        inflight.finish()
    end
    H.eq(table.concat(seq, " "), "a a b a c a a a a b a c a a")
    H.eq(ngx.ctx.kvgate.balancer.node, "a")
    -- no key: no home (issue 10: the home is the key's node on the home ring, logged "")
    H.eq(ngx.ctx.kvgate.balancer.home, nil)
end)

H.test("round_robin: weight 0 skipped; a failed node skipped by every worker; all failed -> tried again", function()
    reset()
    local p, prt = pool({ 1, 1, 0 })
    local b = assert(rr.new(p, prt))
    local counts = {}
    for _ = 1, 20 do
        local got = request(rr, b)[1]
        counts[got] = (counts[got] or 0) + 1
    end
    H.eq(counts.a, 10)
    H.eq(counts.b, 10)
    H.eq(counts.c, nil)
    -- a fails: the retry goes to b, then a is skipped here at once and elsewhere after a refresh
    local tried
    repeat
        tried = request(rr, b, { "failed" })
    until tried[1] == "a"
    H.eq(tried[2], "b")
    H.eq(request(rr, b)[1], "b")
    H.eq(request(rr, b)[1], "b")
    local other = assert(rr.new(p, prt))
    peers.refresh(other)
    H.eq(request(rr, other)[1], "b")
    H.eq(request(rr, other)[1], "b")
    -- every node failed: tried again
    peers.mark_failed(b, b.by_id.b)
    local got = request(rr, b)[1]
    H.truthy(got == "a" or got == "b", got)
end)

H.test("least_conn: fewest in flight per unit of weight (all workers' counts), ties round robin", function()
    reset()
    local p, prt = pool({ 100, 100, 200 })
    local b = assert(lc.new(p, prt))
    -- every request stays in flight: counts a, b, c go 0,0,0 -> picks spread by inflight/weight
    local picks = {}
    local ctxs = {}
    for i = 1, 8 do
        picks[i] = request(lc, b)[1]
        ctxs[i] = ngx.ctx
    end
    local n = { a = 0, b = 0, c = 0 }
    for _, id in ipairs(picks) do
        n[id] = n[id] + 1
    end
    -- c has twice the weight: twice the requests
    H.eq(n.a, 2)
    H.eq(n.b, 2)
    H.eq(n.c, 4)
    H.eq(inflight.count(inflight.key("p", "c")), 4)
    -- the first three picks: all at 0 -> ties by weighted round robin (c first, its weight is largest)
    H.eq(picks[1], "c")
    -- another worker's requests count too: 10 on c -> the next go to a and b
    inflight_dict:incr(inflight.key("p", "c"), 10, 0)
    local got = {}
    for i = 1, 4 do
        got[i] = request(lc, b)[1]
    end
    table.sort(got)
    H.eq(table.concat(got, ""), "aabb")
    -- finishing releases the count
    for _, c in ipairs(ctxs) do
        ngx.ctx = c
        inflight.finish()
        inflight.finish() -- twice: once only
    end
    H.eq(inflight.count(inflight.key("p", "c")), 10)
end)

H.test("least_conn: weight 0 never picked; failed skipped; a retry moves the in-flight count", function()
    reset()
    local p, prt = pool({ 100, 100, 0 })
    local b = assert(lc.new(p, prt))
    local tried = request(lc, b, { "failed" })
    H.ne(tried[1], tried[2])
    H.ne(tried[2], "c")
    local first, second = tried[1], tried[2]
    H.eq(inflight.count(inflight.key("p", first)), 0)
    H.eq(inflight.count(inflight.key("p", second)), 1)
    inflight.finish()
    H.eq(inflight.count(inflight.key("p", second)), 0)
    -- the failed node is skipped although it has fewer in flight
    inflight_dict:incr(inflight.key("p", second), 5, 0)
    H.eq(request(lc, b)[1], second)
end)

H.test("tries: a pool with one node taking traffic gets no retry (its own 502/503 reaches the client)", function()
    reset()
    local p, prt = pool({ 0, 100, 0 })
    for _, impl in ipairs({ rr, lc, chash }) do
        B.more = nil
        local b = assert(impl.new(p, prt))
        KEY = "s:x"
        request(impl, b)
        H.eq(B.more, -2, impl.NAME) -- 3 server lines -> 1 try
    end
    -- two or more nodes taking traffic: nginx's own tries (capped at 2) stay
    B.more = nil
    local p2, prt2 = pool({ 100, 100, 0 })
    request(rr, assert(rr.new(p2, prt2)))
    H.eq(B.more, nil)
    -- none: busy (502)
    local p3, prt3 = pool({ 0, 0 })
    H.eq(request(rr, assert(rr.new(p3, prt3)))[1], "busy")
    H.eq(request(lc, assert(lc.new(p3, prt3)))[1], "busy")
end)

H.test("chash: weights from the runtime; a rebuild with the same ring weights reuses the ring", function()
    reset()
    local p, prt = pool({ 100, 300, 100 })
    local b = assert(chash.new(p, prt))
    for i = 1, 200 do
        local key = "s:k" .. i
        KEY = key
        local home = ring.home(b.ring, ring.crc32(key)).id
        H.eq(request(chash, b)[1], home)
        H.eq(ngx.ctx.kvgate.balancer.home, home)
        H.eq(ngx.ctx.kvgate.balancer.node, home)
    end
    -- only a state changes: same ring (no rebuild of 80,000 points)
    prt.nodes.a.state = "draining"
    local b2 = assert(chash.new(p, prt, b))
    H.eq(b2.ring.hashes, b.ring.hashes)
    H.eq(b2.ring.nodes[1], b2.by_id.a)
    -- a weight 0: a keeps its place (ring weight 1: a new ring), is skipped; home stays a
    prt.nodes.a.weight = 0
    local b3 = assert(chash.new(p, prt, b2))
    H.ne(b3.ring.hashes, b.ring.hashes)
    for i = 1, 400 do
        local key = "s:k" .. i
        KEY = key
        local got = request(chash, b3)[1]
        H.ne(got, "a")
        H.eq(ngx.ctx.kvgate.balancer.home, ring.home(b3.ring, ring.crc32(key)).id)
    end
    -- a failure view survives a rebuild in this worker
    peers.mark_failed(b3, b3.by_id.b)
    local b4 = assert(chash.new(p, prt, b3))
    H.eq(b4.by_id.b.failed, true)
end)

-- the oracle of a key's home: a fresh ring of every node at its home weight
local function oracle(weights)
    local nodes = {}
    for id, w in pairs(weights) do
        nodes[#nodes + 1] = { id = id, weight = w }
    end
    return assert(ring.new(nodes))
end

H.test("home: chash's steady state is one ring, one lookup; a drained node's keys stay homed on it", function()
    reset()
    local p, prt = pool({ 100, 300, 100 })
    local b = assert(chash.new(p, prt))
    H.truthy(b.home_is_ring)
    H.eq(b.home_ring, b.ring) -- no second ring
    for i = 1, 100 do
        KEY = "s:h" .. i
        request(chash, b)
        H.eq(ngx.ctx.kvgate.balancer.home, ngx.ctx.kvgate.balancer.node)
    end
    -- b drained (weight 0) with its home weight 300 (its target): keys of b go elsewhere,
    -- but b stays their home; nobody else's home moves
    prt.nodes.b = { weight = 0, state = "draining", home_weight = 300 }
    local b2 = assert(chash.new(p, prt, b))
    H.eq(b2.home_is_ring, false)
    H.truthy(b2.home_ring and b2.home_ring ~= b2.ring) -- built with the instance, not in a request
    local want = oracle({ a = 100, b = 300, c = 100 })
    local moved = 0
    for i = 1, 300 do
        KEY = "s:h" .. i
        local got = request(chash, b2)[1]
        local home = ring.home(want, ring.crc32(KEY)).id
        H.ne(got, "b")
        H.eq(ngx.ctx.kvgate.balancer.home, home, KEY)
        if home == "b" then
            moved = moved + 1
        else
            H.eq(got, home, KEY)
        end
    end
    H.truthy(moved > 50 and moved < 250, "moved " .. moved)
    -- the home ring is kept by a rebuild that changes no home weight (a state change)
    local hr = b2.home_ring
    prt.nodes.b.state = "drained"
    local b3 = assert(chash.new(p, prt, b2))
    H.eq(b3.home_ring, hr)
    -- without home_weight (an older control plane): the weight, or the base weight when 0
    local p4, prt4 = pool({ 100, 0, 100 })
    p4.nodes[2].weight = 200
    local b4 = assert(chash.new(p4, prt4))
    H.eq(b4.by_id.b.hw, 200)
    H.eq(b4.by_id.a.hw, 100)
    want = oracle({ a = 100, b = 200, c = 100 })
    for i = 1, 100 do
        KEY = "s:o" .. i
        request(chash, b4)
        H.eq(ngx.ctx.kvgate.balancer.home, ring.home(want, ring.crc32(KEY)).id, KEY)
    end
    -- no key: round robin, no home
    KEY = nil
    request(chash, b4)
    H.eq(ngx.ctx.kvgate.balancer.home, nil)
end)

H.test("home: round_robin and least_conn log the key's home ring node, built at the first keyed request", function()
    for _, impl in ipairs({ rr, lc }) do
        reset()
        local p, prt = pool({ 100, 100, 100 })
        prt.nodes.c = { weight = 0, state = "drained", home_weight = 100 }
        local b = assert(impl.new(p, prt))
        KEY = nil
        for _ = 1, 5 do
            request(impl, b)
            H.eq(ngx.ctx.kvgate.balancer.home, nil, impl.NAME)
            inflight.finish()
        end
        H.eq(b.home_ring, nil, impl.NAME) -- keyless requests never build it
        local want = oracle({ a = 100, b = 100, c = 100 })
        local away, homed_c = 0, 0
        for i = 1, 90 do
            KEY = "s:r" .. i
            local got = request(impl, b)[1]
            inflight.finish()
            local home = ring.home(want, ring.crc32(KEY)).id
            H.eq(ngx.ctx.kvgate.balancer.home, home, impl.NAME .. " " .. KEY)
            H.ne(got, "c")
            away = away + (got ~= home and 1 or 0)
            homed_c = homed_c + (home == "c" and 1 or 0)
        end
        H.truthy(homed_c > 0 and away >= homed_c, impl.NAME) -- scattered against the home
        H.truthy(b.home_ring, impl.NAME)
        -- kept across a runtime that changes no home weight (a's weight changes, its home
        -- weight stays)
        prt.nodes.a.weight, prt.nodes.a.home_weight = 50, 100
        local b2 = assert(impl.new(p, prt, b))
        H.eq(b2.home_ring, b.home_ring, impl.NAME)
        prt.nodes.a.home_weight = 300
        local b3 = assert(impl.new(p, prt, b2))
        -- a new home weight: a new home ring, built with the instance (the pool's requests
        -- carry keys), the key's home from it
        H.truthy(b3.home_ring and b3.home_ring ~= b2.home_ring, impl.NAME)
        want = oracle({ a = 300, b = 100, c = 100 })
        KEY = "s:r1"
        request(impl, b3)
        inflight.finish()
        H.eq(ngx.ctx.kvgate.balancer.home, ring.home(want, ring.crc32(KEY)).id, impl.NAME)
        -- a pool that never had a keyed request still builds none
        local b4 = assert(impl.new(p, prt, assert(impl.new(p, prt))))
        H.eq(b4.home_ring, nil, impl.NAME)
        prt.nodes.a.weight, prt.nodes.a.home_weight = 100, nil
    end
    KEY = nil
end)

H.test("inflight: begin once per request, move on failover, finish once; older call forms", function()
    reset()
    ngx.ctx = {}
    inflight.begin(nil, "p", "a")
    inflight.begin(ngx.ctx, "p", "a") -- the header filter's: the same request, already counted
    H.eq(inflight.count(inflight.key("p", "a")), 1)
    inflight.move(ngx.ctx.kvgate.log, "p", "b")
    H.eq(inflight.count(inflight.key("p", "a")), 0)
    H.eq(inflight.count(inflight.key("p", "b")), 1)
    inflight.finish({}) -- another holder: nothing counted
    H.eq(inflight.count(inflight.key("p", "b")), 1)
    inflight.finish(ngx.ctx)
    inflight.finish()
    H.eq(inflight.count(inflight.key("p", "b")), 0)
    -- a release without a count never goes below 0
    inflight.release("p", "a")
    H.eq(inflight.count(inflight.key("p", "a")), 0)
end)

H.done()
