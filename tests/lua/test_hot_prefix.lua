local H = dofile("tests/lua/helper.lua")
-- resty.lrucache reads ngx.now at load (used only for TTLs, which the detector does not set)
_G.ngx = _G.ngx or { now = os.time }
local hot_prefix = require "kvgate.hot_prefix"

local W = 256
local TEMPLATE = string.rep("Q: an example question?\nA: an example answer.\n", 30) -- ~1.4 kB

-- observe n prompts from gen(i) at times t0 + i * dt; returns the flags
local function run(det, key, n, gen, t0, dt)
    local flags = {}
    for i = 1, n do
        flags[i] = hot_prefix.observe(det, key, gen(i), W, (t0 or 0) + (i - 1) * (dt or 0))
    end
    return flags
end

local function count(flags)
    local c = 0
    for i = 1, #flags do
        if flags[i] then
            c = c + 1
        end
    end
    return c
end

H.test("different prompts behind one fingerprint: flagged from the NEW_CHAINS-th on", function()
    local det = hot_prefix.new()
    local flags = run(det, "p:a", 100, function(i) return TEMPLATE .. "Q: question " .. i .. "?\nA:" end)
    for i = 1, hot_prefix.NEW_CHAINS - 1 do
        H.eq(flags[i], false, "request " .. i)
    end
    H.eq(count(flags), 100 - hot_prefix.NEW_CHAINS + 1)
end)

H.test("one conversation (each prompt extends the last) is not flagged", function()
    local det = hot_prefix.new()
    local p = TEMPLATE
    for turn = 1, 200 do
        H.eq(hot_prefix.observe(det, "p:c", p, W, turn), false, "turn " .. turn)
        p = p .. "\nUser: question " .. turn .. "?\nAssistant: an answer."
    end
    -- a short turn (a few bytes) and a repeat of the latest prompt are the same chain
    H.eq(hot_prefix.observe(det, "p:c", p .. "x", W, 300), false)
    H.eq(hot_prefix.observe(det, "p:c", p .. "x", W, 301), false)
end)

H.test("interleaved conversations on one fingerprint start one chain each", function()
    local det = hot_prefix.new()
    local convs = {}
    for c = 1, hot_prefix.NEW_CHAINS - 1 do
        convs[c] = TEMPLATE .. "Conversation " .. c .. ". "
    end
    for turn = 1, 50 do
        for c = 1, #convs do
            H.eq(hot_prefix.observe(det, "p:i", convs[c], W, turn), false, "conv " .. c .. " turn " .. turn)
            convs[c] = convs[c] .. " turn " .. turn .. " more text"
        end
    end
    H.eq(det.lru:get("p:i").chains, hot_prefix.NEW_CHAINS - 1)
    -- one more conversation on the same long shared start: a shared prefix
    H.eq(hot_prefix.observe(det, "p:i", TEMPLATE .. "Conversation new.", W, 51), true)
end)

H.test("prompts that cannot fill the window are not tracked", function()
    local det = hot_prefix.new()
    local flags = run(det, "p:s", 50, function(i) return "short prompt " .. i end)
    H.eq(count(flags), 0)
    H.eq(det.lru:get("p:s"), nil)
end)

H.test("new chains spread wider than WINDOW_S do not flag; the flag expires after HOLD_S", function()
    local det = hot_prefix.new()
    local gap = hot_prefix.WINDOW_S / 2 + 1 -- NEW_CHAINS chains never fit in one window
    local flags = run(det, "p:t", 20, function(i) return TEMPLATE .. i end, 0, gap)
    H.eq(count(flags), 0)
    local det2 = hot_prefix.new()
    flags = run(det2, "p:t", 10, function(i) return TEMPLATE .. i end, 1000, 1)
    H.truthy(flags[10])
    -- one conversation continues alone after the burst: flagged until the hold ends
    local p = TEMPLATE .. "alone"
    H.eq(hot_prefix.observe(det2, "p:t", p, W, 1010), true)
    H.eq(hot_prefix.observe(det2, "p:t", p .. " more", W, 1009 + hot_prefix.HOLD_S + 1), false)
end)

H.test("token-id prompts: chains and trees alike", function()
    local base = {}
    for i = 1, 300 do
        base[i] = 1000 + i
    end
    local function with(extra)
        local t = { unpack(base) }
        for i = 1, #extra do
            t[#t + 1] = extra[i]
        end
        return t
    end
    local det = hot_prefix.new()
    local flags = run(det, "p:k", 30, function(i) return with({ i, i + 1 }) end)
    H.eq(count(flags), 30 - hot_prefix.NEW_CHAINS + 1)
    -- a list of one token list, and one conversation of them
    det = hot_prefix.new()
    local ids = with({})
    for turn = 1, 40 do
        H.eq(hot_prefix.observe(det, "p:kc", { ids }, W, turn), false, "turn " .. turn)
        ids = with({})
        for j = 1, turn do
            ids[#ids + 1] = j
        end
    end
    -- odd shapes are ignored, without an error
    H.eq(hot_prefix.observe(det, "p:x", { {} }, W, 1), false)
    H.eq(hot_prefix.observe(det, "p:x", { true, 1 }, W, 1), false)
    local bad = with({ "x" })
    H.eq(hot_prefix.observe(det, "p:x", bad, W, 1), false)
    H.eq(hot_prefix.observe(det, "p:x", 42, W, 1), false)
end)

H.test("a list of prompts: the first is examined", function()
    local det = hot_prefix.new()
    local flags = run(det, "p:l", 10, function(i) return { TEMPLATE .. i, "second" } end)
    H.eq(count(flags), 10 - hot_prefix.NEW_CHAINS + 1)
end)

H.done()
