-- Per-node in-flight gauge (kvgate_upstream_inflight): read by the control plane's drain
-- and by the least_conn balancer.
--
-- One counter per (pool, node) in lua_shared_dict kvgate_inflight, keyed by the label
-- string ('{node="n1",pool="p"}'): +1 when the balancer picks the node for the request's
-- first try (kvgate.balancer.peers), moved to the next node by a failover, -1 when the node's
-- answer ends: in the body filter at its last buffer (kvgate.phase.body_filter, before those
-- bytes are written: the log phase runs after them, and only after a lingering close, so a
-- client that sent its next request at once found the node still counted), else in the log
-- phase of the same request (a client abort, an error nginx answers itself), or in
-- @kvgate_upstream_error when every try failed (release_addr: the redirect gives the request
-- a fresh ngx.ctx unless the context was stashed). A client abort is no node failure: the
-- request ends (499) without a retry, so no failure mark and no breaker count. Cache hits never reach the balancer and
-- are not counted. Shared dicts survive `nginx -s reload`, so the streams an old worker is
-- still finishing keep counting and decrement the same key.
--
-- The counted key lives in a holder table: the balancer's is the request context's
-- kctx.log (kvgate.ctx). A caller passing ngx.ctx itself or the whole kctx means that same
-- kctx.log, so the header filter's begin() (from before the balancer counted) is a no-op
-- and a finish() from any phase releases the count once.
local metrics = require "kvgate.metrics"
local kvctx = require "kvgate.ctx"

local ngx = ngx
local pairs = pairs
local ipairs = ipairs
local type = type

local _M = {}

local DICT = "kvgate_inflight"
local NAME = "kvgate_upstream_inflight"

local the_dict
local function dict()
    local d = the_dict
    if d == nil then
        d = ngx.shared[DICT]
        the_dict = d
    end
    return d
end

local keys = {} -- pool -> node -> label string (built once: labels() sorts and concatenates)

--- key(pool, node) -> the dict key (= the sample's label string)
function _M.key(pool, node)
    local p = keys[pool]
    if not p then
        p = {}
        keys[pool] = p
    end
    local k = p[node]
    if not k then
        k = metrics.labels({ pool = pool, node = node })
        p[node] = k
    end
    return k
end

-- holder(t) -> the table that keeps the request's counted key
local function holder(t)
    if t == nil or t == ngx.ctx then
        return kvctx.get().log
    end
    local log = t.log
    if type(log) == "table" and t.balancer ~= nil then
        return log -- a whole kctx
    end
    return t
end

local function incr(d, key, v)
    local n, err = d:incr(key, v, 0)
    if err then
        ngx.log(ngx.WARN, "kvgate inflight: ", err, " for ", key)
        return nil
    end
    if n < 0 then
        -- never below 0 (a release without its count: a worker that crashed, an old dict)
        d:incr(key, -n)
    end
    return n
end

--- begin(h, pool, node[, key]): count the request on its node, once per request (h: the
-- holder, kctx.log; key: _M.key(pool, node) when the caller has it)
function _M.begin(h, pool, node, key)
    h = holder(h)
    local d = dict()
    if not d or h.inflight then
        return
    end
    key = key or _M.key(pool, node)
    if incr(d, key, 1) then
        h.inflight = key
    end
end

--- take(h, key): begin() for the balancer, which has its holder (kctx.log) and the node's key
function _M.take(h, key)
    if h.inflight then
        return
    end
    local d = dict()
    if d and incr(d, key, 1) then
        h.inflight = key
    end
end

--- move(h, pool, node[, key]): a failover: the count goes from the last node to this one
function _M.move(h, pool, node, key)
    h = holder(h)
    local d = dict()
    if not d then
        return
    end
    key = key or _M.key(pool, node)
    local prev = h.inflight
    if prev == key then
        return
    end
    if prev then
        incr(d, prev, -1)
        h.inflight = nil
    end
    if incr(d, key, 1) then
        h.inflight = key
    end
end

--- finish(h): the request ended (log phase); only a counted request is decremented
function _M.finish(h)
    h = holder(h)
    local key = h.inflight
    if not key then
        return
    end
    h.inflight = nil
    local d = dict()
    if d then
        incr(d, key, -1)
    end
end

--- counted(h) -> true when the request holds a count
function _M.counted(h)
    return holder(h).inflight ~= nil
end

--- release(pool, node): -1 on a node without the request's context (every try failed and
-- the internal redirect dropped ngx.ctx: the last node tried held the count)
function _M.release(pool, node)
    local d = dict()
    if d then
        incr(d, _M.key(pool, node), -1)
    end
end

--- count(key) -> requests in flight on the node with that dict key (all workers)
function _M.count(key)
    local d = dict()
    return d and d:get(key) or 0
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
