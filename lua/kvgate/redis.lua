-- The one helper for all Redis use in the data path: a fresh client per call
-- (never a module-level object), timeouts from the policy, the keepalive pool
-- shared per host:port:db. Only usable where cosockets are (access, content, timers).
local redis = require "nginx.redis"

local ngx = ngx
local null = ngx.null
local tostring = tostring

local _M = {}

local function connect(cfg)
    local red = redis:new()
    red:set_timeout(cfg.timeout_ms)
    local pool = cfg.host .. ":" .. cfg.port .. ":" .. cfg.db
    local ok, err = red:connect(cfg.host, cfg.port, { pool = pool })
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

return _M
