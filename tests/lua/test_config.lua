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

H.done()
