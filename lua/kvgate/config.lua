-- The data-path config (conf/kvgate.json, rendered by kvgate.render). Read once in
-- init_by_lua, in the master (root), so workers (nobody) inherit it by fork and
-- never touch the file system.
local cjson = require "cjson.safe"

local io_open = io.open
local type = type
local pairs = pairs

local _M = {}

local current

--- path() -> <prefix>/conf/kvgate.json
-- Note: `nginx -t` does not run init_by_lua, so a bad file shows up at start or
-- reload; kvgate.nginxctl rolls back to the last good files when that happens.
function _M.path()
    return ngx.config.prefix() .. "conf/kvgate.json"
end

--- load(path) -> cfg | nil, err
function _M.load(path)
    path = path or _M.path()
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "cannot open " .. path .. ": " .. (err or "?")
    end
    local text = f:read("*a")
    f:close()
    local cfg, derr = cjson.decode(text)
    if type(cfg) ~= "table" then
        return nil, "bad JSON in " .. path .. ": " .. (derr or "not an object")
    end
    if type(cfg.pools) ~= "table" or type(cfg.models) ~= "table" then
        return nil, path .. ": missing pools/models"
    end
    -- per-pool facts the access phase needs on every request, derived once here
    for _, pool in pairs(cfg.pools) do
        if type(pool) ~= "table" or type(pool.affinity) ~= "table" then
            return nil, path .. ": a pool has no affinity list"
        end
        pool.hashes_key = pool.balancer == "chash"
        pool.uses_session = false
        for i = 1, #pool.affinity do
            if pool.affinity[i] == "session" then
                pool.uses_session = true
            end
        end
    end
    -- fields the request phases read without a guard: a kvgate.json rendered by an older
    -- kvgate (an old control plane still running beside new Lua files) fails the start or
    -- the reload here, and the running config keeps serving, instead of a Lua error per request
    local sd = cfg.shutdown
    if type(sd) ~= "table" or type(sd.grace_s) ~= "number" or type(sd.cut_streams_after_s) ~= "number" then
        return nil, path .. ": no shutdown.grace_s / shutdown.cut_streams_after_s (rendered by an older kvgate?)"
    end
    if type(cfg.cache) ~= "table" or type(cfg.cache.credential_headers) ~= "table" then
        return nil, path .. ": no cache.credential_headers (rendered by an older kvgate?)"
    end
    current = cfg
    return cfg
end

--- get() -> the loaded config (nil before init)
function _M.get()
    return current
end

return _M
