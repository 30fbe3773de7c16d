-- Access-phase cost of the route key's placeholder check and of the completions
-- shared-prefix detector, beside the route key they are added to. Not a test (the
-- runner picks up test_*.lua only). Run from the repo root:
--   luajit tests/lua/bench_route_key.lua
-- Side by side with another route_key.lua (e.g. the one before a change):
--   old=$(mktemp --suffix .lua); git show HEAD~1:lua/kvgate/route_key.lua > "$old"
--   ROUTE_KEY="$old" luajit tests/lua/bench_route_key.lua
-- Inputs vary per call (1000 distinct), so the JIT cannot fold a call away; figures
-- are the best of 5 runs, in microseconds per call.
local ffi = require "ffi"
pcall(ffi.load, "libcrypto.so.3", true)
package.path = "./lua/?.lua;" .. package.path
_G.ngx = _G.ngx or { now = os.time }
local cjson = require "cjson.safe"
local route_key
if os.getenv("ROUTE_KEY") then
    route_key = dofile(os.getenv("ROUTE_KEY"))
    print("route_key: " .. os.getenv("ROUTE_KEY"))
else
    route_key = require "kvgate.route_key"
end
local hot_prefix = require "kvgate.hot_prefix"

local W = 2048
local POOL = { affinity = { "session", "user", "prefix" }, session_header = "X-Session-Id", prefix_chars = W }
local N = 1000

local function bench(name, n, fn)
    for i = 1, math.min(n, 20000) do
        fn(i)
    end
    local best = math.huge
    for _ = 1, 5 do
        local t = os.clock()
        for i = 1, n do
            fn(i)
        end
        best = math.min(best, (os.clock() - t) / n * 1e6)
    end
    print(string.format("%-62s %8.3f us", name, best))
end

local function pick(t, i)
    return t[(i - 1) % #t + 1]
end

local TEMPLATE = string.rep("Q: an example question, with some words?\nA: an example answer.\n", 70) -- ~4.5 kB
local chats, completions, short_ids, uuid_ids, nulls, users = {}, {}, {}, {}, {}, {}
for i = 1, N do
    chats[i] = cjson.decode(cjson.encode({ model = "m", messages = {
        { role = "system", content = string.rep("You are a helpful assistant. ", 20) },
        { role = "user", content = "Tell me about river number " .. i .. ", its sources and its delta." } } }))
    completions[i] = { model = "m", prompt = TEMPLATE .. "Q: what is " .. i .. " plus 2?\nA:" }
    short_ids[i] = { ["X-Session-Id"] = "session-" .. i }
    uuid_ids[i] = { ["X-Session-Id"] = string.format("%08x-8b7d-4c3a-9e21-0d5b6a7c8e9f", i) }
    nulls[i] = { ["X-Session-Id"] = ({ "null", "undefined", "None" })[i % 3 + 1] }
    users[i] = cjson.decode(cjson.encode({ model = "m", messages = chats[i].messages, user = "user-" .. i }))
end
local empty = {}

print("-- route_key.compute (access phase), W = " .. W)
bench("chat, session 'session-<i>'", 1e6, function(i) return route_key.compute(pick(chats, i), "chat", pick(short_ids, i), POOL, "f") end)
bench("chat, session uuid", 1e6, function(i) return route_key.compute(pick(chats, i), "chat", pick(uuid_ids, i), POOL, "f") end)
bench("chat, user 'user-<i>'", 1e6, function(i) return route_key.compute(pick(users, i), "chat", empty, POOL, "f") end)
bench("chat, no header -> prefix (sha256 of the window)", 1e5, function(i) return route_key.compute(pick(chats, i), "chat", empty, POOL, "f") end)
bench("chat, session null/undefined/None -> prefix", 1e5, function(i) return route_key.compute(pick(chats, i), "chat", pick(nulls, i), POOL, "f") end)
bench("completions 4.5 kB, no header -> prefix", 1e5, function(i) return route_key.compute(pick(completions, i), "completions", empty, POOL, "f") end)

print("-- hot_prefix.observe (access phase, completions routed by prefix only)")
local det = hot_prefix.new()
local shorts = {}
for i = 1, N do
    shorts[i] = "a short prompt " .. i
end
bench("prompt shorter than the window (skipped)", 2e6, function(i) return hot_prefix.observe(det, "k0", pick(shorts, i), W, 0) end)
local conv, turns = TEMPLATE, {}
for i = 1, N do
    conv = conv .. " turn " .. i
    turns[i] = conv
end
bench("one conversation, each prompt extends the last", 2e6, function(i) return hot_prefix.observe(det, "k1", pick(turns, i), W, 0) end)
bench("shared template, distinct tails (4 tips, a new chain each)", 1e6,
    function(i) return hot_prefix.observe(det, "k2", pick(completions, i).prompt, W, 0) end)
local keys = {}
for i = 1, 4096 do
    keys[i] = "default:" .. string.format("%064x", i)
end
bench("4096 fingerprints in turn (2048 kept: each a miss + eviction)", 1e6,
    function(i) return hot_prefix.observe(det, pick(keys, i), pick(completions, i).prompt, W, 0) end)
