local H = dofile("tests/lua/helper.lua")
local request = require "kvgate.request"
local cjson = require "cjson.safe"

local function chat(messages_json)
    return '{"model": "m", "messages": ' .. messages_json .. '}'
end

local function completion(prompt_json)
    return '{"model": "m", "prompt": ' .. prompt_json .. '}'
end

-- parse(body) must refuse with this param and code
local function refused(body, endpoint, param, code)
    local req, msg, p, c = request.parse(body, endpoint)
    H.eq(req, nil, "accepted: " .. body)
    H.eq(p, param, "param of " .. body)
    H.eq(c, code, "code of " .. body)
    H.truthy(type(msg) == "string" and #msg > 0, "a message")
    return msg
end

local function accepted(body, endpoint)
    local req, msg = request.parse(body, endpoint)
    H.truthy(type(req) == "table", "refused " .. body .. ": " .. tostring(msg))
end

H.test("chat: messages missing, a string, an object, [] and {}", function()
    refused('{"model": "m"}', "chat", "messages", "missing_required_parameter")
    local msg = refused(chat('"hello"'), "chat", "messages", "invalid_type")
    H.eq(msg, "Invalid type for 'messages': expected an array, but got a string instead.")
    refused(chat('{"role": "user", "content": "hi"}'), "chat", "messages", "invalid_type")
    refused(chat('[]'), "chat", "messages", "empty_array")
    refused(chat('{}'), "chat", "messages", "empty_array")
    refused(chat('null'), "chat", "messages", "invalid_type")
    refused(chat('42'), "chat", "messages", "invalid_type")
end)

H.test("chat: a message that is not an object", function()
    refused(chat('["hi"]'), "chat", "messages[0]", "invalid_type")
    refused(chat('[{"role": "user", "content": "a"}, 7]'), "chat", "messages[1]", "invalid_type")
    refused(chat('[null]'), "chat", "messages[0]", "invalid_type")
    refused(chat('[["user", "hi"]]'), "chat", "messages[0]", "invalid_type")
    refused(chat('[{}]'), "chat", "messages[0]", "invalid_type")
end)

H.test("chat: role missing, not a string, not a name", function()
    refused(chat('[{"content": "hi"}]'), "chat", "messages[0].role", "missing_required_parameter")
    refused(chat('[{"role": null, "content": "hi"}]'), "chat", "messages[0].role", "missing_required_parameter")
    refused(chat('[{"role": 1, "content": "hi"}]'), "chat", "messages[0].role", "invalid_type")
    refused(chat('[{"role": ["user"], "content": "hi"}]'), "chat", "messages[0].role", "invalid_type")
    refused(chat('[{"role": "", "content": "hi"}]'), "chat", "messages[0].role", "invalid_value")
    refused(chat('[{"role": "user\\n", "content": "hi"}]'), "chat", "messages[0].role", "invalid_value")
    refused(chat('[{"role": "' .. string.rep("r", 65) .. '", "content": "hi"}]'), "chat", "messages[0].role",
        "invalid_value")
end)

H.test("chat: content of a wrong type", function()
    local msg = refused(chat('[{"role": "user", "content": 5}]'), "chat", "messages[0].content", "invalid_type")
    H.truthy(msg:find("but got an integer instead", 1, true), msg)
    refused(chat('[{"role": "user", "content": 1.5}]'), "chat", "messages[0].content", "invalid_type")
    refused(chat('[{"role": "user", "content": true}]'), "chat", "messages[0].content", "invalid_type")
    refused(chat('[{"role": "user", "content": {"text": "hi"}}]'), "chat", "messages[0].content", "invalid_type")
    refused(chat('[{"role": "system", "content": "s"}, {"role": "user", "content": false}]'), "chat",
        "messages[1].content", "invalid_type")
    refused(chat('[{"role": "user", "content": []}]'), "chat", "messages[0].content", "empty_array")
    refused(chat('[{"role": "user", "content": [{"type": "text", "text": "a"}, 3]}]'), "chat",
        "messages[0].content[1]", "invalid_type")
    refused(chat('[{"role": "user", "content": [null]}]'), "chat", "messages[0].content[0]", "invalid_type")
    refused(chat('[{"role": "user", "content": [{}]}]'), "chat", "messages[0].content[0]", "invalid_type")
end)

H.test("chat: content null or missing only where OpenAI allows it", function()
    refused(chat('[{"role": "user"}]'), "chat", "messages[0].content", "missing_required_parameter")
    refused(chat('[{"role": "user", "content": null}]'), "chat", "messages[0].content", "missing_required_parameter")
    refused(chat('[{"role": "system", "content": null}]'), "chat", "messages[0].content", "missing_required_parameter")
    refused(chat('[{"role": "tool", "tool_call_id": "c1"}]'), "chat", "messages[0].content",
        "missing_required_parameter")
    refused(chat('[{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]'), "chat",
        "messages[1].content", "missing_required_parameter")
    accepted(chat('[{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": ' ..
        '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, ' ..
        '{"role": "tool", "tool_call_id": "c1", "content": "42"}]'), "chat")
    accepted(chat('[{"role": "assistant", "tool_calls": [{"id": "c1"}]}]'), "chat")
    accepted(chat('[{"role": "assistant", "content": null, "refusal": "no"}]'), "chat")
    accepted(chat('[{"role": "assistant", "function_call": {"name": "f"}}]'), "chat")
    accepted(chat('[{"role": "function", "name": "f", "content": null}]'), "chat")
end)

H.test("chat: what engines accept passes", function()
    accepted(chat('[{"role": "user", "content": "hi"}]'), "chat")
    accepted(chat('[{"role": "user", "content": ""}]'), "chat")
    accepted(chat('[{"role": "developer", "content": "d"}, {"role": "user", "content": [{"type": "text", ' ..
        '"text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]'), "chat")
    -- vLLM: plain strings as parts, parts without a type, custom roles
    accepted(chat('[{"role": "user", "content": ["a", "b"]}]'), "chat")
    accepted(chat('[{"role": "user", "content": [{"image_url": "http://x/y.png"}]}]'), "chat")
    accepted(chat('[{"role": "ipython", "content": "out"}]'), "chat")
    accepted(chat('[{"role": "observation", "content": null}]'), "chat")
end)

H.test("completions: prompt missing or of a wrong type", function()
    refused('{"model": "m"}', "completions", "prompt", "missing_required_parameter")
    refused(completion('null'), "completions", "prompt", "missing_required_parameter")
    refused(completion('5'), "completions", "prompt", "invalid_type")
    refused(completion('true'), "completions", "prompt", "invalid_type")
    refused(completion('{"text": "a"}'), "completions", "prompt", "invalid_type")
    refused(completion('[]'), "completions", "prompt", "empty_array")
    refused(completion('["a", 1]'), "completions", "prompt[1]", "invalid_type")
    refused(completion('[1, "a"]'), "completions", "prompt[1]", "invalid_type")
    refused(completion('[1, 2.5]'), "completions", "prompt[1]", "invalid_type")
    refused(completion('[1, -2]'), "completions", "prompt[1]", "invalid_type")
    refused(completion('[true]'), "completions", "prompt[0]", "invalid_type")
    refused(completion('[null]'), "completions", "prompt[0]", "invalid_type")
    refused(completion('[[1, 2], [3, "x"]]'), "completions", "prompt[1][1]", "invalid_type")
    refused(completion('[[1, 2], []]'), "completions", "prompt[1]", "empty_array")
    refused(completion('[[1, 2], 3]'), "completions", "prompt[1]", "invalid_type")
    refused(completion('[[1, 2], {"a": 1}]'), "completions", "prompt[1]", "invalid_type")
end)

H.test("completions: the four OpenAI prompt shapes pass, and prompt_embeds", function()
    accepted(completion('"Once upon"'), "completions")
    accepted(completion('""'), "completions")
    accepted(completion('["a", "b"]'), "completions")
    accepted(completion('[1, 2, 3]'), "completions")
    accepted(completion('[[1, 2], [3]]'), "completions")
    accepted('{"model": "m", "prompt_embeds": "AAAA"}', "completions")
end)

H.test("chat: text parts need a string text; image_url parts an object with a url or a URL", function()
    local function part(p)
        return chat('[{"role": "user", "content": [' .. p .. ']}]')
    end
    local msg = refused(part('{"type": "text", "text": 5}'), "chat", "messages[0].content[0].text", "invalid_type")
    H.eq(msg, "Invalid type for 'messages[0].content[0].text': expected a string, but got an integer instead.")
    refused(part('{"type": "text"}'), "chat", "messages[0].content[0].text", "missing_required_parameter")
    refused(part('{"type": "text", "text": null}'), "chat", "messages[0].content[0].text",
        "missing_required_parameter")
    refused(part('{"type": "text", "text": ["a"]}'), "chat", "messages[0].content[0].text", "invalid_type")
    refused(chat('[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", ' ..
        '"text": "a"}, {"type": "text", "text": {"t": "b"}}]}]'), "chat", "messages[1].content[1].text",
        "invalid_type")
    refused(part('{"type": "image_url"}'), "chat", "messages[0].content[0].image_url", "missing_required_parameter")
    refused(part('{"type": "image_url", "image_url": 7}'), "chat", "messages[0].content[0].image_url",
        "invalid_type")
    refused(part('{"type": "image_url", "image_url": {"detail": "low"}}'), "chat",
        "messages[0].content[0].image_url.url", "missing_required_parameter")
    refused(part('{"type": "image_url", "image_url": {"url": 1}}'), "chat", "messages[0].content[0].image_url.url",
        "invalid_type")
    accepted(part('{"type": "text", "text": ""}'), "chat")
    accepted(part('{"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}'), "chat")
    accepted(part('{"type": "image_url", "image_url": "https://x/y.png"}'), "chat")
    -- other part types are the engine's business
    accepted(part('{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}'), "chat")
    accepted(part('{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}'), "chat")
    accepted(part('{"type": "refusal", "refusal": "no"}'), "chat")
end)

H.test("stream is a boolean, stream_options an object", function()
    local function with(extra)
        return '{"model": "m", ' .. extra .. ', "prompt": "a"}'
    end
    local msg = refused(with('"stream": "yes"'), "completions", "stream", "invalid_type")
    H.eq(msg, "Invalid type for 'stream': expected a boolean, but got a string instead.")
    refused(with('"stream": 1'), "completions", "stream", "invalid_type")
    refused(with('"stream": "true"'), "chat", "stream", "invalid_type")
    refused(with('"stream": true, "stream_options": true'), "completions", "stream_options", "invalid_type")
    refused(with('"stream": true, "stream_options": "include_usage"'), "completions", "stream_options",
        "invalid_type")
    refused(with('"stream": true, "stream_options": [1]'), "completions", "stream_options", "invalid_type")
    refused(with('"stream": true, "stream_options": {"include_usage": "yes"}'), "completions",
        "stream_options.include_usage", "invalid_type")
    refused(chat('[{"role": "user", "content": "hi"}], "stream": "no"'), "chat", "stream", "invalid_type")
    accepted(with('"stream": true'), "completions")
    accepted(with('"stream": false'), "completions")
    accepted(with('"stream": null, "stream_options": null'), "completions")
    accepted(with('"stream": true, "stream_options": {"include_usage": true}'), "completions")
    accepted(with('"stream": true, "stream_options": {}'), "completions")
    accepted(with('"stream": true, "stream_options": {"continuous_usage_stats": true}'), "completions")
end)

H.test("NaN and Infinity are not JSON", function()
    for _, v in ipairs({ "NaN", "nan", "Infinity", "-Infinity", "inf", "-inf", "0x10" }) do
        refused('{"model": "m", "temperature": ' .. v .. ', "prompt": "a"}', "completions", nil, "invalid_json")
        refused(chat('[{"role": "user", "content": "hi"}], "top_p": ' .. v), "chat", nil, "invalid_json")
    end
    accepted('{"model": "m", "temperature": 0.7, "top_p": 1e-3, "seed": -1, "prompt": "a"}', "completions")
    -- the instance is request.lua's own: the shared cjson.safe keeps its defaults
    H.truthy(cjson.decode('{"a": NaN}'), "shared cjson instance changed")
end)

H.test("model and JSON checks are kept", function()
    refused('{"messages": []}', "chat", "model", "missing_model")
    refused('{"model": "", "prompt": "a"}', "completions", "model", "missing_model")
    refused('{"model": null, "prompt": "a"}', "completions", "model", "missing_model")
    local msg = refused('{"model": 5, "prompt": "a"}', "completions", "model", "invalid_type")
    H.eq(msg, "Invalid type for 'model': expected a string, but got an integer instead.")
    refused('{"model": ["m"], "messages": [{"role": "user", "content": "hi"}]}', "chat", "model", "invalid_type")
    refused('{"model": true, "prompt": "a"}', "completions", "model", "invalid_type")
    refused('{"model": "m", "messages": [', "chat", nil, "invalid_json")
    refused('["model"]', "chat", nil, "invalid_json")
    refused('"text"', "chat", nil, "invalid_json")
end)

H.test("UTF-8: invalid bodies are refused before JSON", function()
    local bad = {
        "\255", "\254\254", "\192\128", "\193\191", -- never valid; overlong "/" and DEL
        "\128", "a\191b",                          -- lone continuation bytes
        "\195", "\226\130",                         -- truncated
        "\224\128\128", "\240\128\128\128",         -- overlong
        "\237\160\128", "\237\191\191",             -- UTF-16 surrogates
        "\244\144\128\128", "\248\136\128\128\128", -- above U+10FFFF, 5-byte form
        "\195\040",                                 -- a lead byte then ASCII
    }
    for _, b in ipairs(bad) do
        H.eq(request.valid_utf8(b), false, string.format("%q", b))
        -- the fast ASCII prefix must not hide it (8-byte words, then the rest)
        H.eq(request.valid_utf8(string.rep("a", 13) .. b .. "tail"), false, string.format("long %q", b))
        refused(chat('[{"role": "user", "content": "x' .. b .. '"}]'), "chat", nil, "invalid_encoding")
    end
end)

H.test("UTF-8: valid text passes at every alignment", function()
    local good = { "", "plain", "caf\195\169", "\226\130\172", "\240\159\152\128", "\239\187\191",
        "\244\143\191\191", "\237\159\191", "\238\128\128", "日本語のテキスト", "Ünïcödé façade — 😀" }
    for _, g in ipairs(good) do
        for pad = 0, 9 do
            local s = string.rep("x", pad) .. g .. string.rep("y", pad)
            H.eq(request.valid_utf8(s), true, string.format("%q", s))
        end
    end
    accepted(chat('[{"role": "user", "content": "Grüße, 世界 😀"}]'), "chat")
    -- cjson's own escapes are checked by cjson (a lone surrogate escape is invalid JSON)
    refused(chat('[{"role": "user", "content": "\\ud800"}]'), "chat", nil, "invalid_json")
end)

H.test("ascii_prefix counts leading ASCII bytes", function()
    H.eq(request.ascii_prefix(""), 0)
    H.eq(request.ascii_prefix("abc"), 3)
    H.eq(request.ascii_prefix(string.rep("a", 17)), 17)
    H.eq(request.ascii_prefix(string.rep("a", 9) .. "\195\169"), 9)
    H.eq(request.ascii_prefix("\195\169abc"), 0)
end)

H.done()
