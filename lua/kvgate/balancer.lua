-- The Lua balancers of the pools whose upstream has a balancer_by_lua_block
-- (nginx/upstreams.conf.j2; today chash; round_robin and least_conn stay native nginx).
-- One module per balancer under kvgate/balancer/, behind one interface chosen by the
-- pool's `balancer` name (ingress-nginx's balancer.lua + balancer/*.lua):
--   impl.new(pool) -> instance | nil, err   (pool: a pool of kvgate.json)
--   impl.balance(instance)                  (balancer_by_lua, once per try)
-- Instances are built in init (the master: a bad kvgate.json fails the start or reload,
-- and workers inherit the built rings by fork), or at first use for a pool table that
-- appears later; never per request.
local config = require "kvgate.config"

local ngx = ngx
local pairs = pairs
local match = string.match
local setmetatable = setmetatable
local tostring = tostring

local _M = {}

_M.IMPLEMENTATIONS = {
    chash = require "kvgate.balancer.chash",
}

-- pool table (of the loaded config) -> instance; weak keys: a replaced config frees its rings
-- ngx_http_upstream_get_peer's NGX_BUSY: "no live upstreams", a 502
local NGX_BUSY = -3

local instances = setmetatable({}, { __mode = "k" })

--- uses_lua(pool) -> true when the pool's upstream is balanced here
function _M.uses_lua(pool)
    return _M.IMPLEMENTATIONS[pool.balancer] ~= nil
end

local function instance(pool)
    local b = instances[pool]
    if b then
        return b
    end
    local impl = _M.IMPLEMENTATIONS[pool.balancer]
    if not impl then
        return nil, "no Lua balancer named " .. tostring(pool.balancer)
    end
    local err
    b, err = impl.new(pool)
    if not b then
        return nil, err
    end
    b.impl = impl
    instances[pool] = b
    return b
end

--- init(cfg) -> true | nil, err: build the instance of every pool balanced here, and
-- forget the failure marks of the previous config (impl.forget): a reload started nginx's
-- own fail counts afresh too, and a node coming back (a ramp step is a reload) must not be
-- skipped for what it did before it left
function _M.init(cfg)
    for name, pool in pairs(cfg.pools) do
        if _M.uses_lua(pool) then
            local b, err = instance(pool)
            if not b then
                return nil, "pool " .. name .. ": " .. err
            end
            if b.impl.forget then
                b.impl.forget(b)
            end
        end
    end
    return true
end

local function refresh()
    for _, b in pairs(instances) do
        if b.impl.refresh then
            b.impl.refresh(b)
        end
    end
end

--- init_worker(): per worker, the timer that refreshes each instance's shared state
-- (chash: the failure marks of the other workers, every chash.REFRESH_S)
function _M.init_worker()
    local ok, err = ngx.timer.every(_M.IMPLEMENTATIONS.chash.REFRESH_S, refresh)
    if not ok then
        ngx.log(ngx.ERR, "kvgate balancer: cannot start the refresh timer: ", err)
    end
end

--- balance(pool_name): the balancer_by_lua_block of upstream pool_<pool_name>
function _M.balance(pool_name)
    local cfg = config.get()
    local pool = cfg and cfg.pools[pool_name]
    if not pool then
        ngx.log(ngx.ERR, "kvgate balancer: no pool ", pool_name, " in the config")
        return ngx.exit(NGX_BUSY)
    end
    local b, err = instance(pool)
    if not b then
        ngx.log(ngx.ERR, "kvgate balancer: pool ", pool_name, ": ", err)
        return ngx.exit(NGX_BUSY)
    end
    return b.impl.balance(b)
end

--- failed_last(upstream, addr): the last try of a request failed and nginx answers itself
-- (every try failed: @kvgate_upstream_error); no retry calls the balancer to record it,
-- so the node of the last address of $upstream_addr is marked failed here
function _M.failed_last(upstream, addr)
    local cfg = config.get()
    local name = cfg and cfg.upstream_pools[upstream or ""]
    local pool = name and cfg.pools[name]
    if not pool or not _M.uses_lua(pool) or not addr then
        return
    end
    local last = match(addr, "([^%s,]+)$")
    local id = last and cfg.nodes_by_addr[last]
    local b = id and instance(pool)
    local node = b and b.impl.node(b, id)
    if node then
        b.impl.mark_failed(b, node)
    end
end

return _M
