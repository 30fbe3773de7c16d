-- Balancer-phase cost of issue 11 item 4 (kvgate.balancer.peers: breakers, p2c) beside the
-- picks it sits next to. Not a test (the runner picks up test_*.lua only). Run from the repo
-- root:
--   luajit tests/lua/bench_failover.lua
-- 4 nodes at weight=100. The shared dicts are Lua tables here (nginx's are C: a get is about
-- 0.1 us more), the engine reports one table lookup (kvgate.node_load's view). Best of 5
-- runs, in microseconds per call.
package.path = "./lua/?.lua;" .. package.path
local store = {}
local dict = {
    get = function(_, k) return store[k] end,
    set = function(_, k, v) store[k] = v return true end,
    incr = function(_, k, v, init) store[k] = (store[k] or init) + v return store[k] end,
    add = function(_, k, v) if store[k] ~= nil then return false end store[k] = v return true end,
    delete = function(_, k) store[k] = nil end,
}
_G.ngx = { var = {}, ctx = {}, shared = { kvgate_state = dict }, log = function() end, ERR = 3, WARN = 4,
           now = function() return 1000 end, crc32_long = function() return 1 end }
package.loaded["ngx.balancer"] = {}
local peers = require "kvgate.balancer.peers"
local chash = require "kvgate.balancer.chash"
local node_load = require "kvgate.node_load"
local inflight = require "kvgate.inflight"
inflight.count = function() return 0 end

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

local nodes = {}
for i = 1, 4 do
    nodes[i] = { id = "node-" .. i, address = "127.0.0.1:" .. (9000 + i), weight = 100 }
end
local b = assert(chash.new({ name = "p", nodes = nodes }))
local rrb = assert(chash.new({ name = "p", nodes = nodes, failover = { keyless = "round_robin" } }))
for i, node in ipairs(b.nodes) do
    node.lat = 0.05 * i
end
local N = 1000000
bench("keyless, round robin (peers.rr: the balancer's own)", N, function()
    return peers.rr(rrb.nodes, nil, peers.skip_failed)
end)
bench("keyless, p2c, no engine reports (in-flight counts)", N, function()
    return peers.p2c(b, nil)
end)
local view = { waiting = 4 }
for i = 1, 4 do
    view["node-" .. i] = { waiting = i, running = 2, kv_use = 0.5 }
end
node_load.set_view("p", view)
bench("keyless, p2c, with engine reports", N, function()
    return peers.p2c(b, nil)
end)
bench("header filter: peers.answered (200, breaker closed)", N, function()
    return peers.answered(b, "node-2", 200)
end)
bench("keyed pick (chash.pick, for scale)", N, function(i)
    return chash.pick(b, { point = (i * 2654435761) % 4294967296 }, nil)
end)
