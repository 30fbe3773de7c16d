-- /v1/embeddings in the pure modules: the body's checks (kvgate.request), its canonical prompt
-- and route key (kvgate.prompt, kvgate.route_key), cacheability (kvgate.cache_key) and usage
-- (kvgate.usage: no completion_tokens).
local H = dofile("tests/lua/helper.lua")
local cjson = require "cjson.safe"
local request = require "kvgate.request"
local prompt = require "kvgate.prompt"
local route_key = require "kvgate.route_key"
local cache_key = require "kvgate.cache_key"
-- stand-ins for what kvgate.limits (which kvgate.usage loads) needs, as in test_usage.lua
_G.ngx = { shared = {}, log = function() end, WARN = 4, now = function() return 0 end }
package.loaded["kvgate.redis"] = {}
local usage = require "kvgate.usage"

local function parse(t)
    return request.parse(type(t) == "string" and t or cjson.encode(t), "embeddings")
end

H.test("input forms that pass", function()
    for _, input in ipairs({ "text", { "a", "b" }, { 1, 2, 3 }, { { 1, 2 }, { 3 } } }) do
        local req, err = parse({ model = "m", input = input, encoding_format = "float", dimensions = 8, user = "u" })
        H.truthy(req, err)
    end
end)

H.test("refusals name the field", function()
    local cases = {
        { { model = "m" }, "input", "missing_required_parameter" },
        { { model = "m", input = "" }, "input", "invalid_value" },
        { '{"model": "m", "input": []}', "input", "empty_array" },
        { { model = "m", input = { 1, "a" } }, "input[1]", "invalid_type" },
        { '{"model": "m", "input": [[1], []]}', "input[1]", "empty_array" },
        { { model = "m", input = { -1 } }, "input[0]", "invalid_type" },
        { { model = "m", input = 5 }, "input", "invalid_type" },
        { { model = "m", input = "x", encoding_format = "int8" }, "encoding_format", "invalid_value" },
        { { model = "m", input = "x", dimensions = 1.5 }, "dimensions", "invalid_value" },
        { { model = "m", input = "x", dimensions = "8" }, "dimensions", "invalid_type" },
        { { model = "m", input = "x", user = 3 }, "user", "invalid_type" },
        { { model = "m", input = "x", stream = true }, "stream", "invalid_value" },
        { { input = "x" }, "model", "missing_model" },
    }
    for i, c in ipairs(cases) do
        local req, _, param, code = parse(c[1])
        H.eq(req, nil, "case " .. i)
        H.eq(param, c[2], "case " .. i)
        H.eq(code, c[3], "case " .. i)
    end
end)

H.test("the canonical prompt of input is a completions prompt's", function()
    H.eq(prompt.canonical({ input = "abc" }, "embeddings"), prompt.canonical({ prompt = "abc" }, "completions"))
    H.eq(prompt.canonical({ input = { "a", "b" } }, "embeddings"),
        prompt.canonical({ prompt = { "a", "b" } }, "completions"))
    local pool = { affinity = { "session", "user", "prefix" }, session_header = "x-session-id", prefix_chars = 64 }
    local key, kind = route_key.compute({ input = "some document" }, "embeddings", {}, pool, "fb")
    H.eq(kind, "prefix")
    H.truthy(key:sub(1, 2) == "p:")
    local _, kind2 = route_key.compute({ input = "x" }, "embeddings", {}, pool, "fb", true)
    H.eq(kind2, "prefix")
    local _, ukind = route_key.compute({ input = "x", user = "alice" }, "embeddings", {}, pool, "fb")
    H.eq(ukind, "user")
end)

H.test("embeddings are cacheable without temperature or seed, and keyed apart from completions", function()
    H.truthy(cache_key.cacheable({ model = "m", input = "x" }, "embeddings"))
    local ok, why = cache_key.cacheable({ model = "m", input = "x" }, "embeddings", "no-store")
    H.eq(ok, false)
    H.eq(why, "no-store")
    local a = cache_key.key({ model = "m", input = "x" }, "embeddings", "t.a", 1)
    local b = cache_key.key({ model = "m", input = "x" }, "embeddings", "t.b", 1)
    local c = cache_key.key({ model = "m", input = "x", user = "u" }, "embeddings", "t.a", 1)
    H.ne(a, b, "tenant scope")
    H.eq(a, c, "user is not part of the key")
end)

H.test("usage without completion_tokens", function()
    local body = '{"object":"list","data":[],"usage":{"prompt_tokens":12,"total_tokens":12}}'
    H.eq(usage.parse(body), nil, "chat-like parse still needs completion_tokens")
    local p, c, cached = usage.parse(body, true)
    H.eq(p, 12)
    H.eq(c, 0)
    H.eq(cached, 0)
    local hp, hc = usage.read({}, body, true)
    H.eq(hp, 12)
    H.eq(hc, 0)
end)

H.done()
