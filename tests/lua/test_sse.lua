local H = dofile("tests/lua/helper.lua")
local sse = require "kvgate.sse"
local json = require "kvgate.json"
local cjson = require "cjson.safe"

local function chunk(choice, extra)
    local t = { id = "c1", object = "chat.completion.chunk", created = 1, model = "m", choices = { choice } }
    for k, v in pairs(extra or {}) do t[k] = v end
    return "data: " .. cjson.encode(t) .. "\n\n"
end

local STREAM = table.concat({
    'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
    'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}\n\n',
    'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"stop"}]}\n\n',
    'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
    'data: [DONE]\n\n',
})

H.test("stream -> completion", function()
    local obj = assert(sse.to_completion(STREAM, "chat"))
    H.eq(obj.object, "chat.completion")
    H.eq(obj.choices[1].message.content, "Hello world")
    H.eq(obj.choices[1].finish_reason, "stop")
    H.eq(obj.usage.total_tokens, 5)
end)

H.test("incomplete stream is refused", function()
    H.eq(sse.to_completion(STREAM:gsub("data: %[DONE%]\n\n", ""), "chat"), nil)
    H.eq(sse.to_completion(STREAM:sub(1, 200), "chat"), nil)
    H.truthy(sse.to_completion(STREAM, "chat"))
end)

H.test("completion -> stream -> completion round trip", function()
    local obj = assert(sse.to_completion(STREAM, "chat"))
    local body = sse.from_completion(obj, "chat", true)
    H.truthy(body:find('"choices":[]', 1, true), body)
    local back = assert(sse.to_completion(body, "chat"))
    H.eq(back.choices[1].message.content, "Hello world")
    H.eq(back.usage.total_tokens, 5)
    H.eq(back.id, "c1")
end)

H.test("text completions and tool calls", function()
    local s = 'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n' ..
              'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    local obj = assert(sse.to_completion(s, "completions"))
    H.eq(obj.choices[1].text, "ab")
    local t = 'data: {"id":"t","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call1","type":"function","function":{"name":"get","arguments":"{\\"a\\""}}]}}]}\n\n' ..
              'data: {"id":"t","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n'
    local o2 = assert(sse.to_completion(t, "chat"))
    H.eq(o2.choices[1].message.tool_calls[1]["function"].arguments, '{"a":1}')
    H.eq(o2.choices[1].message.tool_calls[1].id, "call1")
end)

H.test("a cached answer without tool calls replays without a tool_calls key", function()
    -- as stored from a JSON response: "tool_calls": [] decodes to an empty table in cjson
    local entry = '{"id":"j","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,' ..
        '"message":{"role":"assistant","content":"hi","tool_calls":[],"annotations":[]},' ..
        '"logprobs":{"content":[{"token":"hi","logprob":-0.1,"bytes":[104,105],"top_logprobs":[]}]},' ..
        '"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
    local body = sse.from_completion(json.decode_keep(entry), "chat", true)
    H.truthy(not body:find('"tool_calls"', 1, true), body)
    -- the finish chunk's delta is the only object that is empty
    H.truthy(not body:gsub('"delta":{}', ""):find(":{}", 1, true), body)
    H.truthy(body:find('"top_logprobs":[]', 1, true), body)
    H.truthy(body:find('"choices":[]', 1, true), body)
    H.truthy(not body:find('"top_logprobs":{}', 1, true), body)
    -- and tool calls that exist are replayed as a list
    local with_tools = json.decode_keep('{"id":"j","choices":[{"index":0,"message":{"role":"assistant","content":null,' ..
        '"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}')
    body = sse.from_completion(with_tools, "chat", false)
    H.truthy(body:find('"tool_calls":[{', 1, true), body)
end)

H.test("chat logprobs are appended over the chunks, empty lists stay lists", function()
    local function lp(tok)
        return { content = { { token = tok, logprob = -1, bytes = { 1 }, top_logprobs = json.EMPTY_ARRAY } } }
    end
    local s = chunk({ index = 0, delta = { role = "assistant", content = "" }, logprobs = cjson.null, finish_reason = cjson.null }) ..
        chunk({ index = 0, delta = { content = "A" }, logprobs = lp("A"), finish_reason = cjson.null }) ..
        chunk({ index = 0, delta = { content = "B" }, logprobs = lp("B"), finish_reason = "stop" }) ..
        "data: [DONE]\n\n"
    -- the chunks as a node sends them: with "top_logprobs":[]
    s = s:gsub(cjson.encode(json.EMPTY_ARRAY):gsub("%p", "%%%0"), "[]")
    local obj = assert(sse.to_completion(s, "chat"))
    local content = obj.choices[1].logprobs.content
    H.eq(#content, 2); H.eq(content[1].token, "A"); H.eq(content[2].token, "B")
    local text = assert(json.encode_keep(obj))
    H.truthy(text:find('"top_logprobs":[]', 1, true), text)
    H.truthy(not text:find('"tool_calls"', 1, true), text)
    -- the stored entry replays as SSE with the logprobs of both tokens
    local back = assert(sse.to_completion(sse.from_completion(json.decode_keep(text), "chat", false), "chat"))
    H.eq(#back.choices[1].logprobs.content, 2)
end)

H.test("completions logprobs lists are appended; unmergeable logprobs refuse the stream", function()
    local function c(text, off, finish)
        return 'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"' .. text .. '","logprobs":' ..
            '{"tokens":["' .. text .. '"],"token_logprobs":[-0.5],"top_logprobs":[{"' .. text .. '":-0.5}],' ..
            '"text_offset":[' .. off .. ']},"finish_reason":' .. (finish and '"length"' or "null") .. '}]}\n\n'
    end
    local obj = assert(sse.to_completion(c("a", 0) .. c("b", 1, true) .. "data: [DONE]\n\n", "completions"))
    local l = obj.choices[1].logprobs
    H.eq(obj.choices[1].text, "ab")
    H.eq(table.concat(l.tokens), "ab"); H.eq(#l.token_logprobs, 2); H.eq(l.text_offset[2], 1)
    H.eq(#l.top_logprobs, 2)
    local odd = 'data: {"id":"x","choices":[{"index":0,"text":"a","logprobs":{"score":1}}]}\n\ndata: [DONE]\n\n'
    local none, err = sse.to_completion(odd, "completions")
    H.eq(none, nil); H.truthy(err)
end)

H.test("json.decode_keep / encode_keep keep [] apart from {}", function()
    local text = '{"a":[],"b":"x[]y","c":[ ],"d":[1,[]],"e":{},"f":"q\\"[]","g":"\\\\","h":[\n]}'
    local t = assert(json.decode_keep(text))
    H.eq(t.a, json.EMPTY_ARRAY); H.eq(t.b, "x[]y"); H.eq(t.c, json.EMPTY_ARRAY); H.eq(t.d[2], json.EMPTY_ARRAY)
    H.eq(t.f, 'q"[]'); H.eq(t.g, "\\"); H.eq(t.h, json.EMPTY_ARRAY)
    local back = assert(cjson.decode(json.encode_keep(t)))
    H.eq(type(back.e), "table"); H.eq(next(back.e), nil)
    H.truthy(json.encode_keep(t):find('"a":[]', 1, true))
    H.truthy(json.encode_keep(t):find('"e":{}', 1, true))
    H.truthy(json.encode_keep(t):find('"d":[1,[]]', 1, true))
end)

H.test("finished: at least one choice, each with a finish_reason", function()
    H.truthy(sse.finished(assert(sse.to_completion(STREAM, "chat"))))
    local unfinished = STREAM:gsub('"finish_reason":"stop"', '"finish_reason":null')
    local obj = assert(sse.to_completion(unfinished, "chat"))
    H.eq(obj.choices[1].message.content, "Hello world")
    local ok, why = sse.finished(obj)
    H.eq(ok, false)
    H.eq(why, "unfinished")
    -- usage and [DONE] only: no choice at all
    local empty = 'data: {"id":"e","choices":[],"usage":{"total_tokens":1}}\n\ndata: [DONE]\n\n'
    H.eq(select(2, sse.finished(assert(sse.to_completion(empty, "chat")))), "no-choices")
    -- JSON bodies, as cjson and json.decode_keep decode them
    H.eq(select(2, sse.finished(cjson.decode('{"choices":[]}'))), "no-choices")
    H.eq(select(2, sse.finished(json.decode_keep('{"choices":[]}'))), "no-choices")
    H.eq(select(2, sse.finished(cjson.decode('{"object":"chat.completion"}'))), "no-choices")
    H.eq(select(2, sse.finished(cjson.decode('{"choices":[{"index":0}]}'))), "unfinished")
    H.eq(select(2, sse.finished(cjson.decode('{"choices":[{"index":0,"finish_reason":""}]}'))), "unfinished")
    H.eq(select(2, sse.finished(cjson.decode('{"choices":[{"index":0,"finish_reason":"abort"}]}'))), "aborted")
    -- one unfinished choice of two keeps the whole answer out
    H.eq(select(2, sse.finished(cjson.decode(
        '{"choices":[{"index":0,"finish_reason":"stop"},{"index":1,"finish_reason":null}]}'))), "unfinished")
    H.truthy(sse.finished(cjson.decode(
        '{"choices":[{"index":0,"finish_reason":"stop"},{"index":1,"finish_reason":"length"}]}')))
    local two = 'data: {"id":"t","choices":[{"index":0,"text":"a","finish_reason":"stop"},' ..
        '{"index":1,"text":"b","finish_reason":null}]}\n\ndata: [DONE]\n\n'
    H.eq(select(2, sse.finished(assert(sse.to_completion(two, "completions")))), "unfinished")
end)

local REASONING_STREAM = table.concat({
    chunk({ index = 0, delta = { role = "assistant", content = "" }, finish_reason = cjson.null }),
    chunk({ index = 0, delta = { reasoning_content = "Think ", reasoning = "Think " }, finish_reason = cjson.null }),
    chunk({ index = 0, delta = { reasoning_content = "hard.", reasoning = "hard." }, finish_reason = cjson.null }),
    chunk({ index = 0, delta = { content = "4" }, finish_reason = "stop" }),
    'data: [DONE]\n\n',
})

H.test("reasoning is kept like content: stream -> completion -> stream", function()
    local obj = assert(sse.to_completion(REASONING_STREAM, "chat"))
    local msg = obj.choices[1].message
    H.eq(msg.content, "4")
    H.eq(msg.reasoning_content, "Think hard.")
    H.eq(msg.reasoning, "Think hard.")
    local body = sse.from_completion(obj, "chat", false)
    local back = assert(sse.to_completion(body, "chat"))
    H.eq(back.choices[1].message.reasoning_content, "Think hard.")
    H.eq(back.choices[1].message.reasoning, "Think hard.")
    H.eq(back.choices[1].message.content, "4")
    -- the reasoning is replayed before the content
    H.truthy(body:find("reasoning_content", 1, true) < body:find('"content":"4"', 1, true), body)
    -- only the field that came is rebuilt; an answer without reasoning gets none
    local only = table.concat({
        chunk({ index = 0, delta = { role = "assistant", content = "" }, finish_reason = cjson.null }),
        chunk({ index = 0, delta = { reasoning_content = "Think " }, finish_reason = cjson.null }),
        chunk({ index = 0, delta = { reasoning_content = "hard." }, finish_reason = cjson.null }),
        chunk({ index = 0, delta = { content = "4" }, finish_reason = "stop" }),
        'data: [DONE]\n\n',
    })
    local m2 = assert(sse.to_completion(only, "chat")).choices[1].message
    H.eq(m2.reasoning_content, "Think hard.")
    H.eq(m2.reasoning, nil)
    local plain = sse.from_completion(assert(sse.to_completion(STREAM, "chat")), "chat", false)
    H.truthy(not plain:find("reasoning", 1, true), plain)
end)

H.test("a JSON answer with reasoning replays it in deltas", function()
    local entry = json.decode_keep('{"id":"r","object":"chat.completion","created":1,"model":"m","choices":[' ..
        '{"index":0,"message":{"role":"assistant","content":"4","reasoning_content":"why","reasoning":"why"},' ..
        '"finish_reason":"stop","logprobs":null}],"usage":{"total_tokens":3}}')
    local body = sse.from_completion(entry, "chat", true)
    local back = assert(sse.to_completion(body, "chat"))
    H.eq(back.choices[1].message.reasoning_content, "why")
    H.eq(back.choices[1].message.reasoning, "why")
    H.eq(back.choices[1].finish_reason, "stop")
    H.eq(back.usage.total_tokens, 3)
end)

H.done()
