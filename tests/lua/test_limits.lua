-- kvgate.limits: the buckets a request takes, OpenAI's reset format, the usage of an answer's
-- end, the per-gateway fallback windows (with a stand-in dict). The Redis scripts themselves
-- run against a real Redis in tests/integration/test_ratelimit_script.py.
local H = dofile("tests/lua/helper.lua")

local store = {}
local dict = {
    incr = function(_, k, v, init)
        store[k] = (store[k] or init) + v
        return store[k]
    end,
}
local clock = 1700000000.5
-- the fallback has a dict of its own: its keys (per tenant, key, session) must never evict
-- kvgate_state's fixed-size state (breakers, admission counters, Redis's state)
local untouchable = setmetatable({}, { __index = function(_, k)
    error("the limits' fallback used kvgate_state (" .. tostring(k) .. ")")
end })
_G.ngx = { shared = { kvgate_limits = dict, kvgate_state = untouchable }, log = function() end, WARN = 4,
           now = function() return clock end }
package.loaded["kvgate.redis"] = { down = function() return true end, trip = function() end }
local limits = require "kvgate.limits"

H.test("duration: OpenAI's x-ratelimit-reset format", function()
    H.eq(limits.duration(0), "0ms")
    H.eq(limits.duration(20.2), "21ms")
    H.eq(limits.duration(1000), "1s")
    H.eq(limits.duration(1500), "1.5s")
    H.eq(limits.duration(360000), "6m0s")
    H.eq(limits.duration(-5), "0ms")
end)

local function names(b)
    local out = {}
    for i = 1, #b do
        out[i] = b[i].name
    end
    return table.concat(out, ",")
end

H.test("plan: only the limits that apply, keyed by tenant, session digest and key id", function()
    local lim = { rpm = 60, tpm = 1000, concurrency = 2, session_rpm = 10, key_rpm = 5, key_tpm = 100 }
    local b = limits.plan("t1", lim, { key_id = "key_0123456789ab" }, { kind = "session", key = "s:abc" }, 300,
        600000, "req1")
    H.eq(names(b), "rpm,tpm,session_rpm,key_rpm,key_tpm,concurrency")
    H.eq(b[1].key, "kvgate:rl:t1:rpm")
    H.eq(b[2].cost, 300)
    H.truthy(b[3].key:match("^kvgate:rl:t1:s:%x+:rpm$"), b[3].key)
    H.eq(#b[3].key, #"kvgate:rl:t1:s::rpm" + 16)
    -- a session's bucket holds 2 s of its rate by default (session_rpm 10: one request, every 6 s)
    H.eq(b[3].cap, 1)
    H.eq(b[3].win, 6000)
    H.eq(b[3].limit, 10)
    local s120 = limits.plan("t1", { session_rpm = 120 }, {}, { kind = "session", key = "s:x" }, 1, 1, "r", 5)[1]
    H.eq(s120.cap, 10)
    H.eq(s120.win, 5000)
    H.eq(b[4].key, "kvgate:rl:t1:k:key_0123456789ab:rpm")
    H.eq(b[6].kind, "c")
    H.eq(b[6].cost, "req1")
    -- no session, no key: those limits do not apply
    H.eq(names(limits.plan("t1", lim, {}, { kind = "prefix", key = "p:x" }, 1, 1, "r")), "rpm,tpm,concurrency")
    H.eq(names(limits.plan("t1", {}, {}, {}, 1, 1, "r")), "")
end)

H.test("used_tokens: the last usage of an answer's end, JSON or SSE", function()
    H.eq(limits.used_tokens(nil), nil)
    H.eq(limits.used_tokens('{"choices":[]}'), nil)
    H.eq(limits.used_tokens('..."usage":{"prompt_tokens":10,"completion_tokens":4,"total_tokens":14}}'), 14)
    H.eq(limits.used_tokens('"usage": {"prompt_tokens": 7, "completion_tokens": 3}}'), 10)
    local sse = 'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n' ..
        'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\ndata: [DONE]\n\n'
    H.eq(limits.used_tokens(sse), 7)
end)

H.test("tail: keeps the last TAIL_BYTES across chunks", function()
    local t = limits.tail(nil, "abc")
    H.eq(t, "abc")
    t = limits.tail(t, string.rep("x", limits.TAIL_BYTES))
    H.eq(#t, limits.TAIL_BYTES)
    H.eq(t:sub(-1), "x")
    H.eq(limits.tail(t, nil), t)
end)

H.test("the fallback: fixed windows per gateway, all or nothing, concurrency given back", function()
    local cfg = { limits = { on_redis_error = "allow", fallback_factor = 1 }, redis = {} }
    local b = limits.plan("t", { rpm = 2, concurrency = 5 }, {}, {}, 1, 1000, "r")
    local ok, taken, how = limits.admit(cfg, b)
    H.eq(ok, true)
    H.eq(how, "local")
    limits.release_local(b, taken)
    H.eq(limits.admit(cfg, b), true)
    local refused, detail = limits.admit(cfg, b)
    H.eq(refused, false)
    H.eq(detail[1], 1) -- the rpm window is full
    -- the refused request took nothing: in flight is the second admitted one (the first was released)
    H.eq(store["rl:kvgate:rl:t:concurrency"], 1)
    -- the next minute's window is a new key
    clock = clock + 60
    H.eq(limits.admit(cfg, b), true)
    local deny = { limits = { on_redis_error = "deny" }, redis = {} }
    local no, d, how2 = limits.admit(deny, b)
    H.eq(no, false)
    H.eq(how2, "deny")
    H.truthy(d[2] > 0)
end)

H.test("ask_usage: appended as the last member, whitespace kept, nothing for {}", function()
    H.eq(limits.ask_usage('{"model":"m","stream":true}'), '{"model":"m","stream":true,"stream_options":{"include_usage":true}}')
    H.eq(limits.ask_usage('{"a":1}\n  '), '{"a":1,"stream_options":{"include_usage":true}}\n  ')
    H.eq(limits.ask_usage('{ }'), nil)
    H.eq(limits.ask_usage('[1]'), nil)
end)

local function strip_all(chunks)
    local l, out = {}, {}
    for i, c in ipairs(chunks) do
        out[#out + 1] = limits.strip_usage(l, c, i == #chunks)
    end
    return table.concat(out), l
end

H.test("strip_usage: the usage event and every usage null go, in any chunking", function()
    local with = 'data: {"id": "x", "choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n' ..
        'data: {"id": "x", "choices": [{"delta": {"content": " \\"usage\\": null"}}], "usage": null}\n\n' ..
        'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}\n\n' ..
        'data: [DONE]\n\n'
    local without = 'data: {"id": "x", "choices": [{"delta": {"content": "hi"}}]}\n\n' ..
        'data: {"id": "x", "choices": [{"delta": {"content": " \\"usage\\": null"}}]}\n\n' ..
        'data: [DONE]\n\n'
    H.eq(strip_all({ with }), without)
    for cut = 1, #with - 1 do
        H.eq(strip_all({ with:sub(1, cut), with:sub(cut + 1) }), without, "cut at " .. cut)
    end
    -- byte by byte
    local bytes = {}
    for i = 1, #with do
        bytes[i] = with:sub(i, i)
    end
    H.eq(strip_all(bytes), without)
    -- vLLM's shape (no usage null) and \r\n blank lines pass unchanged
    local v = 'data: {"choices":[{"delta":{}}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    H.eq(strip_all({ v }), v)
    -- an unfinished event goes on at the end
    H.eq(strip_all({ 'data: {"a":1}\n\ndata: {"b"' }), 'data: {"a":1}\n\ndata: {"b"')
end)

H.done()
