-- warm/prefix_doc.lua: the warm-up prefix document is cut from the raw body, bytes as sent.
local H = dofile("tests/lua/helper.lua")
local prefix_doc = require "kvgate.warm.prefix_doc"
local cjson = require "cjson.safe"

local BIG = 65536

H.test("messages up to and including the first user message; model; tools as sent", function()
    local body = [[{"model": "m", "stream": true,
      "tools": [{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}},"required":[]}}}],
      "messages": [ {"role":"system","content":"You are \"helpful\" [really] {ok}"},
                    {"content":"first question","role":"user"},
                    {"role":"assistant","content":"answer"},
                    {"role":"user","content":"second"} ],
      "temperature": 0.5}]]
    local doc = assert(prefix_doc.build(body, BIG))
    local obj = assert(cjson.decode(doc), doc)
    H.eq(obj.model, "m")
    H.eq(#obj.messages, 2)
    H.eq(obj.messages[2].content, "first question")
    -- the tools bytes are copied: key order and the empty list survive
    H.truthy(doc:find('"properties":{"z":{},"a":{}},"required":[]', 1, true), doc)
    H.truthy(doc:find('{"content":"first question","role":"user"}', 1, true), doc)
    H.eq(obj.stream, nil)
    H.eq(obj.temperature, nil)
end)

H.test("no tools key without a tools list; null tools are left out", function()
    local doc = assert(prefix_doc.build('{"messages":[{"role":"user","content":"x"}],"model":"m","tools":null}', BIG))
    H.eq(doc, '{"model":"m","messages":[{"role":"user","content":"x"}]}')
end)

H.test("without a user message every message is kept", function()
    local doc = assert(prefix_doc.build('{"model":"m","messages":[{"role":"system","content":"s"},{"role":"assistant","content":"a"}]}', BIG))
    H.eq(#cjson.decode(doc).messages, 2)
end)

H.test("escaped quotes and brackets inside strings do not confuse the scanner", function()
    local body = '{"model":"m","x":"}]\\"[{","messages":[{"role":"user","content":"a\\\\\\"]}"}]}'
    local doc = assert(prefix_doc.build(body, BIG))
    local obj = assert(cjson.decode(doc), doc)
    H.eq(obj.messages[1].content, 'a\\"]}')
end)

H.test("too large, no messages, not an object", function()
    local long = string.rep("x", 500)
    local doc, why = prefix_doc.build('{"model":"m","messages":[{"role":"user","content":"' .. long .. '"}]}', 256)
    H.eq(doc, nil)
    H.eq(why, "too-large")
    doc, why = prefix_doc.build('{"model":"m","prompt":"hi"}', BIG)
    H.eq(why, "no-messages")
    doc, why = prefix_doc.build('{"model":"m","messages":[]}', BIG)
    H.eq(why, "no-messages")
    doc, why = prefix_doc.build('[1,2]', BIG)
    H.eq(why, "not-object")
end)

H.test("a later duplicate key wins, as in lua-cjson", function()
    local doc = assert(prefix_doc.build('{"model":"a","messages":[{"role":"user","content":"1"}],"model":"b"}', BIG))
    H.eq(cjson.decode(doc).model, "b")
end)

H.test("the document stays under max_bytes", function()
    local body = '{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"system","content":"'
        .. string.rep("s", 200) .. '"},{"role":"user","content":"u"}]}'
    local full = assert(prefix_doc.build(body, BIG))
    H.truthy(prefix_doc.build(body, #full))
    H.eq(select(2, prefix_doc.build(body, #full - 1)), "too-large")
end)

H.test("escaped quotes and runs of backslashes inside strings end where JSON says", function()
    local cjson = require "cjson.safe"
    for _, text in ipairs({ 'a\\"b', 'a\\\\', '\\\\\\"x"', '"', '\\' }) do
        local body = cjson.encode({ model = "m", messages = { { role = "user", content = text } }, temperature = 0 })
        local doc = assert(prefix_doc.build(body, 1e6))
        H.eq(cjson.decode(doc).messages[1].content, text, text)
    end
end)

H.done()
