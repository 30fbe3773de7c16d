-- Helper of `kvgate bench render` (control/kvgate/bench/render.py), not a test: times, under
-- plain luajit, what the gateway's init_by_lua does with a rendered config (kvgate.phase.init:
-- config.init() reads conf/kvgate.json and conf/runtime.json and checks the runtime, then
-- balancer.init(cfg) builds every pool's balancer: the chash rings), with stand-ins for the
-- ngx API those two touch (shared dicts as Lua tables, the prefix, crc32_long, log).
--   luajit render_ring.lua LUA_DIR PREFIX ROUNDS SINGLE_NODES
-- PREFIX holds conf/kvgate.json and conf/runtime.json; SINGLE_NODES > 0 also times one ring of
-- that many nodes at weight=100 (ring.new alone). Prints one JSON object:
-- {"config_init_ms": [...], "balancer_init_ms": [...], "single_ring_ms": [...], the same with
--  _cpu_ms (os.clock), "points": N, "pools": P, "single_points": M}.
local lua_dir, prefix, rounds, single = arg[1], arg[2], tonumber(arg[3]) or 3, tonumber(arg[4]) or 0
package.path = lua_dir .. "/?.lua;" .. package.path
local ffi = require "ffi"
-- kvgate.hash resolves SHA256_* through ffi.C: nginx links libcrypto, plain luajit does not
if not pcall(ffi.load, "libcrypto.so.3", true) then
    pcall(ffi.load, "crypto", true)
end
ffi.cdef [[
typedef long time_t;
typedef struct { time_t tv_sec; long tv_nsec; } kvg_timespec;
int clock_gettime(int clk, kvg_timespec *ts);
]]
local ts = ffi.new("kvg_timespec")
local function now_ms()
    ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) * 1e3 + tonumber(ts.tv_nsec) / 1e6
end

local function dict()
    local t = {}
    local d = {}
    function d.get(_, k) return t[k] end
    function d.set(_, k, v) t[k] = v return true end
    function d.safe_set(_, k, v) t[k] = v return true end
    function d.add(_, k, v)
        if t[k] ~= nil then return false, "exists" end
        t[k] = v
        return true
    end
    function d.delete(_, k) t[k] = nil end
    function d.incr(_, k, v, init)
        local cur = t[k]
        if cur == nil then
            if init == nil then return nil, "not found" end
            cur = init
        end
        t[k] = cur + v
        return cur + v
    end
    function d.get_keys()
        local out = {}
        for k in pairs(t) do out[#out + 1] = k end
        return out
    end
    function d.flush_all() t = {} end
    return d
end

local ring = require "kvgate.balancer.ring"
local shared = {}
for _, name in ipairs({ "kvgate_config", "kvgate_metrics", "kvgate_state", "kvgate_auth", "kvgate_inflight",
                        "kvgate_load", "kvgate_node_load", "kvgate_prefix", "kvgate_reqlog" }) do
    shared[name] = dict()
end
_G.ngx = {
    shared = shared, ctx = {}, var = {}, crc32_long = ring.crc32,
    config = { prefix = function() return prefix end },
    log = function() end, now = function() return os.time() end, time = os.time,
    ERR = 3, WARN = 4, INFO = 7, DEBUG = 8,
    worker = { pid = function() return 0 end },
    timer = { every = function() return true end, at = function() return true end },
}
package.loaded["ngx.balancer"] = {}
-- config.init requires the push handler last (nginx's request API): not needed here
package.loaded["kvgate.config_api"] = {}
local config = require "kvgate.config"
local balancer = require "kvgate.balancer"

-- wall (CLOCK_MONOTONIC) and CPU (os.clock) milliseconds of each step
local out = { config_init_ms = {}, balancer_init_ms = {}, single_ring_ms = {}, config_init_cpu_ms = {},
              balancer_init_cpu_ms = {}, single_ring_cpu_ms = {} }
for r = 1, rounds do
    shared.kvgate_config.flush_all()
    collectgarbage()
    local t0, c0 = now_ms(), os.clock()
    local cfg = assert(config.init())
    local t1, c1 = now_ms(), os.clock()
    assert(balancer.init(cfg))
    local t2, c2 = now_ms(), os.clock()
    out.config_init_ms[r] = t1 - t0
    out.balancer_init_ms[r] = t2 - t1
    out.config_init_cpu_ms[r] = (c1 - c0) * 1000
    out.balancer_init_cpu_ms[r] = (c2 - c1) * 1000
    local points, pools = 0, 0
    for name in pairs(cfg.pools) do
        pools = pools + 1
        local b = balancer.instance(name)
        if b and b.ring then
            points = points + b.ring.n
        end
        if b and b.home_ring and b.home_ring ~= b.ring then
            points = points + b.home_ring.n
        end
    end
    out.points, out.pools = points, pools
end
if single > 0 then
    local nodes = {}
    for i = 1, single do
        nodes[i] = { id = string.format("n%04d", i), weight = 100 }
    end
    for r = 1, rounds do
        collectgarbage()
        local t0, c0 = now_ms(), os.clock()
        local rg = assert(ring.new(nodes))
        out.single_ring_ms[r] = now_ms() - t0
        out.single_ring_cpu_ms[r] = (os.clock() - c0) * 1000
        out.single_points = rg.n
    end
end
local cjson = require "cjson"
io.write(cjson.encode(out), "\n")
