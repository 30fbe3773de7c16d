-- Balancer-phase cost of chash_bounded's pick beside chash's (issue 11). Not a test (the
-- runner picks up test_*.lua only). Run from the repo root:
--   luajit tests/lua/bench_chash_bounded.lua
-- 4 nodes at weight=100 (64,000 points), 1000 distinct keys, the shared dict stood in by a
-- Lua table (a real lua_shared_dict get/incr is ~0.1-0.2 us more each: the nginx side by side
-- is `python -m kvgate.bench.balancer`). Best of 5 runs, in microseconds per call; each
-- bounded pick is followed by its release (load.finish), as the log phase does.
local ffi = require "ffi"
package.path = "./lua/?.lua;" .. package.path
ffi.cdef [[ unsigned long crc32(unsigned long crc, const char *buf, unsigned int len); ]]
local z = ffi.load("z")
local function crc32_long(s)
    return tonumber(z.crc32(0, s, #s))
end
local function dict()
    local t = {}
    return {
        get = function(_, k) return t[k] end,
        set = function(_, k, v) t[k] = v return true end,
        incr = function(_, k, v, init)
            local cur = t[k] or init
            t[k] = cur + v
            return cur + v
        end,
    }
end
_G.ngx = { var = {}, ctx = {}, shared = { kvgate_load = dict(), kvgate_metrics = dict() }, crc32_long = crc32_long,
           log = function() end, ERR = 3, WARN = 4 }
package.loaded["ngx.balancer"] = {}
local chash = require "kvgate.balancer.chash"
local cb = require "kvgate.balancer.chash_bounded"
local load = require "kvgate.balancer.load"

local N = 1000
local points = {}
for i = 1, N do
    points[i] = crc32_long("s:session-" .. i .. "-8b7d-4c3a-9e21")
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

local nodes, prt = {}, { nodes = {} }
for i = 1, 4 do
    nodes[i] = { id = "node-" .. i, address = "127.0.0.1:" .. (9000 + i) }
    prt.nodes["node-" .. i] = { weight = 100, state = "active" }
end
local p = { name = "p", nodes = nodes }
local c = assert(chash.new(p, prt))
local b = assert(cb.new(p, prt))
local st = {}
bench("chash.pick", 1000000, function(i)
    st.point = points[i % N + 1]
    chash.pick(c, st, nil)
end)
local h = {}
local bst = { cost = 500, holder = h }
bench("chash_bounded.pick + load.finish, idle pool (every key home)", 1000000, function(i)
    bst.point = points[i % N + 1]
    cb.pick(b, bst, nil)
    load.finish(h)
end)
-- a loaded pool: 64 requests held, spread as the bound spreads them, then each pick walks
local held = {}
for i = 1, 64 do
    held[i] = {}
    cb.pick(b, { point = points[1], cost = 500, holder = held[i] }, nil)
end
bench("chash_bounded.pick + load.finish, 64 of one key in flight", 1000000, function(i)
    bst.point = points[i % N + 1]
    cb.pick(b, bst, nil)
    load.finish(h)
end)
bench("chash_bounded.pick + load.finish, that hot key (walks)", 1000000, function()
    bst.point = points[1]
    cb.pick(b, bst, nil)
    load.finish(h)
end)
