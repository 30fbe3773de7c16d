-- PURE: the runtime document the control plane pushes (POST /kvgate/config, conf/runtime.json)
-- checked against the static config, and the runtime a kvgate.json implies without one.
-- Kept apart from kvgate.config (the stores and the sync) so it is tested under luajit alone.

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local floor = math.floor
local sort = table.sort

local _M = {}

-- the balancer names a runtime may give a pool (kvgate.balancer.IMPLEMENTATIONS)
_M.BALANCERS = { chash = true, round_robin = true, least_conn = true, chash_bounded = true, prefix = true }
-- the balancers that route on the route key itself (the route stage hashes the prefix for them)
_M.HASHES_KEY = { chash = true, chash_bounded = true, prefix = true }
-- a pool's bound_factor (chash_bounded's c): > 1 and at most this
_M.MAX_BOUND_FACTOR = 100
_M.MAX_SATURATED_QUEUE = 1000000
-- what chash_bounded counts as a node's load (kvgate.balancer.chash_bounded)
_M.BOUND_LOADS = { prefill_tokens = true, requests = true }
-- the largest nginx-scale weight a push may carry: policy base 10 × WEIGHT_SCALE 100 ×
-- capacity 4 is 4000; a chash node has 160 points per unit, so this bounds a ring's memory
_M.MAX_WEIGHT = 10000
_M.MAX_NAMESPACE = 2 ^ 53
-- the longest node state (the control plane's names: active, draining ...): a free string of
-- megabytes would fill the kvgate_config dict
_M.MAX_STATE_BYTES = 64

-- ---------------------------------------------------------------- validation (pure)
local function sorted_keys(t)
    local keys = {}
    for k in pairs(t) do
        keys[#keys + 1] = tostring(k)
    end
    sort(keys)
    return keys
end

-- is_object(v): a decoded JSON object (a non-empty array has integer keys; `[]` and `{}`
-- decode alike and pass as an empty object)
local function is_object(v)
    return type(v) == "table" and #v == 0
end

local function is_int(v, max)
    return type(v) == "number" and v >= 0 and v <= max and floor(v) == v
end

-- only(t, allowed, at) -> nil | message, param: t has no key outside `allowed`
local function only(t, allowed, at)
    for _, k in ipairs(sorted_keys(t)) do
        if not allowed[k] then
            return "unknown field " .. k, at .. k
        end
    end
    return nil
end

--- check_runtime(doc, cfg) -> true | nil, message, param
-- doc: a decoded POST body (or runtime.json); cfg: the static config. Every pool and node of
-- cfg must be present, and nothing else: {pools = {[pool] = {balancer = <known name>,
-- bound_factor = <number in (1, MAX_BOUND_FACTOR], optional>, bound_load = <"prefill_tokens" |
-- "requests", optional>, saturated_queue = <integer
-- 0..MAX_SATURATED_QUEUE, optional: absent = no saturation> (chash_bounded's; other
-- balancers ignore them), nodes = {[id] = {weight = <integer 0..MAX_WEIGHT>, state = <non-empty string>,
-- home_weight = <integer 1..MAX_WEIGHT, optional: the weight on the home ring, see
-- kvgate.balancer.peers.nodes>}}}},
-- cache = {namespace_version = <integer >= 0>, knowledge = {[pool] = <integer >= 1>} (optional)}}. param: the path of the first bad field
-- (keys in sorted order), e.g. "pools.p1.nodes.n2.weight"; a pool added or removed is a
-- structural change (a reload), never a push.
function _M.check(doc, cfg)
    if not is_object(doc) then
        return nil, "the runtime must be a JSON object", nil
    end
    local msg, param = only(doc, { pools = true, cache = true }, "")
    if msg then
        return nil, msg, param
    end
    local pools = doc.pools
    if not is_object(pools) then
        return nil, "pools must be an object of every pool", "pools"
    end
    for _, name in ipairs(sorted_keys(pools)) do
        if not cfg.pools[name] then
            return nil, "no pool " .. name .. " in the gateway's config (adding a pool needs a reload)",
                "pools." .. name
        end
    end
    for _, name in ipairs(sorted_keys(cfg.pools)) do
        local at = "pools." .. name
        local p = pools[name]
        if p == nil then
            return nil, "pool " .. name .. " is missing (removing a pool needs a reload)", at
        end
        if not is_object(p) then
            return nil, at .. " must be an object", at
        end
        msg, param = only(p, { balancer = true, nodes = true, bound_factor = true, bound_load = true,
            saturated_queue = true }, at .. ".")
        if msg then
            return nil, msg, param
        end
        if type(p.balancer) ~= "string" or not _M.BALANCERS[p.balancer] then
            return nil, at .. ".balancer must be one of " .. table.concat(sorted_keys(_M.BALANCERS), ", "),
                at .. ".balancer"
        end
        local bf = p.bound_factor
        if bf ~= nil and (type(bf) ~= "number" or not (bf > 1 and bf <= _M.MAX_BOUND_FACTOR)) then
            return nil, at .. ".bound_factor must be a number > 1 and <= " .. _M.MAX_BOUND_FACTOR,
                at .. ".bound_factor"
        end
        if p.bound_load ~= nil and not _M.BOUND_LOADS[p.bound_load] then
            return nil, at .. ".bound_load must be prefill_tokens or requests", at .. ".bound_load"
        end
        if p.saturated_queue ~= nil and not is_int(p.saturated_queue, _M.MAX_SATURATED_QUEUE) then
            return nil, at .. ".saturated_queue must be an integer from 0 to " .. _M.MAX_SATURATED_QUEUE,
                at .. ".saturated_queue"
        end
        local nodes = p.nodes
        if not is_object(nodes) then
            return nil, at .. ".nodes must be an object of every node of the pool", at .. ".nodes"
        end
        local ids = {}
        for _, n in ipairs(cfg.pools[name].nodes or {}) do
            ids[tostring(n.id)] = true
        end
        for _, id in ipairs(sorted_keys(nodes)) do
            if not ids[id] then
                return nil, "no node " .. id .. " in pool " .. name .. " (adding a node needs a reload)",
                    at .. ".nodes." .. id
            end
        end
        for _, id in ipairs(sorted_keys(ids)) do
            local nat = at .. ".nodes." .. id
            local n = nodes[id]
            if n == nil then
                return nil, "node " .. id .. " is missing (removing a node needs a reload)", nat
            end
            if not is_object(n) then
                return nil, nat .. " must be an object", nat
            end
            msg, param = only(n, { weight = true, state = true, home_weight = true }, nat .. ".")
            if msg then
                return nil, msg, param
            end
            if not is_int(n.weight, _M.MAX_WEIGHT) then
                return nil, nat .. ".weight must be an integer from 0 to " .. _M.MAX_WEIGHT, nat .. ".weight"
            end
            -- optional (a control plane older than the home ring sends none: the balancer
            -- then takes the weight, or the node's base weight when the weight is 0)
            if n.home_weight ~= nil and (not is_int(n.home_weight, _M.MAX_WEIGHT) or n.home_weight < 1) then
                return nil, nat .. ".home_weight must be an integer from 1 to " .. _M.MAX_WEIGHT,
                    nat .. ".home_weight"
            end
            if type(n.state) ~= "string" or n.state == "" or #n.state > _M.MAX_STATE_BYTES then
                return nil, nat .. ".state must be a non-empty string of at most " .. _M.MAX_STATE_BYTES
                    .. " bytes", nat .. ".state"
            end
        end
    end
    local cache = doc.cache
    if not is_object(cache) then
        return nil, "cache must be an object with namespace_version", "cache"
    end
    msg, param = only(cache, { namespace_version = true, knowledge = true }, "cache.")
    if msg then
        return nil, msg, param
    end
    if not is_int(cache.namespace_version, _M.MAX_NAMESPACE) then
        return nil, "cache.namespace_version must be an integer >= 0", "cache.namespace_version"
    end
    -- optional: pool -> the semantic cache's knowledge_version in force (kvgate.semantic)
    local kn = cache.knowledge
    if kn ~= nil then
        if not is_object(kn) then
            return nil, "cache.knowledge must be an object of pool -> knowledge_version", "cache.knowledge"
        end
        for _, name in ipairs(sorted_keys(kn)) do
            local at = "cache.knowledge." .. name
            if not cfg.pools[name] then
                return nil, "no pool " .. name .. " in the gateway's config", at
            end
            if not is_int(kn[name], _M.MAX_NAMESPACE) or kn[name] < 1 then
                return nil, at .. " must be an integer >= 1", at
            end
        end
    end
    return true
end

--- base_runtime(cfg) -> runtime document from kvgate.json alone: each pool's balancer, each
-- node's weight (0 = not taking traffic) and state, the cache namespace version
function _M.base(cfg)
    local pools = {}
    for name, pool in pairs(cfg.pools) do
        local nodes = {}
        for _, n in ipairs(pool.nodes or {}) do
            local w = tonumber(n.base_weight or n.weight) or 0
            nodes[tostring(n.id)] = { weight = w, state = n.state or (w > 0 and "active" or "down") }
        end
        pools[name] = { balancer = pool.base_balancer or pool.balancer, nodes = nodes,
                        bound_factor = tonumber(pool.bound_factor), saturated_queue = tonumber(pool.saturated_queue),
                        bound_load = pool.bound_load }
    end
    local cache = { namespace_version = tonumber(cfg.cache.namespace_version) or 0 }
    for name, pool in pairs(cfg.pools) do
        local sem = pool.semantic
        if type(sem) == "table" and tonumber(sem.knowledge_version) then
            cache.knowledge = cache.knowledge or {}
            cache.knowledge[name] = tonumber(sem.knowledge_version)
        end
    end
    return { pools = pools, cache = cache }
end

-- ---------------------------------------------------------------- the shared dict

return _M
