-- Balancer-phase cost of the key's home (issue 10: every balancer logs the key's node on
-- the home ring) beside the pick it is added to. Not a test (the runner picks up test_*.lua
-- only). Run from the repo root:
--   luajit tests/lua/bench_home.lua
-- 4 nodes at weight=100 (64,000 points a ring), 1000 distinct keys; the key's CRC-32 with
-- zlib's crc32 through the FFI (nginx's ngx.crc32_long is C too). Best of 5 runs, in
-- microseconds per call.
local ffi = require "ffi"
package.path = "./lua/?.lua;" .. package.path
ffi.cdef [[ unsigned long crc32(unsigned long crc, const char *buf, unsigned int len); ]]
local z = ffi.load("z")
local function crc32_long(s)
    return tonumber(z.crc32(0, s, #s))
end
_G.ngx = { var = {}, ctx = {}, shared = {}, crc32_long = crc32_long, log = function() end, ERR = 3, WARN = 4 }
package.loaded["ngx.balancer"] = {}
local peers = require "kvgate.balancer.peers"
local chash = require "kvgate.balancer.chash"
local rr = require "kvgate.balancer.round_robin"
local lc = require "kvgate.balancer.least_conn"
local inflight = require "kvgate.inflight"
inflight.count = function() return 0 end

local N = 1000
local keys, points = {}, {}
for i = 1, N do
    keys[i] = "s:session-" .. i .. "-8b7d-4c3a-9e21"
    points[i] = crc32_long(keys[i])
end

local function bench(name, n, fn)
    for i = 1, math.min(n, 20000) do
        fn(i)
    end
    local best = math.huge
    for _ = 1, 5 do
        local t = os.clock()
        for i = 1, n do
            fn(i)
        end
        best = math.min(best, (os.clock() - t) / n * 1e6)
    end
    print(string.format("%-64s %8.3f us", name, best))
end

local function pool(ws, hws)
    local nodes, prt = {}, { nodes = {} }
    for i, w in ipairs(ws) do
        local id = "node-" .. i
        nodes[i] = { id = id, address = "127.0.0.1:" .. (9000 + i), weight = 100 }
        prt.nodes[id] = { weight = w, state = w > 0 and "active" or "drained", home_weight = hws and hws[i] }
    end
    return { name = "p", nodes = nodes }, prt
end

local steady = assert(chash.new(pool({ 100, 100, 100, 100 })))
local drained = assert(chash.new(pool({ 100, 0, 100, 100 }, { 100, 100, 100, 100 })))
local rrb = assert(rr.new(pool({ 100, 100, 100, 100 })))
local lcb = assert(lc.new(pool({ 100, 100, 100, 100 })))
assert(steady.home_is_ring and not drained.home_is_ring)
peers.home(rrb, 1)
peers.home(lcb, 1)
peers.home(drained, 1)

local n = 1000000
local st = {}
local function pick_with(b, impl)
    return function(i)
        st.point = points[(i - 1) % N + 1]
        return impl.pick(b, st, nil)
    end
end
bench("crc32 of the route key (ngx.crc32_long stand-in: zlib, FFI)", n, function(i)
    return crc32_long(keys[(i - 1) % N + 1])
end)
bench("home ring lookup alone (peers.home)", n, function(i)
    return peers.home(drained, points[(i - 1) % N + 1])
end)
bench("chash pick, steady state (home = the routing lookup's)", n, pick_with(steady, chash))
bench("chash pick, a node drained (routing lookup + home lookup)", n, pick_with(drained, chash))
bench("round_robin pick, no key (no home)", n, function()
    st.point = nil
    return rr.pick(rrb, st, nil)
end)
bench("round_robin pick + home lookup (keyed)", n, pick_with(rrb, rr))
bench("least_conn pick, no key (no home; counts stubbed)", n, function()
    st.point = nil
    return lc.pick(lcb, st, nil)
end)
bench("least_conn pick + home lookup (keyed; counts stubbed)", n, pick_with(lcb, lc))
