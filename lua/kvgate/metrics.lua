-- Prometheus metrics in a lua_shared_dict (counters survive reloads), rendered by
-- GET /metrics. Labels are bounded: pools, node ids, statuses, cache outcomes,
-- route-key kinds and fixed op names only — never user, prompt or request ids.
local ngx = ngx
local pairs = pairs
local ipairs = ipairs
local sort = table.sort
local concat = table.concat
local gsub = string.gsub
local format = string.format
local find = string.find
local sub = string.sub
local tostring = tostring

local _M = {}

local DICT = "kvgate_metrics"

_M.FAMILIES = {
    kvgate_requests_total = { "counter", "Requests handled for the OpenAI endpoints, by pool, node, status, cache outcome and route-key kind." },
    kvgate_upstream_response_seconds = { "histogram", "Time from sending the request to a node until its whole response arrived (nginx $upstream_response_time, last node tried)." },
    kvgate_failovers_total = { "counter", "Requests that were retried on another node after an error, timeout, 502 or 503." },
    kvgate_cache_errors_total = { "counter", "Response-cache operations that failed (the request was served as BYPASS or not stored)." },
    kvgate_cache_stores_total = { "counter", "Responses written to the response cache." },
    kvgate_route_key_fallback_total = { "counter", "Requests that had none of the pool's affinity keys and used the fallback route key." },
    kvgate_route_key_shared_prefix_total = { "counter", "Prefix route keys whose window ended before the first user message's text: they cover only a system prompt/tools that many conversations share (a hot key; raise prefix_chars)." },
    kvgate_bad_requests_total = { "counter", "Requests rejected by the gateway before any node was contacted, by status." },
}

_M.BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300 }

local function esc(v)
    return (gsub(tostring(v), '[\\"\n]', { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n" }))
end

--- labels({k=v,...}) -> '{k="v",...}' with sorted keys
function _M.labels(t)
    local keys = {}
    for k in pairs(t) do
        keys[#keys + 1] = k
    end
    sort(keys)
    local parts = {}
    for i = 1, #keys do
        parts[i] = keys[i] .. '="' .. esc(t[keys[i]]) .. '"'
    end
    return "{" .. concat(parts, ",") .. "}"
end

local function dict()
    return ngx.shared[DICT]
end

local function add(key, v)
    local d = dict()
    if not d then
        return
    end
    local _, err, forcible = d:incr(key, v, 0)
    if err then
        ngx.log(ngx.WARN, "kvgate metrics: ", err, " for ", key)
    elseif forcible then
        ngx.log(ngx.WARN, "kvgate metrics dict full: evicted entries; raise its size")
    end
end

--- incr(name, labels_table, v)
function _M.incr(name, labels, v)
    add(name .. _M.labels(labels), v or 1)
end

--- observe(name, labels_table, value) -> histogram sample (cumulative buckets)
function _M.observe(name, labels, value)
    local base = {}
    for k, v in pairs(labels) do
        base[k] = v
    end
    for i = 1, #_M.BUCKETS do
        local le = _M.BUCKETS[i]
        if value <= le then
            base.le = format("%g", le)
            add(name .. "_bucket" .. _M.labels(base), 1)
        end
    end
    base.le = "+Inf"
    add(name .. "_bucket" .. _M.labels(base), 1)
    add(name .. "_sum" .. _M.labels(labels), value)
    add(name .. "_count" .. _M.labels(labels), 1)
end

local function family_of(key)
    local b = find(key, "{", 1, true)
    local name = b and sub(key, 1, b - 1) or key
    if _M.FAMILIES[name] then
        return name
    end
    for _, suffix in pairs({ "_bucket", "_sum", "_count" }) do
        if sub(name, -#suffix) == suffix then
            local base = sub(name, 1, -#suffix - 1)
            if _M.FAMILIES[base] then
                return base
            end
        end
    end
    return name
end

--- render() -> Prometheus text exposition format 0.0.4
function _M.render()
    local d = dict()
    local keys = d and d:get_keys(0) or {}
    sort(keys)
    local by_family, families = {}, {}
    for i = 1, #keys do
        local f = family_of(keys[i])
        if not by_family[f] then
            by_family[f] = {}
            families[#families + 1] = f
        end
        local list = by_family[f]
        list[#list + 1] = keys[i]
    end
    for name in pairs(_M.FAMILIES) do
        if not by_family[name] then
            by_family[name] = {}
            families[#families + 1] = name
        end
    end
    sort(families)
    local out = {}
    for _, f in ipairs(families) do
        local meta = _M.FAMILIES[f] or { "untyped", "" }
        out[#out + 1] = "# HELP " .. f .. " " .. meta[2]
        out[#out + 1] = "# TYPE " .. f .. " " .. meta[1]
        for _, k in ipairs(by_family[f]) do
            local v = d:get(k)
            if v then
                out[#out + 1] = k .. " " .. format("%.17g", v)
            end
        end
    end
    return concat(out, "\n") .. "\n"
end

return _M
