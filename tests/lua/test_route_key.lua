local H = dofile("tests/lua/helper.lua")
local route_key = require "kvgate.route_key"
local prompt = require "kvgate.prompt"
local cjson = require "cjson.safe"

local POOL = { affinity = { "session", "user", "prefix" }, session_header = "X-Session-Id", prefix_chars = 2048 }
local FALLBACK = "kvgate:fallback"

-- ngx.req.get_headers() gives a table (case-insensitive in nginx); a plain one here
local function headers(t)
    return t
end

local SYSTEM = { role = "system", content = "You are a helpful assistant." }

local function chat(turns, first_user)
    local msgs = { SYSTEM, { role = "user", content = first_user or "Tell me about the Rhine." } }
    for i = 2, turns do
        msgs[#msgs + 1] = { role = "assistant", content = "answer " .. (i - 1) }
        msgs[#msgs + 1] = { role = "user", content = "follow-up question " .. i }
    end
    return { model = "m", messages = msgs }
end

H.test("fingerprint is stable over turns 1..5 of one chat", function()
    local k1, kind = route_key.compute(chat(1), "chat", headers({}), POOL, FALLBACK)
    H.eq(kind, "prefix")
    for t = 2, 5 do
        local k = route_key.compute(chat(t), "chat", headers({}), POOL, FALLBACK)
        H.eq(k, k1, "turn " .. t)
    end
end)

H.test("fingerprint changes with the first user message", function()
    local a = route_key.compute(chat(1, "question A"), "chat", headers({}), POOL, FALLBACK)
    local b = route_key.compute(chat(1, "question B"), "chat", headers({}), POOL, FALLBACK)
    H.ne(a, b)
end)

H.test("fingerprint changes with the system prompt and with tools", function()
    local base = route_key.compute(chat(1), "chat", headers({}), POOL, FALLBACK)
    local r = chat(1); r.messages[1] = { role = "system", content = "Other system." }
    H.ne(route_key.compute(r, "chat", headers({}), POOL, FALLBACK), base)
    local t = chat(1); t.tools = { { type = "function", ["function"] = { name = "f" } } }
    H.ne(route_key.compute(t, "chat", headers({}), POOL, FALLBACK), base)
end)

H.test("text parts concatenate like a plain string", function()
    local a = chat(1, "hello world")
    local b = chat(1); b.messages[2].content = { { type = "text", text = "hello " }, { type = "text", text = "world" } }
    H.eq(route_key.compute(a, "chat", headers({}), POOL, FALLBACK), route_key.compute(b, "chat", headers({}), POOL, FALLBACK))
end)

H.test("window caps at prefix_chars", function()
    local pool = { affinity = { "prefix" }, session_header = "X-Session-Id", prefix_chars = 64 }
    local long = string.rep("x", 500)
    local a = chat(1, long .. "A")
    local b = chat(1, long .. "B")
    H.eq(route_key.compute(a, "chat", headers({}), pool, FALLBACK), route_key.compute(b, "chat", headers({}), pool, FALLBACK))
    local p = prompt.canonical(a, "chat")
    local _, fue = prompt.canonical(a, "chat")
    H.eq(#prompt.window(p, fue, 64), 64)
    -- without the cap they differ
    H.ne(route_key.compute(a, "chat", headers({}), POOL, FALLBACK), route_key.compute(b, "chat", headers({}), POOL, FALLBACK))
end)

H.test("window never extends past the first user message", function()
    local p, fue = prompt.canonical(chat(3), "chat")
    local w = prompt.window(p, fue, 100000)
    H.eq(#w, fue)
    H.truthy(w:find("Rhine", 1, true))
    H.truthy(not w:find("follow-up", 1, true))
end)

H.test("role and content boundaries cannot be forged", function()
    local a = { model = "m", messages = { { role = "user", content = "ab" } } }
    local b = { model = "m", messages = { { role = "usera", content = "b" } } }
    H.ne(prompt.canonical(a, "chat"), prompt.canonical(b, "chat"))
    local c = { model = "m", messages = { { role = "user", content = "x" }, { role = "user", content = "y" } } }
    local d = { model = "m", messages = { { role = "user", content = "x\30user\31y" } } }
    H.ne(prompt.canonical(c, "chat"), prompt.canonical(d, "chat"))
    local e = { model = "m", messages = { { role = "user", content = "x\\x1euser\\x1fy" } } }
    H.ne(prompt.canonical(e, "chat"), prompt.canonical(d, "chat"))
end)

H.test("a growing message keeps the fingerprint of its start", function()
    -- e.g. a client that resends the whole history inside one user message
    local pool = { affinity = { "prefix" }, session_header = "X-Session-Id", prefix_chars = 128 }
    local base = string.rep("shared words ", 10)
    local short = { model = "m", messages = { SYSTEM, { role = "user", content = base .. "turn one" } } }
    local long = { model = "m", messages = { SYSTEM, { role = "user", content = base .. "turn one, turn two, three" } } }
    H.eq(route_key.compute(short, "chat", headers({}), pool, FALLBACK), route_key.compute(long, "chat", headers({}), pool, FALLBACK))
end)

H.test("a window that covers only the system prompt is flagged as shared", function()
    local pool = { affinity = { "prefix" }, session_header = "X-Session-Id", prefix_chars = 64 }
    local req = chat(1); req.messages[1].content = string.rep("s", 100)
    local k, kind, err, shared = route_key.compute(req, "chat", headers({}), pool, FALLBACK)
    H.eq(kind, "prefix"); H.eq(shared, true)
    k, kind, err, shared = route_key.compute(chat(1), "chat", headers({}), POOL, FALLBACK)
    H.eq(shared, false)
end)

H.test("completions: prompt string is the prefix", function()
    local a = route_key.compute({ model = "m", prompt = "Once upon a time" }, "completions", headers({}), POOL, FALLBACK)
    local b = route_key.compute({ model = "m", prompt = "Once upon a time" }, "completions", headers({}), POOL, FALLBACK)
    local c = route_key.compute({ model = "m", prompt = "Twice upon a time" }, "completions", headers({}), POOL, FALLBACK)
    H.eq(a, b); H.ne(a, c)
end)

H.test("affinity order: session, then user, then prefix, then fallback", function()
    local req = chat(1); req.user = "alice"
    local k, kind = route_key.compute(req, "chat", headers({ ["X-Session-Id"] = "s1" }), POOL, FALLBACK)
    H.eq(kind, "session"); H.eq(k, "s:s1")
    k, kind = route_key.compute(req, "chat", headers({}), POOL, FALLBACK)
    H.eq(kind, "user"); H.eq(k, "u:alice")
    req.user = ""
    k, kind = route_key.compute(req, "chat", headers({}), POOL, FALLBACK)
    H.eq(kind, "prefix")
    k, kind = route_key.compute({ model = "m", messages = {} }, "chat", headers({}), POOL, FALLBACK)
    H.eq(kind, "fallback"); H.eq(k, FALLBACK)
    local only_user = { affinity = { "user" }, session_header = "X-Session-Id", prefix_chars = 2048 }
    k, kind = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "s1" }), only_user, FALLBACK)
    H.eq(kind, "fallback")
end)

H.test("bad session header is an error", function()
    local k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = string.rep("a", 300) }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "a\1b" }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    k = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = string.rep("a", 256) }), POOL, FALLBACK)
    H.truthy(k)
    -- a repeated header routes by its first value, but every value is forwarded: all must be valid
    k, kind = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = { "s1", "s2" } }), POOL, FALLBACK)
    H.eq(k, "s:s1"); H.eq(kind, "session")
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = { "s1", "a\2b" } }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
end)

H.test("placeholder session ids and users are absent, and reported", function()
    for _, v in ipairs({ "null", "NULL", "Null", "undefined", "None", "none", "nil", "<nil>", "NaN", "",
        " ", "   ", " null ", string.rep(" ", 40) }) do
        local k, kind, err, _, s_sent, u_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = v }),
            POOL, FALLBACK)
        H.eq(err, nil, v); H.eq(kind, "prefix", "'" .. v .. "'"); H.truthy(k:match("^p:"))
        H.truthy(s_sent, v); H.eq(u_sent, nil)
        -- the next source applies: here the user field
        local req = chat(1); req.user = "alice"
        k, kind, err, _, s_sent = route_key.compute(req, "chat", headers({ ["X-Session-Id"] = v }), POOL, FALLBACK)
        H.eq(k, "u:alice", v); H.truthy(s_sent)
        -- a placeholder user is absent too
        req.user = v
        k, kind, err, _, s_sent, u_sent = route_key.compute(req, "chat", headers({}), POOL, FALLBACK)
        H.eq(kind, "prefix", v); H.eq(s_sent, nil); H.truthy(u_sent)
    end
    H.eq(route_key.sentinel("null"), "null"); H.eq(route_key.sentinel("NULL"), "null")
    H.eq(route_key.sentinel("None"), "none"); H.eq(route_key.sentinel("<nil>"), "nil")
    H.eq(route_key.sentinel(" "), "empty"); H.eq(route_key.sentinel(""), "empty")
    -- ids that merely contain or resemble a placeholder are ids
    for _, v in ipairs({ "nullable", "null-1", "none42", "undefined_user", "0", "false", "n", "nulll",
        string.rep("a", 256), "  x  " }) do
        H.eq(route_key.sentinel(v), nil, v)
        local k, kind = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = v }), POOL, FALLBACK)
        H.eq(kind, "session", v); H.eq(k, "s:" .. route_key.trim_ows(v))
    end
    -- a repeated header: the first value decides; the others are still validated
    local k, kind, err, _, s_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = { "null", "s2" } }),
        POOL, FALLBACK)
    H.eq(kind, "prefix"); H.eq(s_sent, "null")
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = { "null", "a\1b" } }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    -- a placeholder is still checked like any value (control characters: 400)
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "null\1" }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    -- no prompt: the fallback, with the placeholder reported
    k, kind, err, _, s_sent = route_key.compute({ model = "m", messages = {} }, "chat",
        headers({ ["X-Session-Id"] = "undefined" }), POOL, FALLBACK)
    H.eq(kind, "fallback"); H.eq(s_sent, "undefined")
    -- kind_only pools: the same
    k, kind, err, _, s_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "null" }), POOL, FALLBACK,
        true)
    H.eq(kind, "prefix"); H.eq(k, ""); H.eq(s_sent, "null")
    -- a real id reports nothing
    local _, _, _, _, s5, u5 = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "s1" }), POOL, FALLBACK)
    H.eq(s5, nil); H.eq(u5, nil)
end)

H.test("a session id's leading/trailing spaces and tabs (RFC 9110 OWS) are trimmed; inner ones stay", function()
    for _, v in ipairs({ "\ts1", "s1\t", "\t s1 \t", " s1", "s1 ", "\t\ts1" }) do
        local k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = v }), POOL, FALLBACK)
        H.eq(err, nil, string.format("%q", v)); H.eq(kind, "session"); H.eq(k, "s:s1", string.format("%q", v))
    end
    local k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "s\t1" }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err and err:find("control characters", 1, true))
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "\ts\0011\t" }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "\ns1" }), POOL, FALLBACK)
    H.eq(k, nil); H.truthy(err)
    -- blanks only, or a placeholder inside blanks: absent
    local s_sent
    k, kind, err, _, s_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "\t" }), POOL, FALLBACK)
    H.eq(err, nil); H.eq(kind, "prefix"); H.eq(s_sent, "empty")
    k, kind, err, _, s_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "\tnull\t" }), POOL,
        FALLBACK)
    H.eq(err, nil); H.eq(kind, "prefix"); H.eq(s_sent, "null")
    -- every value of a repeated header the same
    k, kind, err = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = { "s1\t", "\ts2" } }), POOL,
        FALLBACK)
    H.eq(err, nil); H.eq(k, "s:s1")
    -- the length limit is on the value itself
    k = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = "\t" .. string.rep("a", 256) .. "\t" }),
        POOL, FALLBACK)
    H.eq(k, "s:" .. string.rep("a", 256))
    H.eq(route_key.trim_ows("\t \t"), ""); H.eq(route_key.trim_ows(""), ""); H.eq(route_key.trim_ows("a b"), "a b")
end)

H.test("more placeholders: (null), nullptr, [object Object], JSON-quoted null/undefined", function()
    local want = { ["(null)"] = "null", ["(NULL)"] = "null", ["nullptr"] = "null", ["[object Object]"] = "object",
        ["[OBJECT OBJECT]"] = "object", ['"null"'] = "null", ['"undefined"'] = "undefined", [' "null" '] = "null" }
    for v, label in pairs(want) do
        H.eq(route_key.sentinel(v), label, v)
        local k, kind, err, _, s_sent = route_key.compute(chat(1), "chat", headers({ ["X-Session-Id"] = v }), POOL,
            FALLBACK)
        H.eq(err, nil, v); H.eq(kind, "prefix", v); H.eq(s_sent, label, v)
        local req = chat(1); req.user = v
        local _, ukind, _, _, _, u_sent = route_key.compute(req, "chat", headers({}), POOL, FALLBACK)
        H.eq(ukind, "prefix", v); H.eq(u_sent, label, v)
    end
    for _, v in ipairs({ "null)", "(null", '"null', "null\"", '"s1"', "[object]", "[object Map]", "nullptr1",
        "[object object]x" }) do
        H.eq(route_key.sentinel(v), nil, v)
    end
end)

H.test("canonical() with a limit gives the same window and offsets as without", function()
    local long = { model = "m", messages = { SYSTEM, { role = "user", content = string.rep("word ", 2000) } } }
    for i = 1, 20 do
        long.messages[#long.messages + 1] = { role = i % 2 == 1 and "assistant" or "user", content = string.rep("x", 500) }
    end
    for _, n in ipairs({ 10, 64, 2048, 20000, 100000 }) do
        local full, fe, fs = prompt.canonical(long, "chat")
        local cut, ce, cs = prompt.canonical(long, "chat", n)
        H.eq(prompt.window(cut, ce, n), prompt.window(full, fe, n), "window " .. n)
        H.eq(ce, fe); H.eq(cs, fs)
        H.truthy(#cut <= #full)
    end
    local full = prompt.canonical(long, "chat")
    H.truthy(#prompt.canonical(long, "chat", 2048) < #full / 2, "stops early")
end)

H.test("kind_only (round_robin/least_conn pools): same kind and validation, no hashing", function()
    local function both(req, endpoint, hdrs, pool)
        local k, kind, err = route_key.compute(req, endpoint, hdrs, pool, FALLBACK)
        local k2, kind2, err2 = route_key.compute(req, endpoint, hdrs, pool, FALLBACK, true)
        H.eq(kind2, kind); H.eq(err2 ~= nil, err ~= nil)
        return k, k2
    end
    local k, k2 = both(chat(1), "chat", {}, POOL)
    H.truthy(k:match("^p:")); H.eq(k2, "")
    k, k2 = both(chat(1), "chat", { ["X-Session-Id"] = "s1" }, POOL)
    H.eq(k, k2)
    both(chat(1), "chat", { ["X-Session-Id"] = "a\1b" }, POOL)
    local prefix_then_user = { affinity = { "prefix", "user" }, session_header = "X-Session-Id", prefix_chars = 64 }
    k, k2 = both({ model = "m", messages = {}, user = "bob" }, "chat", {}, prefix_then_user)
    H.eq(k, "u:bob"); H.eq(k2, "u:bob")
    both({ model = "m", messages = {} }, "chat", {}, POOL)
    both({ model = "m", tools = {} }, "chat", {}, POOL)
    both({ model = "m", prompt = "p" }, "completions", {}, POOL)
    both({ model = "m", prompt = {} }, "completions", {}, POOL)
    both({ model = "m", prompt = { { 1, 2 } } }, "completions", {}, POOL)
end)

H.test("a huge completions prompt: same window as escaping it all, without escaping it all", function()
    local big = string.rep("a\\b\30c", 200000) -- ~1.2 MB with bytes that expand when escaped
    local req = { model = "m", prompt = big }
    local cut = prompt.canonical(req, "completions", 2048)
    local full = prompt.canonical(req, "completions")
    H.eq(#cut, 2048)
    H.eq(cut, full:sub(1, 2048))
    local list = { model = "m", prompt = { "x", big, "y" } }
    H.eq(prompt.canonical(list, "completions", 100), prompt.canonical(list, "completions"):sub(1, 100))
    local ids = {}
    for i = 1, 50000 do ids[i] = i end
    local tok = { model = "m", prompt = { ids } }
    H.eq(prompt.canonical(tok, "completions", 64), prompt.canonical(tok, "completions"):sub(1, 64))
end)

H.test("a message crossing the window is cut before escaping; offsets stay exact", function()
    local text = string.rep("\\\31q", 3000)
    local req = { model = "m", messages = { { role = "system", content = text }, { role = "user", content = text .. "u" } } }
    for _, n in ipairs({ 1, 5, 100, 4000, 30000 }) do
        local full, fe, fs = prompt.canonical(req, "chat")
        local cut, ce, cs = prompt.canonical(req, "chat", n)
        H.eq(ce, fe, "end " .. n); H.eq(cs, fs, "start " .. n)
        H.eq(cut, full:sub(1, n), "window " .. n)
    end
end)

H.done()
