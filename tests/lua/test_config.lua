-- config.lua: a kvgate.json that lacks what the request phases read is refused at load
-- (init_by_lua then fails the start or reload; the running config keeps serving).
local H = dofile("tests/lua/helper.lua")
local cjson = require "cjson"
local config = require "kvgate.config"

local function load(t)
    local path = os.tmpname()
    local f = assert(io.open(path, "wb"))
    f:write(cjson.encode(t))
    f:close()
    local cfg, err = config.load(path)
    os.remove(path)
    return cfg, err
end

local function good()
    return {
        models = { m = "p" },
        pools = { p = { balancer = "chash", affinity = { "session", "prefix" } } },
        shutdown = { grace_s = 900, cut_streams_after_s = 299 },
        cache = { enabled = true, credential_headers = { "authorization" } },
    }
end

H.test("a complete config loads, with the per-pool facts derived", function()
    local cfg = assert(load(good()))
    H.eq(cfg.pools.p.hashes_key, true)
    H.eq(cfg.pools.p.uses_session, true)
end)

H.test("a config rendered by an older kvgate is refused, naming what is missing", function()
    local t = good()
    t.shutdown = nil
    local cfg, err = load(t)
    H.eq(cfg, nil)
    H.truthy(err:find("shutdown.grace_s", 1, true), err)
    t = good()
    t.shutdown.cut_streams_after_s = nil
    H.eq((load(t)), nil)
    t = good()
    t.cache.credential_headers = nil
    cfg, err = load(t)
    H.eq(cfg, nil)
    H.truthy(err:find("credential_headers", 1, true), err)
end)

-- ---------------------------------------------------------------- the runtime (dynamic config)
local function static()
    return {
        pools = {
            p1 = { balancer = "chash", nodes = { { id = "n1", weight = 100 }, { id = "n2", weight = 0 } } },
            p2 = { balancer = "round_robin", nodes = { { id = "m1", weight = 200 } } },
        },
        cache = { namespace_version = 3 },
    }
end

local function doc()
    return {
        pools = {
            p1 = { balancer = "chash", nodes = { n1 = { weight = 100, state = "active" },
                                                 n2 = { weight = 0, state = "drained" } } },
            p2 = { balancer = "least_conn", nodes = { m1 = { weight = 50, state = "ramping" } } },
        },
        cache = { namespace_version = 4 },
    }
end

H.test("a runtime naming every pool and node of kvgate.json passes", function()
    H.eq(config.check_runtime(doc(), static()), true)
    -- home_weight is optional (an older control plane sends none) and >= 1 when sent
    local d = doc()
    d.pools.p1.nodes.n2.home_weight = 100
    d.pools.p1.nodes.n1.home_weight = 1
    d.pools.p1.nodes.n1.state = string.rep("s", config.MAX_STATE_BYTES)
    H.eq(config.check_runtime(d, static()), true)
end)

H.test("a bad runtime is refused at the path of its first bad field", function()
    local cases = {
        { function(d) d.tenants = {} end, "tenants" },
        { function(d) d.pools = "x" end, "pools" },
        { function(d) d.pools.p3 = d.pools.p2 end, "pools.p3" },
        { function(d) d.pools.p2 = nil end, "pools.p2" },
        { function(d) d.pools.p1.balancer = "random" end, "pools.p1.balancer" },
        { function(d) d.pools.p1.balancer = nil end, "pools.p1.balancer" },
        { function(d) d.pools.p1.extra = 1 end, "pools.p1.extra" },
        { function(d) d.pools.p1.nodes = nil end, "pools.p1.nodes" },
        { function(d) d.pools.p1.nodes.n3 = { weight = 1, state = "active" } end, "pools.p1.nodes.n3" },
        { function(d) d.pools.p1.nodes.n2 = nil end, "pools.p1.nodes.n2" },
        { function(d) d.pools.p1.nodes.n2.weight = -1 end, "pools.p1.nodes.n2.weight" },
        { function(d) d.pools.p1.nodes.n2.weight = 1.5 end, "pools.p1.nodes.n2.weight" },
        { function(d) d.pools.p1.nodes.n2.weight = "100" end, "pools.p1.nodes.n2.weight" },
        { function(d) d.pools.p1.nodes.n2.weight = config.MAX_WEIGHT + 1 end, "pools.p1.nodes.n2.weight" },
        { function(d) d.pools.p1.nodes.n2.weight = nil end, "pools.p1.nodes.n2.weight" },
        { function(d) d.pools.p1.nodes.n2.state = "" end, "pools.p1.nodes.n2.state" },
        -- a free string of megabytes filled the kvgate_config dict (review of issue 10)
        { function(d) d.pools.p1.nodes.n2.state = string.rep("x", config.MAX_STATE_BYTES + 1) end,
          "pools.p1.nodes.n2.state" },
        { function(d) d.pools.p1.nodes.n2.port = 1 end, "pools.p1.nodes.n2.port" },
        { function(d) d.pools.p1.nodes.n2.home_weight = 0 end, "pools.p1.nodes.n2.home_weight" },
        { function(d) d.pools.p1.nodes.n2.home_weight = 2.5 end, "pools.p1.nodes.n2.home_weight" },
        { function(d) d.pools.p1.nodes.n2.home_weight = "100" end, "pools.p1.nodes.n2.home_weight" },
        { function(d) d.pools.p1.nodes.n2.home_weight = config.MAX_WEIGHT + 1 end,
          "pools.p1.nodes.n2.home_weight" },
        { function(d) d.cache = nil end, "cache" },
        { function(d) d.cache.namespace_version = 1.5 end, "cache.namespace_version" },
        { function(d) d.cache.namespace_version = true end, "cache.namespace_version" },
        { function(d) d.cache.ttl_s = 5 end, "cache.ttl_s" },
    }
    for i, c in ipairs(cases) do
        local d = doc()
        c[1](d)
        local ok, msg, param = config.check_runtime(d, static())
        H.eq(ok, nil, "case " .. i)
        H.eq(param, c[2], "case " .. i .. " (" .. tostring(msg) .. ")")
        H.truthy(type(msg) == "string" and #msg > 0)
    end
    local ok, _, param = config.check_runtime("x", static())
    H.eq(ok, nil)
    H.eq(param, nil)
end)

H.test("without runtime.json the runtime is kvgate.json's balancers, weights and namespace", function()
    local d = config.base_runtime(static())
    H.eq(config.check_runtime(d, static()), true)
    H.eq(d.pools.p1.balancer, "chash")
    H.eq(d.pools.p1.nodes.n1.weight, 100)
    H.eq(d.pools.p1.nodes.n2.weight, 0)
    H.eq(d.pools.p1.nodes.n2.state, "down")
    H.eq(d.pools.p2.balancer, "round_robin")
    H.eq(d.cache.namespace_version, 3)
end)

H.test("the stored doc is one string: version, digest, body", function()
    local v, digest, body = config.parse_doc("12 abcdef0123 {\"pools\": {}}")
    H.eq(v, 12)
    H.eq(digest, "abcdef0123")
    H.eq(body, '{"pools": {}}')
    H.eq(config.parse_doc("x"), nil)
    H.eq(config.parse_doc(nil), nil)
end)

H.done()
