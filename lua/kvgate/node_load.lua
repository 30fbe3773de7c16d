-- The engines' own load as their agents last reported it: queued (`waiting`) and running
-- requests and KV-cache use per node, for the balancers (chash_bounded's saturated_queue and
-- queue term; a load score for failover and keyless requests).
--
-- Source: the control plane writes each node's last report into Redis at every agent report
-- (kvgate.keys.node_load(pool): a hash per pool, field = node id, value
-- "<received_at> <interval_s> <waiting> <running> <kv_use>", "-" = unknown; control/kvgate/
-- control/plane.py). Never read in a request: a timer per worker, every REFRESH_S,
--   * worker 0 reads the pools' hashes from Redis (one pipeline of HGETALLs) into
--     lua_shared_dict kvgate_node_load ("<pool>\t<node>" -> the value, TTL MAX_AGE_S);
--   * every worker then parses the dict into its own table (view), which get() reads.
-- So a report reaches every worker within about 2 × REFRESH_S of its arrival.
--
-- Staleness: a report older than STALE_INTERVALS × its interval_s (as of the last refresh;
-- received_at is the control plane's clock, compared with the gateway's: keep the hosts'
-- clocks in sync, as NTP does) is unknown, not idle: get() answers nil, as for a node without
-- an agent or an engine whose figures are unavailable. A figure the report lacks is nil too.
local keys = require "kvgate.keys"

local ngx = ngx
local type = type
local tonumber = tonumber
local pairs = pairs
local ipairs = ipairs
local match = string.match

local _M = {}

_M.DICT = "kvgate_node_load"
_M.REFRESH_S = 1
_M.STALE_INTERVALS = 3
-- dict entries outlive no report by more than this (a control plane that stopped writing)
_M.MAX_AGE_S = 600

local SEP = "\t"

-- view[pool] = {[node id] = {waiting, running, kv_use}} (fresh reports only), waiting = the
-- sum of the pool's fresh `waiting` figures
local view = {}

local function num(s)
    if s == nil or s == "-" then
        return nil
    end
    return tonumber(s)
end

--- parse(value) -> received_at, interval_s, waiting, running, kv_use | nil (not a value)
-- (PURE; figures nil when "-")
function _M.parse(v)
    if type(v) ~= "string" then
        return nil
    end
    local ts, iv, w, r, kv = match(v, "^(%S+) (%S+) (%S+) (%S+) (%S+)$")
    ts, iv = tonumber(ts), tonumber(iv)
    if not ts or not iv or iv <= 0 then
        return nil
    end
    return ts, iv, num(w), num(r), num(kv)
end

--- fresh(received_at, interval_s, now) -> true when a report is recent enough to count (PURE)
function _M.fresh(ts, iv, now)
    return now - ts <= _M.STALE_INTERVALS * iv
end

--- build(entries, now) -> a pool's view from {[node id] = value string} (PURE)
function _M.build(entries, now)
    local v = { waiting = 0 }
    for id, s in pairs(entries) do
        local ts, iv, w, r, kv = _M.parse(s)
        if ts and _M.fresh(ts, iv, now) then
            v[id] = { waiting = w, running = r, kv_use = kv }
            if w then
                v.waiting = v.waiting + w
            end
        end
    end
    return v
end

--- set_view(pool, v): replace a pool's view (the refresh; tests)
function _M.set_view(pool, v)
    view[pool] = v
end

--- get(pool, node_id) -> waiting, running, kv_use (each nil when the report lacks it) | nil
-- when the node's load is unknown (no report, or older than STALE_INTERVALS intervals)
function _M.get(pool, id)
    local p = view[pool]
    local n = p and p[id]
    if not n then
        return nil
    end
    return n.waiting, n.running, n.kv_use
end

--- waiting(pool, node_id) -> the node's reported queue | nil (unknown): get()'s first value
function _M.waiting(pool, id)
    local p = view[pool]
    local n = p and p[id]
    return n and n.waiting
end

--- pool_waiting(pool) -> the sum of the pool's known queues (0 when none is known)
function _M.pool_waiting(pool)
    local p = view[pool]
    return p and p.waiting or 0
end

-- fetch(cfg): worker 0: Redis -> the dict (one pipeline of HGETALL, one per pool)
local function fetch(cfg, d)
    local kredis = require "kvgate.redis"
    if kredis.down() then
        return
    end
    local names, cmds = {}, {}
    for name in pairs(cfg.pools) do
        names[#names + 1] = name
        cmds[#cmds + 1] = { "hgetall", keys.node_load(name) }
    end
    if #cmds == 0 then
        return
    end
    local ok, replies, err = pcall(kredis.pipeline, cfg.redis, cmds)
    if not ok or not replies then
        -- the request path's users of Redis see the breaker; the reports wait for the next tick
        ngx.log(ngx.WARN, "kvgate node_load: cannot read the engines' reports: ", ok and err or replies)
        return
    end
    for i, name in ipairs(names) do
        local r = replies[i]
        if type(r) == "table" and r[1] ~= false then
            for j = 1, #r - 1, 2 do
                d:set(name .. SEP .. r[j], r[j + 1], _M.MAX_AGE_S)
            end
        end
    end
end

--- refresh(cfg, now): the dict -> this worker's view (every pool and node of the config)
function _M.refresh(cfg, now)
    local d = ngx.shared[_M.DICT]
    if not d or not cfg then
        return
    end
    for name, pool in pairs(cfg.pools) do
        local entries = {}
        for _, n in ipairs(pool.nodes or {}) do
            entries[n.id] = d:get(name .. SEP .. n.id)
        end
        view[name] = _M.build(entries, now)
    end
end

local function tick(premature)
    if premature then
        return
    end
    local cfg = require("kvgate.config").get()
    if not cfg then
        return
    end
    local d = ngx.shared[_M.DICT]
    if not d then
        return
    end
    if ngx.worker.id() == 0 then
        fetch(cfg, d)
    end
    _M.refresh(cfg, ngx.now())
end

--- init_worker(): the refresh timer of this worker (every REFRESH_S; no dict: nothing to do)
function _M.init_worker()
    if not ngx.shared[_M.DICT] then
        return
    end
    local ok, err = ngx.timer.every(_M.REFRESH_S, tick)
    if not ok then
        ngx.log(ngx.ERR, "kvgate node_load: cannot start the refresh timer: ", err)
    end
end

return _M
