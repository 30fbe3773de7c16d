-- metrics.lua against a stand-in for the lua_shared_dict (incr/get/get_keys).
local H = dofile("tests/lua/helper.lua")

local store = {}
local dict = {
    incr = function(_, k, v, init)
        store[k] = (store[k] or init) + v
        return store[k], nil, false
    end,
    get = function(_, k) return store[k] end,
    get_keys = function()
        local keys = {}
        for k in pairs(store) do keys[#keys + 1] = k end
        return keys
    end,
}
_G.ngx = { shared = { kvgate_metrics = dict }, log = function() end, WARN = 4 }
local metrics = require "kvgate.metrics"

local function samples(text, prefix)
    local out = {}
    for line in text:gmatch("[^\n]+") do
        if line:sub(1, #prefix) == prefix then out[#out + 1] = line end
    end
    return out
end

H.test("an observation writes one bucket, _sum and _count", function()
    store = {}
    metrics.observe("kvgate_upstream_response_seconds", { pool = "p", node = "n1" }, 0.3)
    local n = 0
    for _ in pairs(store) do n = n + 1 end
    H.eq(n, 3)
end)

H.test("buckets render cumulative, in numeric order, +Inf last", function()
    store = {}
    local L = { pool = "p", node = "n1" }
    for _, v in ipairs({ 0.001, 0.3, 0.3, 2, 7, 500 }) do
        metrics.observe("kvgate_upstream_response_seconds", L, v)
    end
    metrics.observe("kvgate_upstream_response_seconds", { pool = "p", node = "n2" }, 1)
    local text = metrics.render()
    local lines = samples(text, 'kvgate_upstream_response_seconds_bucket{node="n1"')
    H.eq(#lines, #metrics.BUCKETS + 1)
    local prev_le, prev_v = -1, -1
    for i, line in ipairs(lines) do
        local le, v = line:match('le="([^"]+)"} (%S+)$')
        local x = le == "+Inf" and math.huge or tonumber(le)
        H.truthy(x > prev_le, "order at " .. line)
        H.truthy(tonumber(v) >= prev_v, "cumulative at " .. line)
        if i == #lines then H.eq(le, "+Inf") end
        prev_le, prev_v = x, tonumber(v)
    end
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n1",pool="p",le="0.005"} 1\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n1",pool="p",le="0.5"} 3\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n1",pool="p",le="2.5"} 4\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n1",pool="p",le="300"} 5\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n1",pool="p",le="+Inf"} 6\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_count{node="n1",pool="p"} 6\n', 1, true), text)
    H.truthy(text:find('kvgate_upstream_response_seconds_bucket{node="n2",pool="p",le="1"} 1\n', 1, true), text)
    H.truthy(text:find("# TYPE kvgate_upstream_response_seconds histogram", 1, true))
end)

H.test("keys of the old cumulative layout are skipped", function()
    store = {}
    store['kvgate_upstream_response_seconds_bucket{le="0.5",node="n1",pool="p"}'] = 4
    store['kvgate_upstream_response_seconds_bucket{le="+Inf",node="n1",pool="p"}'] = 4
    store['kvgate_upstream_response_seconds_count{node="n1",pool="p"}'] = 4
    store['kvgate_upstream_response_seconds_sum{node="n1",pool="p"}'] = 1
    metrics.observe("kvgate_upstream_response_seconds", { pool = "p", node = "n1" }, 0.3)
    local text = metrics.render()
    H.truthy(text:find('le="0.5"} 1\n', 1, true), text)
    H.truthy(text:find('le="+Inf"} 5\n', 1, true), text)
    H.eq(#samples(text, "kvgate_upstream_response_seconds_bucket"), #metrics.BUCKETS + 1)
end)

H.test("counters and every family's HELP/TYPE", function()
    store = {}
    metrics.incr("kvgate_cache_store_skipped_total", { reason = "too-large" })
    metrics.incr("kvgate_cache_store_skipped_total", { reason = "too-large" })
    local text = metrics.render()
    H.truthy(text:find('kvgate_cache_store_skipped_total{reason="too-large"} 2\n', 1, true), text)
    H.truthy(text:find("# TYPE kvgate_cache_store_skipped_total counter", 1, true), text)
    for name in pairs(metrics.FAMILIES) do
        H.truthy(text:find("# HELP " .. name .. " ", 1, true), name)
    end
end)

H.test("counter() and histogram(): the same samples as incr() and observe(), keys memoized", function()
    for k in pairs(store) do store[k] = nil end
    local c = metrics.counter("kvgate_requests_total", { "pool", "node", "status", "cache", "route_key_kind" })
    c(1, "p", "n1", "200", "MISS", "prefix")
    c(2, "p", "n1", "200", "MISS", "prefix")
    metrics.incr("kvgate_requests_total", { pool = "p", node = "n1", status = "200", cache = "MISS",
        route_key_kind = "prefix" })
    local key = 'kvgate_requests_total{cache="MISS",node="n1",pool="p",route_key_kind="prefix",status="200"}'
    H.eq(store[key], 4)
    c(1, "p", "n2", "502", "BYPASS", "session")
    H.eq(store['kvgate_requests_total{cache="BYPASS",node="n2",pool="p",route_key_kind="session",status="502"}'], 1)
    -- six labels (the requests counter's, tenant first since issue 12)
    local c6 = metrics.counter("kvgate_requests_total", { "tenant", "pool", "node", "status", "cache", "route_key_kind" })
    c6(1, "t1", "p", "n1", "200", "MISS", "prefix")
    c6(1, "t2", "p", "n1", "200", "MISS", "prefix")
    H.eq(store['kvgate_requests_total{cache="MISS",node="n1",pool="p",route_key_kind="prefix",status="200",tenant="t1"}'], 1)
    H.eq(store['kvgate_requests_total{cache="MISS",node="n1",pool="p",route_key_kind="prefix",status="200",tenant="t2"}'], 1)
    local h = metrics.histogram("kvgate_upstream_response_seconds", { "pool", "node" })
    h(0.02, "p", "n1")
    metrics.observe("kvgate_upstream_response_seconds", { pool = "p", node = "n1" }, 0.02)
    H.eq(store['kvgate_upstream_response_seconds_count{node="n1",pool="p"}'], 2)
    local one = metrics.counter("kvgate_failovers_total", { "pool" })
    one(1, 'a"b')
    H.eq(store['kvgate_failovers_total{pool="a\\"b"}'], 1)
end)

H.done()
