-- The Lua balancer layer: every pool's upstream has a balancer_by_lua_block
-- (nginx/upstreams.conf.j2) that calls balance(pool_name). One module per balancer under
-- kvgate/balancer/, behind one interface chosen by the runtime's balancer name for the pool
-- (ingress-nginx's balancer.lua + balancer/*.lua; the interface is in balancer/peers.lua):
--   chash        the key's home on the ring of node ids, its next node on failover
--   round_robin  nginx's smooth weighted round robin
--   least_conn   fewest in flight per unit of weight (shared in-flight dict)
--   chash_bounded  chash's ring with bounded loads: the key's first node under its bound of
--                in-flight prefill work and not saturated (kvgate.balancer.chash_bounded)
--   prefix       the eligible node (chash_bounded's rule) holding the longest leading part of
--                the prompt by the prefix index (kvgate.balancer.prefix, kvgate.prefix_index)
-- Instances are built from the static pool (kvgate.json: ids, addresses) and the runtime
-- (kvgate.config: balancer, weights): in init (the master: a bad config fails the start or
-- reload, and workers inherit the built rings by fork), and again in each worker when a new
-- runtime version arrives (config's sync timer calls rebuild), never per request. A pool
-- whose part of the runtime did not change keeps its instance.
local config = require "kvgate.config"
local kvctx = require "kvgate.ctx"
local peers = require "kvgate.balancer.peers"
local inflight = require "kvgate.inflight"
local load = require "kvgate.balancer.load"
local node_load = require "kvgate.node_load"
local gwload = require "kvgate.gwload"

local ngx = ngx
local pairs = pairs
local match = string.match
local tostring = tostring

local _M = {}

_M.IMPLEMENTATIONS = {
    chash = require "kvgate.balancer.chash",
    round_robin = require "kvgate.balancer.round_robin",
    least_conn = require "kvgate.balancer.least_conn",
    chash_bounded = require "kvgate.balancer.chash_bounded",
    prefix = require "kvgate.balancer.prefix",
}
for name in pairs(config.BALANCERS) do
    assert(_M.IMPLEMENTATIONS[name], "kvgate.config.BALANCERS names " .. name .. ", no module has it")
end

local NGX_BUSY = peers.NGX_BUSY

local instances = {} -- pool name -> instance (this worker; b.impl, b.prt)

-- same(a, b) -> true when two pool runtimes route alike (balancer and every weight) and
-- give keys the same homes (every home weight), with the same bound (chash_bounded's fields)
local function same(a, b)
    if not a or not b or a.balancer ~= b.balancer or a.bound_factor ~= b.bound_factor
        or a.saturated_queue ~= b.saturated_queue or a.bound_load ~= b.bound_load then
        return false
    end
    for id, n in pairs(a.nodes) do
        local m = b.nodes[id]
        if not m or m.weight ~= n.weight or m.home_weight ~= n.home_weight then
            return false
        end
    end
    for id in pairs(b.nodes) do
        if not a.nodes[id] then
            return false
        end
    end
    return true
end

-- build(name, pool, prt) -> instance | nil, err
local function build(name, pool, prt)
    local impl = _M.IMPLEMENTATIONS[prt and prt.balancer or pool.balancer]
    if not impl then
        return nil, "no Lua balancer named " .. tostring(prt and prt.balancer or pool.balancer)
    end
    local prev = instances[name]
    local b, err = impl.new(pool, prt, prev and prev.impl == impl and prev or nil)
    if not b then
        return nil, err
    end
    b.impl = impl
    b.prt = prt
    instances[name] = b
    return b
end

--- rebuild(new, old) -> true | nil, err: the instances of the pools whose balancer or
-- weights changed in runtime `new` (config.on_runtime listener); nodes that come back into
-- service (weight 0 -> > 0) forget their failure marks, as a reload's fresh workers did
function _M.rebuild(new)
    local cfg = config.get()
    for name, pool in pairs(cfg.pools) do
        local prt = new.pools[name]
        local prev = instances[name]
        if not prev or not same(prev.prt, prt) then
            local back
            if prev and prev.prt and prt then
                for id, n in pairs(prt.nodes) do
                    local was = prev.prt.nodes[id]
                    if n.weight > 0 and was and was.weight <= 0 then
                        back = back or {}
                        back[id] = true
                    end
                end
            end
            local b, err = build(name, pool, prt)
            if not b then
                return nil, "pool " .. name .. ": " .. err
            end
            if back then
                peers.forget(b, back)
            end
        else
            prev.prt = prt
        end
    end
    return true
end

--- init(cfg) -> true | nil, err: init_by_lua (master), after config.init(): the instance of
-- every pool from the runtime in force, and the failure marks of the previous config
-- forgotten (a reload started nginx's own fail counts afresh too)
function _M.init(cfg)
    instances = {}
    -- with other gateway members, the bounds add their in-flight work (kvgate.gwload)
    load.remote = gwload.shared(cfg)
    local rt = config.runtime()
    for name, pool in pairs(cfg.pools) do
        local b, err = build(name, pool, rt and rt.pools[name])
        if not b then
            return nil, "pool " .. name .. ": " .. err
        end
        peers.forget(b)
    end
    config.on_runtime(_M.rebuild)
    return true
end

local function refresh(premature)
    if premature then
        return
    end
    for _, b in pairs(instances) do
        peers.refresh(b)
    end
end

--- init_worker(): per worker, the timer that refreshes each instance's view of the failure
-- marks of the other workers (every peers.REFRESH_S), and the engines' reports' (node_load)
function _M.init_worker()
    node_load.init_worker()
    gwload.init_worker()
    local ok, err = ngx.timer.every(peers.REFRESH_S, refresh)
    if not ok then
        ngx.log(ngx.ERR, "kvgate balancer: cannot start the refresh timer: ", err)
    end
end

--- instance(pool_name) -> this worker's instance for the pool | nil, err
function _M.instance(pool_name)
    local b = instances[pool_name]
    if b then
        return b
    end
    local cfg = config.get()
    local pool = cfg and cfg.pools[pool_name]
    if not pool then
        return nil, "no pool " .. tostring(pool_name) .. " in the config"
    end
    local rt = config.runtime()
    return build(pool_name, pool, rt and rt.pools[pool_name])
end

--- balance(pool_name): the balancer_by_lua_block of upstream pool_<pool_name>
function _M.balance(pool_name)
    local b = instances[pool_name]
    if not b then
        local err
        b, err = _M.instance(pool_name)
        if not b then
            ngx.log(ngx.ERR, "kvgate balancer: pool ", pool_name, ": ", err)
            return ngx.exit(NGX_BUSY)
        end
    end
    return peers.balance(b.impl, b)
end

--- failed_last(upstream, addr): the last try of a request failed and nginx answers itself
-- (every try failed: @kvgate_upstream_error); no retry calls the balancer to record it, so
-- the node of the last address of $upstream_addr is marked failed here, and the request's
-- in-flight count released (from the restored context, or by that node when the internal
-- redirect dropped the context)
function _M.failed_last(upstream, addr)
    local cfg = config.get()
    local name = cfg and cfg.upstream_pools[upstream or ""]
    local restored = kvctx.restore()
    local counted = restored ~= nil and restored.log.inflight ~= nil
    if counted then
        inflight.finish(restored.log)
    end
    if restored then
        load.finish(restored.log)
    end
    if not name or not addr then
        return
    end
    local last = match(addr, "([^%s,]+)$")
    local id = last and cfg.nodes_by_addr[last]
    if not id then
        return
    end
    if not counted and not (restored and restored.balancer.try) then
        inflight.release(name, id)
    end
    local b = _M.instance(name)
    local node = b and peers.node(b, id)
    if node then
        peers.mark_failed(b, node)
    end
end

return _M
