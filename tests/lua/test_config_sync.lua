-- config.sync(): a worker follows the shared dict's runtime; a version it refuses (a dict
-- written for another kvgate.json: a reload that failed after init_by_lua stored its runtime,
-- until the control plane rolls it back) is logged once, not at every 0.2 s tick.
local H = dofile("tests/lua/helper.lua")
local cjson = require "cjson"

local logs = {}
local store = {}
local dict = {
    get = function(_, k) return store[k] end,
    set = function(_, k, v) store[k] = v; return true end,
    safe_set = function(_, k, v) store[k] = v; return true end,
    delete = function(_, k) store[k] = nil end,
    incr = function(_, k, v, init) store[k] = (store[k] or init) + v; return store[k] end,
}
_G.ngx = { shared = { kvgate_config = dict }, ERR = 4, WARN = 5,
           log = function(level, ...) logs[#logs + 1] = table.concat({ ... }) end,
           config = { prefix = function() return "/nonexistent/" end } }
local config = require "kvgate.config"

local path = os.tmpname()
local f = assert(io.open(path, "wb"))
f:write(cjson.encode({
    models = { m = "p" },
    pools = { p = { name = "p", balancer = "chash", affinity = { "prefix" }, nodes = { { id = "n1", weight = 100 } } } },
    shutdown = { grace_s = 900, cut_streams_after_s = 299 },
    cache = { credential_headers = { "authorization" }, namespace_version = 0 },
}))
f:close()
assert(config.load(path))
os.remove(path)

local function put(version, doc)
    local body = cjson.encode(doc)
    store[config.doc_key(version)] = version .. " " .. string.rep("a", 64) .. " " .. body
    store.version = version
end

local good = { pools = { p = { balancer = "chash", nodes = { n1 = { weight = 100, state = "active" } } } },
               cache = { namespace_version = 1 } }
local other = { pools = { q = { balancer = "chash", nodes = { n1 = { weight = 100, state = "active" } } } },
                cache = { namespace_version = 1 } }

H.test("a new version is taken; a refused one is logged once and the runtime stays", function()
    put(1, good)
    config.sync()
    H.eq(config.runtime().version, 1)
    put(2, other)
    for _ = 1, 10 do
        config.sync()
    end
    H.eq(config.runtime().version, 1)
    H.eq(#logs, 1, "one error line for the refused version")
    H.truthy(logs[1]:find("runtime version 2 refused", 1, true), logs[1])
    good.cache.namespace_version = 3
    put(3, good)
    config.sync()
    H.eq(config.runtime().version, 3)
    H.eq(config.runtime().cache.namespace_version, 3)
end)

H.done()
