-- balancer/chash_bounded.lua (the bound's arithmetic, the ring walk, spills, the load's
-- take/move/finish) and node_load.lua (report values, staleness) against stand-ins for ngx;
-- the real thing runs in tests/integration/test_gateway_chash_bounded.py.
local H = dofile("tests/lua/helper.lua")
local ring = require "kvgate.balancer.ring"

local function new_dict()
    local store = {}
    local d = {}
    function d.get(_, k) return store[k] end
    function d.set(_, k, v) store[k] = v return true end
    function d.delete(_, k) store[k] = nil end
    function d.incr(_, k, v, init)
        local cur = store[k]
        if cur == nil then
            if init == nil then return nil, "not found" end
            cur = init
        end
        store[k] = cur + v
        return cur + v
    end
    function d.get_keys()
        local out = {}
        for k in pairs(store) do out[#out + 1] = k end
        return out
    end
    function d.reset() store = {} end
    return d
end
local state, inflight_dict, load_dict, metrics_dict = new_dict(), new_dict(), new_dict(), new_dict()
_G.ngx = {
    var = {}, ctx = {},
    shared = { kvgate_state = state, kvgate_inflight = inflight_dict, kvgate_load = load_dict,
               kvgate_metrics = metrics_dict },
    crc32_long = ring.crc32,
    log = function() end, WARN = 4, ERR = 3,
    exit = function(code) return "exit", code end,
}
local B = { peer = nil, failure = nil }
package.loaded["ngx.balancer"] = {
    set_current_peer = function(host, port) B.peer = port and (host .. ":" .. port) or host return true end,
    set_more_tries = function() return true end,
    get_last_failure = function() return B.failure end,
}
local cb = require "kvgate.balancer.chash_bounded"
local chash = require "kvgate.balancer.chash"
local load = require "kvgate.balancer.load"
local node_load = require "kvgate.node_load"
local kvctx = require "kvgate.ctx"

local function pool(weights, extra)
    local nodes, prt = {}, { nodes = {} }
    for i, w in ipairs(weights) do
        local id = "n" .. i
        nodes[i] = { id = id, address = "127.0.0.1:" .. (9000 + i) }
        prt.nodes[id] = { weight = w, state = w > 0 and "active" or "down" }
    end
    for k, v in pairs(extra or {}) do prt[k] = v end
    return { name = "p", nodes = nodes }, prt
end

local function id_of(peer)
    return "n" .. (tonumber(peer:match(":(%d+)$")) - 9000)
end

-- one request with key and body of `bytes`: first try plus one retry per failure; -> ids,
-- its kctx (held in flight until finish(kctx.log))
local function request(impl, b, key, bytes, failures)
    ngx.ctx = {}
    local kctx = kvctx.get()
    kctx.route.key = key
    kctx.req.body = string.rep("x", bytes or 400)
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
    return out, kctx
end

local function reset()
    state.reset(); inflight_dict.reset(); load_dict.reset(); metrics_dict.reset()
    node_load.set_view("p", nil)
end

local function total() return load.get(load.total_key("p")) end
local function on(id) return load.get(load.key("p", id)) end

H.test("eligible: load < c x (total + cost) x w / W (the paper's ceil rule for whole balls)", function()
    -- 4 equal nodes, c 1.25: a node may hold 1.25 x a quarter of the pool's work
    H.truthy(cb.eligible(0, 100, 0, 1.25, 1, 4), "empty pool: the first request fits its home")
    H.truthy(not cb.eligible(100, 100, 100, 1.25, 1, 4), "ceil(1.25 x 2 / 4) = 1 request: a second spills")
    -- equal requests are the paper's balls: j + 1 <= ceil(c (m + 1) / n)
    for _, c in ipairs({ 1.1, 1.25, 1.5, 2 }) do
        for m = 0, 40 do
            for j = 0, m do
                H.eq(cb.eligible(j * 100, 100, m * 100, c, 1, 4), j + 1 <= math.ceil(c * (m + 1) / 4),
                    "c " .. c .. " m " .. m .. " j " .. j)
            end
        end
    end
    H.truthy(cb.eligible(300, 100, 900, 1.25, 1, 4)) -- 300 < 312.5
    H.truthy(not cb.eligible(320, 100, 900, 1.25, 1, 4))
    -- weights: a node of weight 3 in W = 4 may hold 3/4 x c of it
    H.truthy(cb.eligible(930, 100, 900, 1.25, 3, 4)) -- 930 < 937.5
    H.truthy(not cb.eligible(940, 100, 900, 1.25, 3, 4))
    -- a big request on an idle or lightly loaded home: taken (judged by what the node holds)
    H.truthy(cb.eligible(0, 10000, 500, 1.25, 1, 4))
    H.truthy(cb.eligible(400, 10000, 1000, 1.25, 1, 4))
end)

H.test("no load: every key on chash's node; the same homes", function()
    reset()
    local p, prt = pool({ 100, 100, 100, 100 })
    local b = assert(cb.new(p, prt))
    local c = assert(chash.new(p, prt))
    for i = 1, 200 do
        local key = "k" .. i
        local got, kctx = request(cb, b, key)
        local want = ring.home(c.ring, ring.crc32(key)).id
        H.eq(got[1], want, key)
        H.eq(kctx.balancer.spill, nil)
        load.finish(kctx.log)
    end
    H.eq(total(), 0)
end)

H.test("hot key: held requests walk the ring past an over-bound home; spill counted and kept", function()
    reset()
    local p, prt = pool({ 100, 100, 100, 100 }, { bound_factor = 1.25 })
    local b = assert(cb.new(p, prt))
    local r = ring.new({ { id = "n1", weight = 100 }, { id = "n2", weight = 100 }, { id = "n3", weight = 100 },
                         { id = "n4", weight = 100 } })
    local walk = ring.walk(r, ring.crc32("hot"))
    local held, per = {}, {}
    for i = 1, 40 do
        local got, kctx = request(cb, b, "hot", 400)
        held[i] = kctx
        per[got[1]] = (per[got[1]] or 0) + 1
    end
    -- the first request went home, none was ever over 1.25 x the mean
    H.eq(held[1].balancer.node, walk[1].id)
    H.eq(held[1].balancer.spill, nil)
    H.eq(held[2].balancer.spill, "bound")
    H.eq(held[2].balancer.node, walk[2].id, "the key's next node on the ring")
    local mean = total() / 4
    for _, node in ipairs({ "n1", "n2", "n3", "n4" }) do
        H.truthy(on(node) <= 1.25 * mean + 101, node .. " holds " .. on(node) .. " of mean " .. mean)
        H.truthy((per[node] or 0) > 0, node .. " got none")
    end
    H.eq(total(), 40 * load.estimate(400 + 0))
    local spilled = metrics_dict:get('kvgate_route_spill_total{node="' .. walk[1].id .. '",pool="p"}')
    H.truthy(spilled and spilled > 10, "spills counted on the home: " .. tostring(spilled))
    for i = 1, 40 do load.finish(held[i].log) end
    H.eq(total(), 0)
    for _, node in ipairs({ "n1", "n2", "n3", "n4" }) do H.eq(on(node), 0, node) end
end)

H.test("load: moved by a failover, released once, never below 0", function()
    reset()
    local p, prt = pool({ 100, 100, 100 })
    local b = assert(cb.new(p, prt))
    local got, kctx = request(cb, b, "k1", 800, { "failed" })
    H.eq(#got, 2)
    H.ne(got[1], got[2])
    H.eq(on(got[1]), 0, "moved off the failed node")
    H.eq(on(got[2]), load.estimate(800))
    H.eq(total(), load.estimate(800))
    load.finish(kctx.log)
    load.finish(kctx.log) -- the log phase after @kvgate_upstream_error's release: no double count
    H.eq(total(), 0)
    H.eq(on(got[2]), 0)
    -- a release without its take clamps at 0
    load_dict:set(load.key("p", "n1"), 5)
    load.finish({ load_key = load.key("p", "n1"), load_total = load.total_key("p"), load_tokens = 9 })
    H.eq(on("n1"), 0)
    H.eq(total(), 0)
end)

H.test("saturated_queue: a home whose engine queues more is skipped; unknown or stale never is", function()
    reset()
    local p, prt = pool({ 100, 100, 100, 100 }, { saturated_queue = 4 })
    local b = assert(cb.new(p, prt))
    local r = assert(chash.new(p, prt)).ring
    local walk = ring.walk(r, ring.crc32("k7"))
    local home = walk[1].id
    local now = 1000
    node_load.set_view("p", node_load.build({ [home] = now - 1 .. " 2 5 3 0.5" }, now))
    local got, kctx = request(cb, b, "k7")
    H.eq(got[1], walk[2].id)
    H.eq(kctx.balancer.spill, "queue")
    load.finish(kctx.log)
    -- at the mark: not saturated (every engine queues as much: the queue term keeps the home
    -- under its bound; a queue on the home alone would put it over: bound, not queue)
    local v = {}
    for _, n in ipairs(walk) do v[n.id] = now - 1 .. " 2 4 3 0.5" end
    node_load.set_view("p", node_load.build(v, now))
    got, kctx = request(cb, b, "k7")
    H.eq(got[1], home)
    load.finish(kctx.log)
    -- older than 3 intervals: unknown (get -> nil), not saturated and not idle
    node_load.set_view("p", node_load.build({ [home] = now - 7 .. " 2 50 3 0.5" }, now))
    H.eq(node_load.get("p", home), nil)
    got, kctx = request(cb, b, "k7")
    H.eq(got[1], home)
    load.finish(kctx.log)
    -- fresh (6 s = 3 intervals): known
    node_load.set_view("p", node_load.build({ [home] = now - 6 .. " 2 50 - 0.5" }, now))
    local w, run, kv = node_load.get("p", home)
    H.eq(w, 50); H.eq(run, nil); H.eq(kv, 0.5)
end)

H.test("node_load.parse: fields, '-' unknown, garbage refused", function()
    local ts, iv, w, r, kv = node_load.parse("1800000000.250 2 3 - 0.25")
    H.eq(ts, 1800000000.25); H.eq(iv, 2); H.eq(w, 3); H.eq(r, nil); H.eq(kv, 0.25)
    H.eq(node_load.parse("1 2 3"), nil)
    H.eq(node_load.parse("x 2 3 4 5"), nil)
    H.eq(node_load.parse(nil), nil)
    H.eq(node_load.parse("1 0 3 4 5"), nil, "interval 0")
end)

H.test("prefix hook: a node's cost is its estimate less what it holds", function()
    reset()
    local p, prt = pool({ 100, 100 })
    local b = assert(cb.new(p, prt))
    local orig = cb.held
    cb.held = function() return { n1 = 10000, n2 = 10000 } end
    local _, kctx = request(cb, b, "k1", 4000)
    H.eq(total(), 0, "the whole prompt held: no prefill work")
    load.finish(kctx.log)
    cb.held = orig
end)

H.test("bound_factor must be > 1; a new runtime keeps the ring", function()
    local p, prt = pool({ 100, 100 }, { bound_factor = 1 })
    H.eq(cb.new(p, prt), nil)
    local p2, prt2 = pool({ 100, 100 }, { bound_factor = 2 })
    local b = assert(cb.new(p2, prt2))
    H.eq(b.c, 2)
    local b2 = assert(cb.new(p2, prt2, b))
    H.truthy(b2.ring.hashes == b.ring.hashes, "same points reused")
end)

H.test("a shared-prefix key (route.shared) is bounded at its plain share: the hot key evens out", function()
    reset()
    local p, prt = pool({ 100, 100, 100, 100 }, { bound_factor = 2 })
    local b = assert(cb.new(p, prt))
    local held, per = {}, {}
    for i = 1, 40 do
        ngx.ctx = {}
        local kctx = kvctx.get()
        kctx.route.key = "p:shared"
        kctx.route.shared = true
        kctx.req.body = string.rep("x", 400)
        cb.balance(b)
        held[i] = kctx
        per[kctx.balancer.node] = (per[kctx.balancer.node] or 0) + 1
    end
    for _, node in ipairs({ "n1", "n2", "n3", "n4" }) do
        H.eq(per[node], 10, node) -- c 1: within one request of the mean (c 2 would allow 20)
    end
    for i = 1, 40 do load.finish(held[i].log) end
    H.eq(total(), 0)
end)

H.test("bound_load requests: every request counts 1, whatever its size", function()
    reset()
    local p, prt = pool({ 100, 100 }, { bound_load = "requests" })
    local b = assert(cb.new(p, prt))
    local _, k1 = request(cb, b, "k1", 40000)
    local _, k2 = request(cb, b, "k2", 400)
    H.eq(total(), 2)
    load.finish(k1.log)
    load.finish(k2.log)
    H.eq(total(), 0)
end)

H.test("runtime_doc: bound_factor, bound_load, saturated_queue checked at their paths (all optional)", function()
    local rd = require "kvgate.runtime_doc"
    local cfg = { pools = { p = { nodes = { { id = "a" } } } } }
    local function doc(extra)
        local pool = { balancer = "chash_bounded", nodes = { a = { weight = 100, state = "active" } } }
        for k, v in pairs(extra) do pool[k] = v end
        return { pools = { p = pool }, cache = { namespace_version = 1 } }
    end
    H.eq(rd.check(doc({}), cfg), true)
    H.eq(rd.check(doc({ bound_factor = 1.25, bound_load = "requests", saturated_queue = 0 }), cfg), true)
    for _, bad in ipairs({
        { { bound_factor = 1 }, "pools.p.bound_factor" },
        { { bound_factor = "2" }, "pools.p.bound_factor" },
        { { bound_factor = 101 }, "pools.p.bound_factor" },
        { { bound_load = "bytes" }, "pools.p.bound_load" },
        { { saturated_queue = -1 }, "pools.p.saturated_queue" },
        { { saturated_queue = 1.5 }, "pools.p.saturated_queue" },
    }) do
        local ok, _, param = rd.check(doc(bad[1]), cfg)
        H.eq(ok, nil, bad[2])
        H.eq(param, bad[2])
    end
end)

H.done()
