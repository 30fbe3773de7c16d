-- usage.lua: the answer's usage from its end (JSON, SSE, in any chunking), the cost
-- arithmetic in nano-dollars, the block hashes of the prompt.
local H = dofile("tests/lua/helper.lua")
-- stand-ins for what kvgate.limits (usage.access reuses its ask_usage) loads
_G.ngx = { shared = {}, log = function() end, WARN = 4, now = function() return 0 end }
package.loaded["kvgate.redis"] = {}
local usage = require "kvgate.usage"
local prefix_index = require "kvgate.prefix_index"
local prompt = require "kvgate.prompt"

local JSON = '{"id":"cmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":' ..
    '{"role":"assistant","content":"the \\"usage\\": {\\"prompt_tokens\\": 999} is quoted"},' ..
    '"finish_reason":"stop"}],"usage":{"prompt_tokens":1200,"total_tokens":1207,"completion_tokens":7,' ..
    '"prompt_tokens_details":{"cached_tokens":1024}}}'

local function sse(with_usage, details)
    local ev = {}
    for i = 1, 40 do
        ev[#ev + 1] = 'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":' ..
            '{"content":"tok' .. i .. '"},"finish_reason":null}],"usage": null}\n\n'
    end
    if with_usage then
        ev[#ev + 1] = 'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":' ..
            '{"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340' ..
            (details and ', "prompt_tokens_details": {"cached_tokens": 256}' or '') .. '}}\n\n'
    end
    ev[#ev + 1] = "data: [DONE]\n\n"
    return table.concat(ev)
end

-- feed(s cut into pieces of n bytes) -> what tail() keeps
local function fed(s, n)
    local u = {}
    for i = 1, #s, n do
        usage.feed(u, s:sub(i, i + n - 1), 100 + i)
    end
    return u
end

H.test("parse: a JSON answer's usage, a quoted \"usage\" in the content ignored", function()
    local p, c, cached = usage.parse(JSON)
    H.eq(p, 1200)
    H.eq(c, 7)
    H.eq(cached, 1024)
end)

H.test("parse: a stream's usage chunk after the usage: null events, in any chunking", function()
    local s = sse(true, true)
    for _, n in ipairs({ 1, 3, 7, 64, 200, 511, 512, 4096, #s }) do
        local u = fed(s, n)
        local p, c, cached = usage.parse(usage.tail(u))
        H.eq(p, 300, "chunk " .. n)
        H.eq(c, 40, "chunk " .. n)
        H.eq(cached, 256, "chunk " .. n)
        H.eq(u.first, 101, "the first chunk's time")
    end
end)

H.test("parse: no usage (a stream without its usage chunk, an answer without usage) is unknown", function()
    H.eq(usage.parse(usage.tail(fed(sse(false), 50))), nil)
    H.eq(usage.parse('{"choices":[]}'), nil)
    H.eq(usage.parse('{"choices":[],"usage":null}'), nil)
    H.eq(usage.parse(nil), nil)
    H.eq(usage.tail({}), nil, "no body")
end)

H.test("parse: usage without prompt_tokens_details has 0 cached tokens", function()
    local p, c, cached = usage.parse(usage.tail(fed(sse(true, false), 90)))
    H.eq(p, 300)
    H.eq(c, 40)
    H.eq(cached, 0)
    p, c, cached = usage.parse('{"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":null}}')
    H.eq(cached, 0)
end)

H.test("tail: the last KEEP .. TAIL_BYTES bytes of a long answer, however it was cut", function()
    local body = string.rep("x", 10000) .. JSON
    for _, n in ipairs({ 1, 100, 3000, #body }) do
        local t = usage.tail(fed(body, n))
        H.truthy(#t >= usage.KEEP and #t <= usage.TAIL_BYTES, "length " .. #t)
        H.eq(t, body:sub(-#t), "a suffix, chunk " .. n)
        H.eq(usage.parse(t), 1200)
    end
end)

H.test("read: a hit's entry gives the avoided tokens with cached 0", function()
    local p, c, cached = usage.read({}, string.rep(" ", 5000) .. JSON)
    H.eq(p, 1200)
    H.eq(c, 7)
    H.eq(cached, 0)
    H.eq(usage.read({}, '{"choices":[]}'), nil)
    p = usage.read(fed(JSON, 10), nil)
    H.eq(p, 1200)
end)

-- the demo's prices: $0.10 input, $0.025 cached, $0.40 output per 1M tokens = 100, 25, 400 n$ a token
local PRICES = { input = 100, cached = 25, output = 400, batch_discount = 0.5 }

H.test("costs: a miss pays uncached, cached and output at their prices; the prefix saving", function()
    local cost, s_cache, s_prefix, s_batch = usage.costs(PRICES, 1200, 7, 1024, false, false)
    H.eq(cost, 176 * 100 + 1024 * 25 + 7 * 400) -- 46000
    H.eq(cost, 46000)
    H.eq(s_cache, 0)
    H.eq(s_prefix, 1024 * 75)
    H.eq(s_batch, 0)
end)

H.test("costs: a hit costs 0 and saves the full price of the answer it replayed", function()
    local cost, s_cache, s_prefix, s_batch = usage.costs(PRICES, 1200, 7, 0, true, false)
    H.eq(cost, 0)
    H.eq(s_cache, 1200 * 100 + 7 * 400)
    H.eq(s_prefix, 0)
    H.eq(s_batch, 0)
end)

H.test("costs: a batch request takes the discount off (floor), the rest is the batch saving", function()
    local cost, _, _, s_batch = usage.costs(PRICES, 3, 0, 0, false, true)
    H.eq(cost, 150)
    H.eq(s_batch, 150)
    cost, _, _, s_batch = usage.costs({ input = 3, cached = 3, output = 0, batch_discount = 0.5 }, 1, 0, 0, false, true)
    H.eq(cost, 1, "1.5 n$ floors to 1")
    H.eq(s_batch, 2)
    H.eq(cost + s_batch, 3, "cost + discount = the full price")
end)

H.test("costs: unknown without prices or usage; exact beyond 2^32", function()
    H.eq(usage.costs(nil, 10, 1, 0, false, false), nil)
    H.eq(usage.costs(PRICES, nil, nil, nil, false, false), nil)
    local cost = usage.costs({ input = 60000, cached = 60000, output = 60000 }, 1000000, 1000000, 0, false, false)
    H.eq(string.format("%d", cost), "120000000000")
end)

local function chat(chars)
    return { model = "m", messages = { { role = "system", content = string.rep("s", 100) },
                                       { role = "user", content = string.rep("u", chars) } } }
end

H.test("blocks: the prefix index's chain of the canonical prompt, 16 hex digits a block, capped", function()
    local req = chat(10000)
    local b = usage.blocks(req, "chat", "pool-a", 2048, 64)
    local p = prompt.canonical(req, "chat", 1e9)
    local n = prefix_index.chain(p, 2048, prefix_index.seed("pool-a"), 64)
    H.eq(#b, 16 * n)
    H.eq(n, math.floor(#p / 2048))
    for k = 0, n - 1 do
        H.eq(b:sub(16 * k + 1, 16 * k + 16), require("bit").tohex(prefix_index.hashes[k], 16))
    end
    H.eq(usage.blocks(req, "chat", "pool-a", 2048, 3), b:sub(1, 48), "capped at log_blocks: a leading part")
    H.ne(usage.blocks(req, "chat", "pool-b", 2048, 3), b:sub(1, 48), "seeded by the pool")
    H.eq(usage.blocks(chat(10), "chat", "pool-a", 2048, 64), "", "no full chunk")
    H.eq(usage.blocks(req, "chat", "pool-a", 2048, 0), "", "log_blocks 0: none")
    -- a longer conversation shares the leading blocks of its earlier turn
    local longer = usage.blocks(chat(20000), "chat", "pool-a", 2048, 64)
    H.truthy(#longer > #b)
    H.eq(longer:sub(1, #b), b)
end)

H.test("blocks: the prefix balancer's chain, when it has them, gives the same hashes", function()
    local req = chat(10000)
    local p = prompt.canonical(req, "chat", 1e9)
    local n = prefix_index.chain(p, 2048, prefix_index.seed("pool-a"), 64)
    local chain = require("ffi").string(prefix_index.hashes, 8 * n)
    prefix_index.chain(string.rep("z", 9000), 2048, 7ULL, 64) -- the buffer is another request's now
    local direct = usage.blocks(req, "chat", "pool-a", 2048, 64)
    H.eq(usage.blocks(req, "chat", "pool-a", 2048, 64, chain, true), direct)
    H.eq(usage.blocks(req, "chat", "pool-a", 2048, 2, chain:sub(1, 16), false), direct:sub(1, 32), "enough blocks")
    H.eq(usage.blocks(req, "chat", "pool-a", 2048, 64, chain:sub(1, 16), false), direct, "too few: computed")
end)

H.test("blocks: cost for a 48 KB prompt (printed)", function()
    local req = chat(48 * 1024 - 100)
    local N = 2000
    local t0 = os.clock()
    local b
    for _ = 1, N do
        b = usage.blocks(req, "chat", "pool-a", 2048, 64)
    end
    local us = (os.clock() - t0) / N * 1e6
    H.eq(#b, 16 * 24)
    io.stderr:write(string.format("usage.blocks, 48 KB prompt, 24 blocks: %.1f us\n", us))
    local u = fed(sse(true, true), 64)
    t0 = os.clock()
    for _ = 1, 20000 do
        usage.read(u)
    end
    io.stderr:write(string.format("usage.read of a stream's tail: %.2f us\n", (os.clock() - t0) / 20000 * 1e6))
    t0 = os.clock()
    for _ = 1, 20000 do
        usage.costs(PRICES, 1200, 7, 1024, false, false)
    end
    io.stderr:write(string.format("usage.costs: %.3f us\n", (os.clock() - t0) / 20000 * 1e6))
end)

H.test("value_span: the top-level member only, never one inside a string or a nested object", function()
    local body = '{"model":"m","tools":[{"type":"function","function":{"parameters":{"stream_options":' ..
        '{"type":"object"}}}}],"messages":[{"role":"user","content":"\\"stream_options\\": {}"}],' ..
        '"x":"stream_options","stream":true,"stream_options" : {"include_usage": false}}'
    local s, e = usage.value_span(body, "stream_options")
    H.eq(body:sub(s, e), '{"include_usage": false}')
    local b2 = '{"stream":true,"stream_options":null,"model":"m"}'
    s, e = usage.value_span(b2, "stream_options")
    H.eq(b2:sub(s, e), "null")
    local b3 = '{"stream":true,"stream_options":{},"messages":[]}'
    s, e = usage.value_span(b3, "stream_options")
    H.eq(b3:sub(s, e), "{}")
    H.eq(usage.value_span('{"stream":true,"messages":[{"content":"stream_options"}]}', "stream_options"), nil)
end)

H.done()
