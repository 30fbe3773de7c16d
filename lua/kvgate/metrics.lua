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
local match = string.match
local tostring = tostring
local tonumber = tonumber

local _M = {}

local DICT = "kvgate_metrics"

_M.FAMILIES = {
    kvgate_requests_total = { "counter", "Requests handled for the OpenAI endpoints, by pool, node, status, cache outcome and route-key kind." },
    kvgate_upstream_response_seconds = { "histogram", "Time from sending the request to a node until its whole response arrived (nginx $upstream_response_time, last node tried)." },
    kvgate_failovers_total = { "counter", "Requests passed to another node after a connection error, timeout, 502 or 503 from the first (POST included; never after a byte reached the client)." },
    kvgate_cache_errors_total = { "counter", "Response-cache operations that failed (the request was served as BYPASS or not stored)." },
    kvgate_cache_stores_total = { "counter", "Responses written to the response cache." },
    kvgate_cache_store_skipped_total = { "counter", "200 responses to a cache miss that were served but not stored, by reason (too-large, no-usage, bad-stream, encode-error, no-choices, unfinished, aborted, bad-body, static-unchecked)." },
    kvgate_route_key_fallback_total = { "counter", "Requests that had none of the pool's affinity keys and used the fallback route key." },
    kvgate_route_key_shared_prefix_total = { "counter", "Prefix route keys shared by many different prompts (a hot key; raise prefix_chars): chat, the window ended before the first user message's text (only a system prompt/tools); completions, many prompts that are not turns of one conversation shared the window." },
    kvgate_route_key_sentinel_total = { "counter", "Session headers or user fields holding a placeholder for no id (null, undefined, none, nil, nan, empty), taken as absent: the next affinity source routed the request." },
    kvgate_bad_requests_total = { "counter", "Requests rejected by the gateway before any node was contacted, by status." },
    kvgate_upstream_inflight = { "gauge", "Requests in flight per node: counted from the balancer's pick until the request ends (all workers, across reloads)." },
    kvgate_upstream_load_tokens = { "gauge", "In-flight prefill work per node of the bounded balancers (chash_bounded): estimated prompt tokens of the requests routed there, from the pick until the request ends (all workers)." },
    kvgate_upstream_load_tokens_remote = { "gauge", "The other gateways' in-flight prefill work per node (estimated prompt tokens), as this gateway last read it from Redis (kvgate.gwload, every gateway.load_sync_s); the bounded balancers add it to this gateway's own. Only with more than one gateway member." },
    kvgate_upstream_failover_total = { "counter", "Tries passed on to another node (a connection error, timeout, 502 or 503, or a 403/404 nginx passes on; never after a byte reached the client), by the node left; kvgate_failovers_total counts the requests." },
    kvgate_upstream_breaker_state = { "gauge", "Each node's circuit breaker: 0 closed, 1 open (skipped after failover.breaker_failures failures in a row), 2 half-open (one trial request); written by worker 0 every 0.2 s." },
    kvgate_route_spill_total = { "counter", "Keyed requests a bounded balancer (chash_bounded) sent past their home node because it was over its load bound or its engine's queue over saturated_queue; node = the home that gave way." },
    kvgate_admission_waiting = { "gauge", "Requests waiting in a pool's admission queue at this gateway (all workers)." },
    kvgate_admission_inflight = { "gauge", "Requests holding a slot of a pool's admission queue (node_capacity per serving node) at this gateway." },
    kvgate_admission_wait_seconds = { "histogram", "Time requests waited in a pool's admission queue (seconds; only requests that waited)." },
    kvgate_admission_rejected_total = { "counter", "Requests a pool's admission queue turned away: 503 overloaded (reason = full | timeout), or a client that closed its connection while it waited (aborted, logged 499)." },
    kvgate_ratelimited_total = { "counter", "Requests answered 429 by a tenant's limit (limit = rpm, tpm, session_rpm, key_rpm, key_tpm or concurrency)." },
    kvgate_ratelimit_redis_errors_total = { "counter", "Limited requests whose limits could not be checked in Redis: admitted under the gateway's own fallback limits (limits.on_redis_error: allow) or refused (deny)." },
    kvgate_tokens_total = { "counter", "Tokens the engines computed for answers through the gateway, from each answer's usage: kind = prompt (all prompt tokens), cached (the prompt tokens served from the engine's prefix cache, prompt_tokens_details.cached_tokens) or completion." },
    kvgate_tokens_avoided_total = { "counter", "Tokens no engine computed because the response cache answered (the cached answer's usage): kind = prompt or completion." },
    kvgate_cost_usd_total = { "counter", "Dollars the answers cost at the pool's prices (policy pools[].prices; cache hits cost 0; the batch discount taken off)." },
    kvgate_saved_usd_total = { "counter", "Dollars saved, by lever: cache (a response-cache hit's full price), prefix (cached prompt tokens x (input - cached input price)), batch (the batch discount)." },
    kvgate_stream_errors_total = { "counter", "Streamed (SSE) responses whose node failed or timed out after the headers were sent; the client got an error event." },
    kvgate_stream_cuts_total = { "counter", "Streamed (SSE) responses the gateway ended itself, by reason: shutdown-grace (still streaming when a reloading worker's grace was nearly over; the client got an error event) or shutdown-forced (closed by nginx at the end of worker_shutdown_timeout, no event)." },
    kvgate_request_log_written_total = { "counter", "Request-log entries written to the Redis stream kvgate:log." },
    kvgate_request_log_dropped_total = { "counter", "Request-log entries dropped, by reason (buffer-full, redis-down, redis-error, spill-full)." },
    kvgate_prefix_captures_total = { "counter", "Prompt prefixes sent to Redis for warm-up (SET NX: an existing text is kept)." },
    kvgate_prefix_capture_skipped_total = { "counter", "Prompt prefixes not captured although the pool captures, by reason (too-large, not-chat, no-messages, error-status)." },
    kvgate_redis_master_changes_total = { "counter", "Times the gateway's Redis master, as Sentinel names it (redis.sentinels), changed address: a failover, counted once per gateway by the first worker to see it (docs/sentinel.md)." },
}

_M.BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300 }
local NBUCKETS = #_M.BUCKETS
local LE = {}
for i = 1, NBUCKETS do
    LE[i] = format("%g", _M.BUCKETS[i])
end

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

local function add(d, key, v)
    local _, err, forcible = d:incr(key, v, 0)
    if err then
        ngx.log(ngx.WARN, "kvgate metrics: ", err, " for ", key)
    elseif forcible then
        ngx.log(ngx.WARN, "kvgate metrics dict full: evicted entries; raise its size")
    end
end

--- incr(name, labels_table, v)
function _M.incr(name, labels, v)
    local d = dict()
    if d then
        add(d, name .. _M.labels(labels), v or 1)
    end
end

-- A sample's dict key, memoized per worker by its label values (bounded: pools, nodes,
-- statuses, outcomes, kinds): labels() sorts, escapes and concatenates (~3 µs for five
-- labels), a lookup in the memo is a few table reads. names: the label names; the key is
-- built once per distinct tuple of values.
local function child(t, v)
    local c = t[v]
    if c == nil then
        c = {}
        t[v] = c
    end
    return c
end

local function memo_key(memo, name, names, a, b, c, d, e, f)
    local n = #names
    local t, last
    if n == 1 then
        t, last = memo, a
    elseif n == 2 then
        t, last = child(memo, a), b
    elseif n == 3 then
        t, last = child(child(memo, a), b), c
    elseif n == 4 then
        t, last = child(child(child(memo, a), b), c), d
    elseif n == 5 then
        t, last = child(child(child(child(memo, a), b), c), d), e
    else
        t, last = child(child(child(child(child(memo, a), b), c), d), e), f
    end
    local k = t[last]
    if k == nil then
        local vals = { a, b, c, d, e, f }
        local labels = {}
        for i = 1, n do
            labels[names[i]] = vals[i]
        end
        k = name .. _M.labels(labels)
        t[last] = k
    end
    return k
end

--- counter(name, names) -> incr(v, a, b, c, d, e, f): adds v to the sample whose label values
-- (in the order of names, at most six, none nil) are a .. f; its key is memoized
function _M.counter(name, names)
    local memo = {}
    assert(#names <= 6, "at most six labels")
    return function(v, a, b, c, d, e, f)
        local dd = dict()
        if dd then
            add(dd, memo_key(memo, name, names, a, b, c, d, e, f), v)
        end
    end
end

--- histogram(name, names) -> observe(value, a, b, c, d, e): one sample of histogram name
-- with those label values (as counter())
function _M.histogram(name, names)
    local memo = {}
    assert(#names <= 5, "at most five labels")
    return function(value, a, b, c, d, e)
        local dd = dict()
        if not dd then
            return
        end
        local l = memo_key(memo, "", names, a, b, c, d, e)
        local i = NBUCKETS + 1
        for bi = 1, NBUCKETS do
            if value <= _M.BUCKETS[bi] then
                i = bi
                break
            end
        end
        add(dd, name .. "_count" .. l, 1)
        add(dd, name .. "_sum" .. l, value)
        add(dd, name .. "_bucket" .. l .. "#" .. i, 1)
    end
end

-- Histogram storage: one non-cumulative counter per bucket, key
-- `<name>_bucket{labels}#<i>` (i = NBUCKETS + 1: above the last bound), plus
-- `<name>_sum{labels}` and `<name>_count{labels}`; render() accumulates the buckets.
-- An observation is 3 dict writes. Keys without `#` under `_bucket` are the cumulative
-- layout of older versions (the dict survives a reload): render() skips them, so
-- samples from before an upgrade-by-reload count only in +Inf, _sum and _count.

--- observe(name, labels_table, value) -> one histogram sample
function _M.observe(name, labels, value)
    local d = dict()
    if not d then
        return
    end
    local l = _M.labels(labels)
    local i = NBUCKETS + 1
    for b = 1, NBUCKETS do
        if value <= _M.BUCKETS[b] then
            i = b
            break
        end
    end
    add(d, name .. "_count" .. l, 1)
    add(d, name .. "_sum" .. l, value)
    add(d, name .. "_bucket" .. l .. "#" .. i, 1)
end

local function family_of(key)
    local b = find(key, "{", 1, true)
    local name = b and sub(key, 1, b - 1) or key
    if _M.FAMILIES[name] then
        return name
    end
    for _, suffix in ipairs({ "_bucket", "_sum", "_count" }) do
        if sub(name, -#suffix) == suffix then
            local base = sub(name, 1, -#suffix - 1)
            if _M.FAMILIES[base] then
                return base
            end
        end
    end
    return name
end

local function num(v)
    return format("%.17g", v)
end

-- with_le('{a="x"}', "0.5") -> '{a="x",le="0.5"}'
local function with_le(l, le)
    if l == "{}" then
        return '{le="' .. le .. '"}'
    end
    return sub(l, 1, -2) .. ',le="' .. le .. '"}'
end

local function render_histogram(out, f, keys, d)
    local series, order = {}, {}
    local function get(l)
        local s = series[l]
        if not s then
            s = { buckets = {} }
            series[l] = s
            order[#order + 1] = l
        end
        return s
    end
    local nb, ns, nc = #(f .. "_bucket"), #(f .. "_sum"), #(f .. "_count")
    for _, k in ipairs(keys) do
        local v = d:get(k)
        if v then
            if sub(k, 1, nb) == f .. "_bucket" then
                local l, i = match(sub(k, nb + 1), "^(%b{})#(%d+)$")
                if l then
                    local s = get(l)
                    s.buckets[tonumber(i)] = v
                end
            elseif sub(k, 1, ns) == f .. "_sum" then
                get(sub(k, ns + 1)).sum = v
            elseif sub(k, 1, nc) == f .. "_count" then
                get(sub(k, nc + 1)).count = v
            end
        end
    end
    sort(order)
    for _, l in ipairs(order) do
        local s = series[l]
        local cum = 0
        for i = 1, NBUCKETS do
            cum = cum + (s.buckets[i] or 0)
            out[#out + 1] = f .. "_bucket" .. with_le(l, LE[i]) .. " " .. num(cum)
        end
        cum = cum + (s.buckets[NBUCKETS + 1] or 0)
        local count = s.count or 0
        if count < cum then
            count = cum -- a render between an observation's writes
        end
        out[#out + 1] = f .. "_bucket" .. with_le(l, "+Inf") .. " " .. num(count)
        out[#out + 1] = f .. "_sum" .. l .. " " .. num(s.sum or 0)
        out[#out + 1] = f .. "_count" .. l .. " " .. num(count)
    end
end

--- gauge_lines(values) -> sorted sample lines for a gauge family
-- values: {[labels string as labels() makes it] = number}
function _M.gauge_lines(name, values)
    local keys = {}
    for l in pairs(values) do
        keys[#keys + 1] = l
    end
    sort(keys)
    local out = {}
    for i = 1, #keys do
        out[i] = name .. keys[i] .. " " .. num(values[keys[i]])
    end
    return out
end

--- render(extra) -> Prometheus text exposition format 0.0.4
-- extra (optional): {[family] = {sample line, ...}} for families not kept in the dict
-- (gauges such as kvgate_upstream_inflight, from their own dict)
function _M.render(extra)
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
        if extra and extra[f] then
            local lines = extra[f]
            for i = 1, #lines do
                out[#out + 1] = lines[i]
            end
        elseif meta[1] == "histogram" then
            render_histogram(out, f, by_family[f], d)
        else
            for _, k in ipairs(by_family[f]) do
                local v = d:get(k)
                if v then
                    out[#out + 1] = k .. " " .. num(v)
                end
            end
        end
    end
    return concat(out, "\n") .. "\n"
end

return _M
