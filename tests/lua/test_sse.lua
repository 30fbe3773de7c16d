local H = dofile("tests/lua/helper.lua")
local sse = require "kvgate.sse"
local cjson = require "cjson.safe"

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
    H.eq(sse.complete(STREAM), true)
    H.eq(sse.complete(STREAM:sub(1, 200)), false)
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

H.done()
