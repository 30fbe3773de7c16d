-- sse_guard.lua: whole events pass, a partial event is held back, an empty non-eof call
-- after the node finished (nginx's FLUSH on an upstream error) becomes an error event.
local H = dofile("tests/lua/helper.lua")
local guard = require "kvgate.sse_guard"
local cjson = require "cjson.safe"

local EV1 = 'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
local EV2 = 'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
local DONE = "data: [DONE]\n\n"

-- run(chunks) -> what the client gets, failures; chunks: {data, eof, finished}
local function run(chunks, st)
    st = st or guard.new()
    local out, failures = {}, 0
    for _, c in ipairs(chunks) do
        local data, failed = guard.step(st, c[1], c[2] or false, c[3] or false, "n1")
        out[#out + 1] = data == nil and c[1] or data
        if failed then failures = failures + 1 end
    end
    return table.concat(out), failures, st
end

H.test("whole events pass unchanged (nil = no copy)", function()
    local st = guard.new()
    H.eq(guard.step(st, EV1, false, false, "n1"), nil)
    H.eq(guard.step(st, EV1 .. EV2, false, false, "n1"), nil)
    H.eq(guard.step(st, DONE, false, false, "n1"), nil)
    H.eq(guard.step(st, "", true, true, "n1"), nil)
    H.truthy(st.done)
end)

H.test("empty calls of a normal stream never produce an error event", function()
    -- the non-buffered proxy flushes with nothing new while the node is still sending
    local body, failures = run({ { EV1 }, { "" }, { "" }, { EV2 }, { "" }, { DONE }, { "" }, { "", true, true } })
    H.eq(body, EV1 .. EV2 .. DONE)
    H.eq(failures, 0)
end)

H.test("node failure before [DONE]: one error event after the last whole event", function()
    local body, failures = run({ { EV1 }, { "" }, { EV2 }, { "", false, true }, { "", false, true } })
    H.eq(failures, 1)
    H.eq(body:sub(1, #EV1 + #EV2), EV1 .. EV2)
    local ev = body:sub(#EV1 + #EV2 + 1)
    H.truthy(ev:match("^data: .*\n\n$"), ev)
    local obj = cjson.decode(ev:match("^data: (.*)\n\n$"))
    H.eq(obj.error.code, "upstream_failed")
    H.eq(obj.error.type, "server_error")
    H.eq(obj.error.message, "node n1 failed mid-stream; the response is incomplete")
end)

H.test("no error event once [DONE] was seen", function()
    local _, failures = run({ { EV1 }, { DONE }, { "", false, true } })
    H.eq(failures, 0)
end)

H.test("[DONE] inside a content string does not count", function()
    local tricky = 'data: {"choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n'
    local _, failures = run({ { tricky }, { "", false, true } })
    H.eq(failures, 1)
end)

H.test("a partial event is held back until it completes", function()
    local half = math.floor(#EV2 / 2)
    local st = guard.new()
    local out = guard.step(st, EV1 .. EV2:sub(1, half), false, false, "n1")
    H.eq(out, EV1)
    H.eq(guard.step(st, "", false, false, "n1"), nil) -- a normal empty flush keeps holding
    out = guard.step(st, EV2:sub(half + 1), false, false, "n1")
    H.eq(out, EV2)
    -- a chunk with no boundary at all is held whole
    H.eq(guard.step(st, "data: {", false, false, "n1"), "")
    H.eq(guard.step(st, '"x":1}\n\n' .. DONE, false, false, "n1"), 'data: {"x":1}\n\n' .. DONE)
end)

H.test("failure inside an event: the partial event is dropped, not sent", function()
    local body, failures = run({ { EV1 .. EV2:sub(1, 10) }, { "", false, true } })
    H.eq(failures, 1)
    H.eq(body:sub(1, #EV1), EV1)
    H.truthy(body:sub(#EV1 + 1):match('^data: {"'), body)
    H.eq(select(2, body:gsub("\n\n", "")), 2)
end)

H.test("eof flushes what was held", function()
    local body = run({ { EV1 .. "data: [DO" }, { "NE]\n\n", false }, { "", true, true } })
    H.eq(body, EV1 .. DONE)
    body = run({ { EV1 .. "data: partial" }, { "", true, true } })
    H.eq(body, EV1 .. "data: partial")
end)

H.test("CRLF event boundaries", function()
    local a = "data: 1\r\n\r\n"
    local st = guard.new()
    H.eq(guard.step(st, a, false, false, "n1"), nil)
    H.eq(guard.step(st, a .. "data: 2\r\n", false, false, "n1"), a)
    H.eq(guard.step(st, "\r\n", false, false, "n1"), "data: 2\r\n\r\n")
end)

H.test("an event over MAX_HOLD passes as it comes; the error event then starts a new event", function()
    local saved = guard.MAX_HOLD
    guard.MAX_HOLD = 16
    local body, failures = run({ { "data: " .. string.rep("x", 40) }, { "", false, true } })
    guard.MAX_HOLD = saved
    H.eq(failures, 1)
    H.truthy(body:find("^data: x+\n\ndata: {"), body)
end)

H.test("cut: whole events pass, the held partial event is dropped, the shutdown error event ends it", function()
    local st = guard.new()
    local out = guard.step(st, EV1 .. "data: {\"par", false, false, "n1")
    H.eq(out, EV1)
    local last = guard.cut(st, out)
    H.eq(last:sub(1, #EV1), EV1)
    local ev = last:sub(#EV1 + 1)
    H.truthy(ev:find('"code":"gateway_shutdown"', 1, true), ev)
    H.truthy(ev:find('"type":"server_error"', 1, true), ev)
    H.eq(ev:sub(-2), "\n\n")
    -- once ended, nothing more: no second event, and no failure event from a later flush
    H.eq(guard.cut(st, ""), nil)
    H.eq(guard.step(st, "", false, true, "n1"), nil)
end)

H.test("cut after [DONE] changes nothing", function()
    local st = guard.new()
    guard.step(st, EV1 .. DONE, false, false, "n1")
    H.eq(guard.cut(st, EV1 .. DONE), nil)
end)

H.done()
