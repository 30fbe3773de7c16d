-- The data path's two configs.
--
-- Static: conf/kvgate.json (rendered by kvgate.render): listeners' facts, pools and their
-- node ids and addresses, models, cache, Redis. Read once in init_by_lua, in the master
-- (root), so workers (nobody) inherit it by fork and never touch the file system. get().
--
-- Dynamic (the runtime): per pool its balancer and per node its weight and state, and the
-- cache namespace version; the control plane pushes it to POST /kvgate/config on the
-- internal listener (kvgate.config_api) without a reload (ingress-nginx's configuration.lua).
-- It lives in lua_shared_dict kvgate_config:
--   version  number: +1 per accepted push and per (re)load
--   doc:<N>  "<version> <digest> <body>": the runtime of version N, the one in force (one key:
--            read atomically). A new version's doc is written beside the old one with
--            safe_set (never evicting: a set() that finds no room first drops the old value,
--            then evicts other keys), so a document the dict cannot hold is refused and the
--            runtime in force, its version and the load count stay.
--   loads    number: init_by_lua runs (starts and reloads), the proof that a push reloaded nothing
-- init() (master) seeds it from <prefix>/conf/runtime.json (written by the control plane before
-- every start and reload) or, without that file, from kvgate.json's weights and balancers, so
-- a gateway serves the current runtime from its first request. Every worker reads the dict's
-- version every SYNC_S (init_worker's timer) and, when it changed, decodes the runtime and
-- calls the listeners (kvgate.balancer rebuilds the pools' instances). runtime() is this
-- worker's decoded runtime; never a dict read per request.
local cjson = require "cjson.safe"
local json = require "kvgate.json"
local hash = require "kvgate.hash"
local metrics = require "kvgate.metrics"
local runtime_doc = require "kvgate.runtime_doc"

local ngx = ngx
local io_open = io.open
local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local match = string.match

local _M = {}

_M.DICT = "kvgate_config"
_M.SYNC_S = 0.2
-- the runtime document's rules (PURE, kvgate.runtime_doc), re-exported for config_api and tests
_M.BALANCERS = runtime_doc.BALANCERS
_M.MAX_WEIGHT = runtime_doc.MAX_WEIGHT
_M.MAX_NAMESPACE = runtime_doc.MAX_NAMESPACE
_M.MAX_STATE_BYTES = runtime_doc.MAX_STATE_BYTES
--- check_runtime(doc, cfg) -> true | nil, msg, param (kvgate.runtime_doc.check)
_M.check_runtime = runtime_doc.check
--- base_runtime(cfg) -> the runtime kvgate.json implies (kvgate.runtime_doc.base)
_M.base_runtime = runtime_doc.base

-- the families this module and kvgate.config_api write (rendered by kvgate.metrics)
metrics.FAMILIES.kvgate_config_version = { "gauge",
    "Version of the runtime in force (+1 per accepted POST /kvgate/config and per start or reload)." }
metrics.FAMILIES.kvgate_gateway_config_loads = { "gauge",
    "Config loads (init_by_lua runs: starts and reloads) since the shared dicts were created; a push leaves it unchanged." }
metrics.FAMILIES.kvgate_config_pushes_total = { "counter",
    "POST /kvgate/config calls, by result (ok, invalid, unauthorized, forbidden, error)." }

local current -- the static config (kvgate.json)
local rt -- this worker's runtime: {version, digest, pools = {[name] = {balancer, nodes}}, cache}
local listeners = {}
local refused -- the dict version this worker refused last (logged once, not at every sync)

--- path() -> <prefix>/conf/kvgate.json
-- Note: `nginx -t` does not run init_by_lua, so a bad file shows up at start or
-- reload; kvgate.nginxctl rolls back to the last good files when that happens.
function _M.path()
    return ngx.config.prefix() .. "conf/kvgate.json"
end

--- runtime_path() -> <prefix>/conf/runtime.json (a POST body's shape; optional)
function _M.runtime_path()
    return ngx.config.prefix() .. "conf/runtime.json"
end

local function read(path)
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "cannot open " .. path .. ": " .. (err or "?")
    end
    local text = f:read("*a")
    f:close()
    return text
end

--- load(path) -> cfg | nil, err
function _M.load(path)
    path = path or _M.path()
    local text, rerr = read(path)
    if not text then
        return nil, rerr
    end
    local cfg, derr = cjson.decode(text)
    if type(cfg) ~= "table" then
        return nil, "bad JSON in " .. path .. ": " .. (derr or "not an object")
    end
    if type(cfg.pools) ~= "table" or type(cfg.models) ~= "table" then
        return nil, path .. ": missing pools/models"
    end
    -- per-pool facts the access phase needs on every request, derived once here (and
    -- again from each new runtime: apply_runtime)
    for _, pool in pairs(cfg.pools) do
        if type(pool) ~= "table" or type(pool.affinity) ~= "table" then
            return nil, path .. ": a pool has no affinity list"
        end
        pool.hashes_key = runtime_doc.HASHES_KEY[pool.balancer] == true
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

--- get() -> the loaded static config (nil before init)
function _M.get()
    return current
end

--- runtime() -> this worker's runtime (nil before init):
-- {version = N, digest = hex, pools = {[name] = {balancer = "chash"|"round_robin"|"least_conn",
--  nodes = {[id] = {weight = W, state = S, home_weight = H (optional)}}}}, cache = {namespace_version = N}}
function _M.runtime()
    return rt
end

local function dict()
    return ngx.shared[_M.DICT]
end

--- parse_doc(s) -> version, digest, body | nil
function _M.parse_doc(s)
    if type(s) ~= "string" then
        return nil
    end
    local v, digest, body = match(s, "^(%d+) (%x+) (.*)$")
    if not v then
        return nil
    end
    return tonumber(v), digest, body
end

local function gauges(d, version, loads)
    local m = ngx.shared.kvgate_metrics
    if not m then
        return
    end
    if version then
        m:set("kvgate_config_version", version)
    end
    if loads then
        m:set("kvgate_gateway_config_loads", loads)
    end
end

--- doc_key(version) -> the dict key of that version's doc
function _M.doc_key(version)
    return "doc:" .. version
end

--- store(body) -> version, digest | nil, err: body (JSON text, already checked) becomes the
-- runtime in force with version + 1. The caller holds the write lock (lock()/unlock()) or is
-- the master in init.
function _M.store(body)
    local d = dict()
    if not d then
        return nil, "no lua_shared_dict " .. _M.DICT
    end
    local digest, herr = hash.sha256_hex(body)
    if not digest then
        return nil, herr
    end
    local prev = tonumber(d:get("version")) or 0
    local version = prev + 1
    -- the new doc beside the old one, never evicting; then the version; then the old doc goes
    -- (a reader that sees the new version reads the new doc; one that read the old version
    -- and finds its doc gone tries again at its next sync)
    local ok, err = d:safe_set(_M.doc_key(version), version .. " " .. digest .. " " .. body)
    if not ok then
        return nil, "cannot store the runtime (" .. #body .. " bytes): " .. tostring(err)
    end
    ok, err = d:safe_set("version", version)
    if not ok then
        d:delete(_M.doc_key(version))
        return nil, "cannot store the runtime's version: " .. tostring(err)
    end
    if prev > 0 then
        d:delete(_M.doc_key(prev))
    end
    gauges(d, version, nil)
    return version, digest
end

--- lock() -> true | nil, err: the writers' lock (one push at a time, all workers); waits
-- up to 2 s (content phase only: it sleeps)
function _M.lock()
    local d = dict()
    if not d then
        return nil, "no lua_shared_dict " .. _M.DICT
    end
    for _ = 1, 2000 do
        if d:safe_add("lock", true, 5) then
            return true
        end
        ngx.sleep(0.001)
    end
    return nil, "another push holds the lock"
end

function _M.unlock()
    local d = dict()
    if d then
        d:delete("lock")
    end
end

--- stored() -> {version, digest, body, loads} of the runtime in force (from the dict)
function _M.stored()
    local d = dict()
    if not d then
        return nil
    end
    local v, digest, body = _M.parse_doc(d:get(_M.doc_key(tonumber(d:get("version")) or 0)))
    if not v then
        return nil
    end
    return { version = v, digest = digest, body = body, loads = tonumber(d:get("loads")) or 0 }
end

-- ---------------------------------------------------------------- this worker's runtime
--- on_runtime(fn): fn(new, old) after each runtime change in this worker (old nil the first
-- time); also in init (the master), where errors returned by fn fail the start or reload
function _M.on_runtime(fn)
    listeners[#listeners + 1] = fn
end

-- apply(doc, version, digest) -> true | nil, err: make doc (checked) this worker's runtime;
-- derived per-pool facts follow its balancer
local function apply(doc, version, digest)
    local new = { version = version, digest = digest, pools = doc.pools, cache = doc.cache }
    local old = rt
    rt = new
    for name, pool in pairs(current.pools) do
        local p = new.pools[name]
        pool.hashes_key = p ~= nil and runtime_doc.HASHES_KEY[p.balancer] == true
    end
    for i = 1, #listeners do
        local ok, err = listeners[i](new, old)
        if ok == nil and err then
            return nil, err
        end
    end
    return true
end

--- sync(): this worker picks up a new version from the dict (timer; cheap when unchanged)
function _M.sync()
    local d = dict()
    local v = d and d:get("version")
    if not v or (rt and v == rt.version) then
        return
    end
    local version, digest, body = _M.parse_doc(d:get(_M.doc_key(v)))
    if not version or (rt and version == rt.version) or version == refused then
        return
    end
    local doc = cjson.decode(body)
    local ok, msg, param = _M.check_runtime(doc, current)
    if not ok then
        -- the writer checked it against its kvgate.json: a reload that failed after its
        -- init_by_lua stored the new config's runtime (until the control plane rolls it back),
        -- or a dict written by another kvgate version. Once per version, not per tick.
        refused = version
        ngx.log(ngx.ERR, "kvgate config: runtime version ", version, " refused: ", msg, " (", param, ")")
        return
    end
    local aok, aerr = apply(doc, version, digest)
    if not aok then
        ngx.log(ngx.ERR, "kvgate config: runtime version ", version, ": ", aerr)
    end
end

--- init() -> cfg | nil, err: init_by_lua (master): load kvgate.json, seed the runtime from
-- conf/runtime.json (or kvgate.json alone), count the load, and make it this process's runtime
-- (workers inherit it by fork). A bad runtime.json fails the start or reload.
function _M.init()
    local cfg, err = _M.load()
    if not cfg then
        return nil, err
    end
    local d = dict()
    if not d then
        return nil, "no lua_shared_dict " .. _M.DICT .. " in nginx.conf"
    end
    local rpath = _M.runtime_path()
    local body = read(rpath)
    local source = body and rpath or "kvgate.json (no runtime.json)"
    local doc
    if body then
        local derr
        doc, derr = cjson.decode(body)
        if doc == nil then
            return nil, "bad JSON in " .. rpath .. ": " .. tostring(derr)
        end
    else
        doc = _M.base_runtime(cfg)
        body = json.canonical(doc)
    end
    local ok, msg, param = _M.check_runtime(doc, cfg)
    if not ok then
        return nil, source .. ": " .. msg .. (param and " (" .. param .. ")" or "")
    end
    -- the single doc key of a kvgate before doc:<N> (a reload onto this code keeps the dict)
    d:delete("doc")
    local version, digest = _M.store(body)
    if not version then
        return nil, digest
    end
    local loads = d:incr("loads", 1, 0)
    gauges(d, version, loads)
    local aok, aerr = apply(doc, version, digest)
    if not aok then
        return nil, aerr
    end
    -- preloaded here, in the master: workers (nobody) may not read the Lua folder
    require "kvgate.config_api"
    return cfg
end

--- init_worker(): this worker's sync timer (every SYNC_S)
function _M.init_worker()
    local ok, err = ngx.timer.every(_M.SYNC_S, function(premature)
        if not premature then
            _M.sync()
        end
    end)
    if not ok then
        ngx.log(ngx.ERR, "kvgate config: cannot start the sync timer: ", err)
    end
    -- a push between the fork and this timer's first run is picked up at once
    _M.sync()
end

return _M
