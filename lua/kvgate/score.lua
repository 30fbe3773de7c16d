-- A node's load score, for requests without a route key (power of two choices,
-- kvgate.balancer.peers.p2c): lower is better.
--
--   score = (1 + queue) × latency × (1 + kv_weight × kv_use) × mean weight / weight
--
--   queue    the engine's reported `waiting` (kvgate.node_load, its agent's last report; nil
--            when unknown or stale), else the gateway's own requests in flight on the node
--            (kvgate.inflight, all workers): never "idle" for want of a report
--   latency  the node's recent upstream header time (time to first byte, s): an EWMA the log
--            phase keeps per node in lua_shared_dict kvgate_state (observe(): one get and one
--            set per proxied request), kept STALE_S after its last sample; unknown (a node
--            without recent traffic): the pool's mean of the known ones, so a node that went
--            slow is tried again once its figure is stale instead of never
--   kv_use   the engine's reported KV-cache use 0..1 (0 when unknown)
--   weight   the node's serving weight (a heavier node takes proportionally more)
-- A worker reads the latencies into its view every kvgate.balancer.peers.REFRESH_S
-- (refresh()), never in a request.
local ngx = ngx
local shared = ngx.shared
local tostring = tostring

local _M = {}

_M.DICT = "kvgate_state"
_M.STALE_S = 30
_M.ALPHA = 0.3
_M.KV_WEIGHT = 1.0
-- the latency when no node of the pool has a recent figure (all equal: the queue decides)
_M.DEFAULT_LATENCY_S = 0.1

local keys = {} -- pool -> id -> "lat:<pool>:<id>"

--- key(pool, id) -> the node's EWMA key in kvgate_state (memoized)
function _M.key(pool, id)
    local p = keys[pool]
    if not p then
        p = {}
        keys[pool] = p
    end
    local k = p[id]
    if not k then
        k = "lat:" .. pool .. ":" .. tostring(id)
        p[id] = k
    end
    return k
end

--- ewma(prev, sample, alpha) -> the new average (PURE; prev nil: the sample)
function _M.ewma(prev, sample, alpha)
    if prev == nil then
        return sample
    end
    return prev + alpha * (sample - prev)
end

--- observe(pool, id, seconds, alpha): one header-time sample of node id (log phase)
function _M.observe(pool, id, seconds, alpha)
    local d = shared[_M.DICT]
    if not d then
        return
    end
    local k = _M.key(pool, id)
    d:set(k, _M.ewma(d:get(k), seconds, alpha or _M.ALPHA), _M.STALE_S)
end

--- refresh(b): node.lat (nil when unknown) for b's nodes, b.lat_mean (of the known ones)
function _M.refresh(b)
    local d = shared[_M.DICT]
    if not d then
        return
    end
    local sum, n = 0, 0
    local nodes = b.nodes
    for i = 1, #nodes do
        local node = nodes[i]
        local v = d:get(node.lat_key)
        node.lat = v
        if v then
            sum = sum + v
            n = n + 1
        end
    end
    b.lat_mean = n > 0 and sum / n or nil
end

--- score(queue, latency, kv_use, kv_weight, weight, mean_weight) -> the node's score (PURE)
function _M.score(queue, lat, kv, kv_weight, w, wmean)
    return (1 + queue) * lat * (1 + kv_weight * (kv or 0)) * wmean / w
end

return _M
