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

return _M
