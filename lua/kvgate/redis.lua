-- The one helper for all Redis use in the data path: a fresh client per call
-- (never a module-level object), timeouts from the policy, the keepalive pool
-- shared per host:port:db. Only usable where cosockets are (access, content, timers).
--
-- The breaker: after a failed Redis call the caller trips it (trip()), and every user
-- (cache lookup, request-log flush) skips Redis while down() is true — BREAKER_S, shared
-- by all workers through the kvgate_state dict — so an unreachable Redis costs one
-- timeout per second instead of one per request or per flush.
--
-- Sentinel (cfg.sentinels, docs/sentinel.md): the master's address is asked of the sentinels
-- (Debian's nginx.redis.sentinel get_master) once and kept per worker, not per request; the calls
-- connect straight to it through the same pooled client, in a keepalive pool named after that
-- address (a switch never reuses a connection to the old master). It is asked again every
-- RESOLVE_S (a timer per worker) and at the next call after a connection error or a READONLY
-- reply (a demoted master). A change of address is logged and counted once per gateway
-- (kvgate_redis_master_changes_total). While the master is away the calls fail as they do
-- without Sentinel: the breaker trips, the cache misses, the limits fall back.
local redis = require "nginx.redis"

local ngx = ngx
local null = ngx.null
local tostring = tostring
local unpack = unpack
local type = type
local setmetatable = setmetatable
local rawget = rawget
local pairs = pairs
local pcall = pcall
local tonumber = tonumber
local find = string.find

local _M = {}

local STATE = "kvgate_state"
_M.BREAKER_S = 1
_M.RESOLVE_S = 1 -- the timer's period: a failover is seen within this after Sentinel promotes
local RESOLVE_MIN_S = 0.1 -- after a failed call, at most one question to the sentinels per worker this often

--- down() -> true while the breaker is open (a Redis call failed less than BREAKER_S ago)
function _M.down()
    local state = ngx.shared[STATE]
    return state and state:get("redis_down") or false
end

--- trip(): open the breaker for BREAKER_S (all workers)
function _M.trip()
    local state = ngx.shared[STATE]
    if state then
        state:set("redis_down", true, _M.BREAKER_S)
    end
end

-- cfg (the config's redis table) -> the connect options naming its keepalive pool, built once
local opts_of = setmetatable({}, { __mode = "k" })

-- ------------------------------------------------------------------ Sentinel
-- master_name -> { host, port, addr, opts (keepalive pool "<ip>:<port>:<db>"), stale, last
-- (ngx.now() of the last question), resolving, cfg (the last config that used it) }; per worker
local masters = {}

-- the first sentinel that names a master wins, asked from `first` on (a rotation: after the
-- master a sentinel named could not be reached, the next question starts at the next sentinel,
-- so one stale or minority sentinel cannot keep a dead address cached) -> host, port | nil, err
local function ask_sentinels(cfg, first)
    local sentinel = require "nginx.redis.sentinel"
    if not redis.sentinel then
        redis.add_commands("sentinel") -- (what nginx.redis.connector does when it loads)
    end
    local errs = {}
    local list = cfg.sentinels
    local n = #list
    for k = 0, n - 1 do
        local s = list[((first or 1) - 1 + k) % n + 1]
        local red = redis:new()
        red:set_timeout(cfg.sentinel_timeout_ms or 250)
        local ok, err = red:connect(s.host, s.port, { pool = "sentinel:" .. s.host .. ":" .. s.port })
        if ok then
            local m, gerr = sentinel.get_master(red, cfg.master_name)
            if m then
                red:set_keepalive(60000, 4)
                return m.host, tonumber(m.port)
            end
            red:close()
            err = gerr or ("no master named " .. cfg.master_name)
        end
        errs[#errs + 1] = s.host .. ":" .. s.port .. ": " .. tostring(err)
    end
    return nil, table.concat(errs, "; ")
end

local function switched(name, prev, addr)
    -- counted and logged by one worker: the first to add the transition's marker
    local state = ngx.shared[STATE]
    if not state then
        return
    end
    local key = "redis_master:" .. name
    local known = state:get(key)
    if known == addr then
        return
    end
    state:set(key, addr)
    if known and state:add("redis_switch:" .. name .. ":" .. known .. ">" .. addr, true, 10) then
        require("kvgate.metrics").incr("kvgate_redis_master_changes_total", {})
        ngx.log(ngx.WARN, "kvgate redis: master ", name, " moved from ", known, " to ", addr, " (sentinel)")
    end
end

--- resolve(cfg) -> true | false, err: ask the sentinels for cfg.master_name's address now
-- (one question at a time per worker: a call while another is on its way returns at once)
function _M.resolve(cfg)
    local name = cfg.master_name
    local m = masters[name]
    if not m then
        m = {}
        masters[name] = m
    end
    m.cfg = cfg
    if m.resolving then
        return m.host ~= nil, "being resolved"
    end
    m.resolving = true
    local ok, host, port = pcall(ask_sentinels, cfg, m.first)
    m.resolving = false
    m.last = ngx.now()
    if not ok or not host then
        local err = ok and port or host
        ngx.log(ngx.WARN, "kvgate redis: sentinels do not name master ", name, ": ", tostring(err))
        return false, err
    end
    m.stale = false
    local addr = host .. ":" .. port
    if addr ~= m.addr then
        local prev = m.addr
        m.host, m.port, m.addr = host, port, addr
        m.opts = { pool = addr .. ":" .. cfg.db }
        switched(name, prev, addr)
    end
    return true
end

--- master(cfg) -> { host, port, addr } | nil: this worker's view of the master (nil: none known yet)
function _M.master(cfg)
    return masters[cfg.master_name]
end

local function suspect(cfg)
    local m = masters[cfg.master_name]
    if m then
        m.stale = true
    end
end


local function tick(premature)
    if premature then
        return
    end
    for _, m in pairs(masters) do
        if m.cfg then
            _M.resolve(m.cfg)
        end
    end
end

local function resolve_later(premature, cfg)
    if not premature then
        _M.resolve(cfg)
    end
end

local function connect_sentinel(cfg)
    local m = masters[cfg.master_name]
    if not m or not m.host then
        -- no master known yet in this worker (its first call): the one question a request waits for
        _M.resolve(cfg)
        m = masters[cfg.master_name]
        if not m.host then
            return nil, "connect: no master " .. cfg.master_name .. " known from the sentinels"
        end
    elseif m.stale and not m.resolving and ngx.now() - (m.last or 0) >= RESOLVE_MIN_S then
        -- a suspect master: asked again in the background (at most every RESOLVE_MIN_S per
        -- worker); this call goes on with the address known, and fails fast if it is gone
        m.last = ngx.now()
        ngx.timer.at(0, resolve_later, cfg)
    end
    m.cfg = cfg
    local red = redis:new()
    red:set_timeout(cfg.timeout_ms)
    local ok, err = red:connect(m.host, m.port, m.opts)
    if not ok then
        if not m.stale then
            -- the named master cannot be reached: the next question starts at the next sentinel
            m.first = (m.first or 1) % #cfg.sentinels + 1
        end
        m.stale = true
        return nil, "connect: " .. tostring(err)
    end
    return red
end

local function connect(cfg)
    local red
    if cfg.sentinels then
        local err
        red, err = connect_sentinel(cfg)
        if not red then
            return nil, err
        end
    else
        red = redis:new()
        red:set_timeout(cfg.timeout_ms)
        local opts = opts_of[cfg]
        if not opts then
            opts = { pool = cfg.host .. ":" .. cfg.port .. ":" .. cfg.db }
            opts_of[cfg] = opts
        end
        local ok, err = red:connect(cfg.host, cfg.port, opts)
        if not ok then
            return nil, "connect: " .. tostring(err)
        end
    end
    if cfg.db ~= 0 then
        local times = red:get_reused_times()
        if times == 0 then
            local sok, serr = red:select(cfg.db)
            if not sok then
                red:close()
                return nil, "select: " .. tostring(serr)
            end
        end
    end
    return red
end

local function release(red, cfg)
    local ok, err = red:set_keepalive(60000, cfg.pool_size)
    if not ok then
        ngx.log(ngx.WARN, "kvgate redis keepalive: ", err)
    end
end

--- get(cfg, key) -> string | false (absent) | nil, err
function _M.get(cfg, key)
    local red, err = connect(cfg)
    if not red then
        return nil, err
    end
    local v, gerr = red:get(key)
    if not v then
        -- nil: network error; false: error reply
        red:close()
        if cfg.sentinels then
            suspect(cfg)
        end
        return nil, "get: " .. tostring(gerr)
    end
    release(red, cfg)
    if v == null then
        return false
    end
    return v
end

--- set(cfg, key, value, ttl_s) -> true | nil, err
function _M.set(cfg, key, value, ttl_s)
    local red, err = connect(cfg)
    if not red then
        return nil, err
    end
    local ok, serr = red:set(key, value, "EX", ttl_s)
    if not ok then
        red:close()
        if cfg.sentinels then
            suspect(cfg)
        end
        return nil, "set: " .. tostring(serr)
    end
    release(red, cfg)
    return true
end

--- pipeline(cfg, cmds) -> replies | nil, err
-- cmds: list of {command, arg, ...} or of strings already in Redis's wire format (one
-- command each, e.g. kvgate.reqlog's XADDs); sent as one pipeline on one pooled connection.
-- replies[i] is the reply of cmds[i], or {false, err} for an error reply (as
-- lua-resty-redis gives them); a network error fails the whole call.
function _M.pipeline(cfg, cmds)
    local red, err = connect(cfg)
    if not red then
        return nil, err
    end
    red:init_pipeline(#cmds)
    for i = 1, #cmds do
        local c = cmds[i]
        if type(c) == "string" then
            -- lua-resty-redis queues each command's wire form in red._reqs and reads one
            -- reply per element at commit
            local reqs = rawget(red, "_reqs")
            reqs[#reqs + 1] = c
        else
            red[c[1]](red, unpack(c, 2))
        end
    end
    local replies, perr = red:commit_pipeline()
    if not replies then
        red:close()
        if cfg.sentinels then
            suspect(cfg)
        end
        return nil, "pipeline: " .. tostring(perr)
    end
    release(red, cfg)
    if cfg.sentinels then
        -- a master demoted under us answers writes with READONLY: ask the sentinels again;
        -- a round trip without one clears a suspicion (the sentinels may be the ones away)
        local demoted = false
        for i = 1, #replies do
            local r = replies[i]
            if type(r) == "table" and r[1] == false and find(tostring(r[2]), "READONLY", 1, true) then
                demoted = true
            end
        end
        local m = masters[cfg.master_name]
        if demoted then
            suspect(cfg)
        elseif m then
            m.stale = false
        end
    end
    return replies
end

-- ------------------------------------------------------------------ batched calls
-- One light thread per worker sends the single commands of every request waiting in this
-- worker (the cache's GET, the limits' ADMIT) as one pipeline, and the next batch while the
-- requests that came meanwhile wait: a round trip per batch instead of per request (under load
-- a miss paid ~25 µs of worker CPU for its own GET's round trip; kvgate bench gateway). At low
-- load a batch is one command: the cost is two semaphore hand-offs (~2 µs). A request waits at
-- most the Redis timeout + 50 ms for its reply, then takes Redis as unreachable.
local semaphore
local sender_on = false
local queue, queued = {}, 0
local free, nfree = {}, 0

local running = false -- a sender light thread is on (started when the queue gets its first command)

local function sender(premature)
    -- sends batches while commands wait, then ends: no thread idles in a worker (an exiting
    -- worker waits for running timers: a reload's old workers leave as soon as they are done)
    while queued > 0 do
        local items, n = queue, queued
        queue, queued = {}, 0
        local cmds = {}
        for i = 1, n do
            cmds[i] = items[i].cmd
        end
        local ok, replies, err = pcall(_M.pipeline, items[1].cfg, cmds)
        if not ok then
            replies, err = nil, replies
        end
        for i = 1, n do
            local it = items[i]
            if replies then
                it.reply = replies[i]
            else
                it.err = err or "no reply"
            end
            it.done = true
            it.sema:post(1)
        end
    end
    running = false
end

--- start_batches(): this worker can batch (init_worker: ngx.semaphore is there)
function _M.start_batches()
    semaphore = require "ngx.semaphore"
    sender_on = true
    -- the Sentinel re-resolve timer (does nothing until a config with sentinels made a call)
    local ok, err = ngx.timer.every(_M.RESOLVE_S, tick)
    if not ok then
        ngx.log(ngx.ERR, "kvgate redis: no sentinel timer: ", err)
    end
end

--- call(cfg, cmd) -> reply | nil, err
-- cmd: {command, arg, ...}; reply as lua-resty-redis gives it ({false, err} for an error
-- reply, ngx.null for nil). Through the batch sender when it runs (one per worker, started
-- in init_worker), else its own pipeline of one. Where cosockets are (access, content).
-- Commands of one batch share a connection: none may block (BLPOP...) or change its state.
function _M.call(cfg, cmd)
    if not sender_on then
        local replies, err = _M.pipeline(cfg, { cmd })
        if not replies then
            return nil, err
        end
        return replies[1]
    end
    -- a semaphore from this worker's free list (one is posted once and waited once per call)
    local sema = free[nfree]
    if sema then
        free[nfree] = nil
        nfree = nfree - 1
    else
        sema = semaphore.new(0)
    end
    local it = { cmd = cmd, cfg = cfg, sema = sema }
    queued = queued + 1
    queue[queued] = it
    if not running then
        local ok, terr = ngx.timer.at(0, sender)
        if not ok then
            -- no timer (lua_max_pending_timers): this command on its own
            queue[queued] = nil
            queued = queued - 1
            ngx.log(ngx.WARN, "kvgate redis: no batch sender: ", terr)
            local replies, err = _M.pipeline(cfg, { cmd })
            if not replies then
                return nil, err
            end
            return replies[1]
        end
        running = true
    end
    local ok = sema:wait((cfg.timeout_ms or 200) / 1000 + 0.05)
    if ok and nfree < 256 then
        nfree = nfree + 1
        free[nfree] = sema
    end
    if not it.done then
        -- (the semaphore is dropped: its post may still come)
        return nil, "no reply from the batch sender in time"
    end
    if it.err then
        return nil, it.err
    end
    return it.reply
end

--- get_batched(cfg, key) -> string | false (absent) | nil, err (get() through call())
function _M.get_batched(cfg, key)
    local v, err = _M.call(cfg, { "get", key })
    if v == nil then
        return nil, "get: " .. tostring(err)
    end
    if type(v) == "table" then
        return nil, "get: " .. tostring(v[2])
    end
    if v == null then
        return false
    end
    return v
end

return _M
