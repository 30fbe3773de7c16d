-- Per-node in-flight gauge for the control plane's drain (kvgate_upstream_inflight).
--
-- One counter per (pool, node) in lua_shared_dict kvgate_inflight, keyed by the label
-- string ('{node="n1",pool="p"}'): +1 in header_filter once the node that answers is
-- known (the last address of $upstream_addr), -1 in the log phase of the same request
-- (which also runs on a client abort). Shared dicts survive `nginx -s reload`, so the
-- streams an old worker is still finishing keep counting and decrement the same key.
local metrics = require "kvgate.metrics"

local ngx = ngx
local pairs = pairs
local ipairs = ipairs

local _M = {}

local DICT = "kvgate_inflight"
local NAME = "kvgate_upstream_inflight"

local function dict()
    return ngx.shared[DICT]
end

--- key(pool, node) -> the dict key (= the sample's label string)
function _M.key(pool, node)
    return metrics.labels({ pool = pool, node = node })
end

--- begin(ctx, pool, node): count the request on its node (once per request)
function _M.begin(ctx, pool, node)
    local d = dict()
    if not d or ctx.inflight then
        return
    end
    local key = _M.key(pool, node)
    local _, err = d:incr(key, 1, 0)
    if err then
        ngx.log(ngx.WARN, "kvgate inflight: ", err, " for ", key)
        return
    end
    ctx.inflight = key
end

--- finish(ctx): the request ended (log phase); only a counted request is decremented
function _M.finish(ctx)
    local key = ctx.inflight
    if not key then
        return
    end
    ctx.inflight = nil
    local d = dict()
    if d then
        d:incr(key, -1, 0)
    end
end

--- values(cfg, d) -> {[labels] = n}: every node of the config (0 without traffic), plus
-- any other key still non-zero (a node removed by a reload while its streams finish)
function _M.values(cfg, d)
    local out = {}
    for pname, pool in pairs(cfg and cfg.pools or {}) do
        for _, node in ipairs(pool.nodes or {}) do
            out[_M.key(pname, node.id)] = 0
        end
    end
    d = d or dict()
    if d then
        local keys = d:get_keys(0)
        for i = 1, #keys do
            local v = d:get(keys[i])
            if v and (v ~= 0 or out[keys[i]]) then
                out[keys[i]] = v
            end
        end
    end
    return out
end

--- lines(cfg) -> sample lines of kvgate_upstream_inflight for metrics.render
function _M.lines(cfg, d)
    return metrics.gauge_lines(NAME, _M.values(cfg, d))
end

_M.NAME = NAME

return _M
