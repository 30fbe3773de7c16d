-- Cost of the usage record (kvgate.usage, issue 13) per request: what the body filter adds per
-- chunk (feed), the log phase's usage parse, the block hashes of a 2 KB and a 48 KB chat prompt
-- (the demo trace's median), the usage counters (7 memoized counter adds) and the request log's
-- XADD with the 12 new fields against one without them. Not a test (the runner picks up test_*.lua
-- only). Best of 5 runs, microseconds.
--
-- Under plain luajit the shared dict is a Lua table (the dict's own cost is not in it):
--   luajit tests/lua/bench_usage.lua
-- Inside nginx with the real lua_shared_dict, as tests/lua/bench_prefix.lua says (with
-- `lua_shared_dict kvgate_metrics 16m;` and this file).
local in_nginx = ngx ~= nil and ngx.shared ~= nil and ngx.shared.kvgate_metrics ~= nil
if not in_nginx then
    package.path = "./lua/?.lua;" .. package.path
    local ffi = require "ffi"
    pcall(ffi.load, "libcrypto.so.3", true)
    local store = {}
    local d = {}
    function d.incr(_, k, v, init)
        local cur = store[k] or init
        store[k] = cur + v
        return cur + v
    end
    _G.ngx = { shared = { kvgate_metrics = d }, log = function() end, WARN = 4, now = os.clock,
               worker = { exiting = function() return false end } }
end
package.loaded["kvgate.redis"] = package.loaded["kvgate.redis"] or {}
package.loaded["kvgate.config"] = package.loaded["kvgate.config"] or {}
local usage = require "kvgate.usage"
local limits = require "kvgate.limits"
local reqlog = require "kvgate.reqlog"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local clock = (ngx and ngx.now and in_nginx) and function() ngx.update_time() return ngx.now() end or os.clock

local function best(n, fn)
    local b = math.huge
    for _ = 1, 5 do
        local t0 = clock()
        fn(n)
        local dt = (clock() - t0) / n * 1e6
        if dt < b then b = dt end
    end
    return b
end

local function out(s)
    if in_nginx then ngx.log(ngx.NOTICE, s) else print(s) end
end

-- a 200-token stream as the engine writes it: one event per chunk, the usage event, [DONE]
local EVENTS = {}
for i = 1, 200 do
    EVENTS[i] = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",' ..
        '"choices":[{"index":0,"delta":{"content":" tok' .. i .. '"},"finish_reason":null}],"usage":null}\n\n'
end
EVENTS[#EVENTS + 1] = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",' ..
    '"choices":[],"usage":{"prompt_tokens":12000,"total_tokens":12200,"completion_tokens":200,' ..
    '"prompt_tokens_details":{"cached_tokens":11776}}}\n\n'
EVENTS[#EVENTS + 1] = "data: [DONE]\n\n"
local NEV = #EVENTS

local feed_us = best(2000, function(n)
    for _ = 1, n do
        local u = {}
        for i = 1, NEV do usage.feed(u, EVENTS[i], 1) end
    end
end)
local tail_us = best(2000, function(n)
    for _ = 1, n do
        local t
        for i = 1, NEV do t = limits.tail(t, EVENTS[i]) end
    end
end)
out(string.format("stream of %d chunks: usage.feed %.2f us (%.0f ns a chunk); limits.tail (the TPM " ..
    "settlement's, before) %.2f us", NEV, feed_us, feed_us / NEV * 1000, tail_us))

local u = {}
for i = 1, NEV do usage.feed(u, EVENTS[i], 1) end
out(string.format("usage.read of the stream's end: %.2f us", best(20000, function(n)
    for _ = 1, n do usage.read(u) end
end)))

local function chat(chars, k)
    return { model = "m", messages = { { role = "system", content = string.rep("s", 3600) .. k },
                                       { role = "user", content = string.rep("u", chars) } } }
end
for _, size in ipairs({ 2048, 48 * 1024 }) do
    local reqs = {}
    for k = 1, 64 do reqs[k] = chat(size - 3600, k) end
    local n_blocks = #usage.blocks(reqs[1], "chat", "default", 2048, 64) / 16
    out(string.format("usage.blocks, %d KB prompt (%d blocks): %.2f us", size / 1024, n_blocks,
        best(2000, function(n)
            for i = 1, n do usage.blocks(reqs[i % 64 + 1], "chat", "default", 2048, 64) end
        end)))
end

local M = keys.METRICS
local tokens = metrics.counter(M.tokens, { "tenant", "pool", "kind" })
local cost_usd = metrics.counter(M.cost_usd, { "tenant", "pool" })
local saved = metrics.counter(M.saved_usd, { "tenant", "pool", "lever" })
out(string.format("usage counters (3 tokens + cost + 1 saved, memoized keys): %.2f us", best(20000, function(n)
    for _ = 1, n do
        tokens(12000, "none", "default", "prompt")
        tokens(11776, "none", "default", "cached")
        tokens(200, "none", "default", "completion")
        cost_usd(0.0000123, "none", "default")
        saved(0.0000021, "none", "default", "prefix")
    end
end)))

local BASE = { ts = 1800000000.25, pool = "default", node = "n1", status = 200, cache = "MISS", kind = "prefix",
               fp = string.rep("a", 64), key = "0123456789abcdef", ms = 812, point = 4294967295, tries = 1,
               home = "n1", spill = "", tenant = "team-a" }
local FULL = {}
for k, v in pairs(BASE) do FULL[k] = v end
FULL.key_id, FULL.model, FULL.prompt, FULL.cached, FULL.completion, FULL.ttft = "k-123", "m", 12000, 11776, 200, 95
FULL.batch, FULL.blocks = "", string.rep("0123456789abcdef", 24)
FULL.cost, FULL.saved_cache, FULL.saved_prefix, FULL.saved_batch = 3000000, 0, 2119680, 0
local function batch(e)
    local b = {}
    for i = 1, 256 do b[i] = e end
    return b
end
local b_base, b_full = batch(BASE), batch(FULL)
local CFG = { pools = { default = { hot_window_s = 600 } } }
local per_base = best(200, function(n) for _ = 1, n do reqlog.commands(b_base, 256, CFG, true) end end) / 256
local per_full = best(200, function(n) for _ = 1, n do reqlog.commands(b_full, 256, CFG, true) end end) / 256
out(string.format("request-log XADD (wire format, in the flush timer): %.2f us an entry without the usage fields, " ..
    "%.2f us with them (24 blocks)", per_base, per_full))
