-- The one helper for all Redis use in the data path: a fresh client per call
-- (never a module-level object), timeouts from the policy, the keepalive pool
-- shared per host:port:db. Only usable where cosockets are (access, content, timers).
--
-- The breaker: after a failed Redis call the caller trips it (trip()), and every user
-- (cache lookup, request-log flush) skips Redis while down() is true — BREAKER_S, shared
-- by all workers through the kvgate_state dict — so an unreachable Redis costs one
-- timeout per second instead of one per request or per flush.
local redis = require "nginx.redis"

local ngx = ngx
local null = ngx.null
local tostring = tostring
local unpack = unpack
local type = type
local setmetatable = setmetatable
local rawget = rawget

local _M = {}

local STATE = "kvgate_state"
_M.BREAKER_S = 1

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

local function connect(cfg)
    local red = redis:new()
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
        return nil, "pipeline: " .. tostring(perr)
    end
    release(red, cfg)
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
