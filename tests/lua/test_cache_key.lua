local H = dofile("tests/lua/helper.lua")
local cache_key = require "kvgate.cache_key"
local json = require "kvgate.json"
local cjson = require "cjson.safe"

local BASE = [[{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}],
  "temperature":0,"max_tokens":16}]]

local function key(text, endpoint, tenant, version)
    return cache_key.key(cjson.decode(text), endpoint or "chat", tenant or "default", version or 1)
end

local function with(field, value)
    local r = cjson.decode(BASE)
    r[field] = value
    return cache_key.key(r, "chat", "default", 1)
end

H.test("key format", function()
    local k = key(BASE)
    H.truthy(k:match("^kvgate:resp:v1:default:%x+$"), k)
    H.eq(#k:match("(%x+)$"), 64)
end)

H.test("each sampling parameter changes the key", function()
    local base = key(BASE)
    local seen = { [base] = "base" }
    local cases = {
        { "temperature", 0.5 }, { "top_p", 0.9 }, { "max_tokens", 17 }, { "seed", 1 }, { "seed", 2 },
        { "stop", { "\n" } }, { "n", 2 }, { "presence_penalty", 0.1 }, { "frequency_penalty", 0.1 },
        { "logit_bias", { ["50256"] = -100 } }, { "response_format", { type = "json_object" } },
        { "tools", { { type = "function", ["function"] = { name = "f" } } } }, { "model", "m2" },
        { "top_k", 5 }, { "logprobs", true },
    }
    for _, c in ipairs(cases) do
        local k = with(c[1], c[2])
        H.truthy(not seen[k], c[1] .. " collides with " .. tostring(seen[k]))
        seen[k] = c[1]
    end
end)

H.test("prompt changes change the key (system included)", function()
    local r = cjson.decode(BASE); r.messages[1].content = "sys2"
    H.ne(cache_key.key(r, "chat", "default", 1), key(BASE))
end)

H.test("reordered keys give the same key", function()
    local a = key([[{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"a":1,"b":2}}}}]])
    local b = key([[{"response_format":{"json_schema":{"schema":{"b":2,"a":1},"name":"x"},"type":"json_schema"},"messages":[{"content":"hi","role":"user"}],"temperature":0.0,"model":"m"}]])
    H.eq(a, b)
end)

H.test("an absent parameter is not its default", function()
    local a = key([[{"model":"m","messages":[],"temperature":0}]])
    local b = key([[{"model":"m","messages":[],"temperature":0,"top_p":1}]])
    H.ne(a, b)
end)

H.test("transport fields do not change the key", function()
    local a = key([[{"model":"m","messages":[],"temperature":0}]])
    local b = key([[{"model":"m","messages":[],"temperature":0,"stream":true,"stream_options":{"include_usage":true},"user":"u"}]])
    H.eq(a, b)
end)

H.test("tenant, version and endpoint scope the key", function()
    local k = key(BASE)
    H.ne(key(BASE, "chat", "other"), k)
    H.ne(key(BASE, "chat", "default", 2), k)
    H.truthy(key(BASE, "chat", "default", 2):match("^kvgate:resp:v2:"))
    H.ne(key(BASE, "completions"), k)
end)

H.test("tenant cannot forge a key boundary", function()
    local k = key(BASE, "chat", "a:b")
    H.truthy(k:match("^kvgate:resp:v1:a%%3Ab:%x+$"), k)
    H.ne(key(BASE, "chat", "a:b"), key(BASE, "chat", "a%3Ab"))
end)

H.test("data cannot forge structure", function()
    H.ne(json.canonical({ a = "x\",\"b\":\"y" }), json.canonical({ a = "x", b = "y" }))
    H.ne(json.canonical({ "1" }), json.canonical({ ["1"] = "1" }))
    H.eq(json.canonical({ b = 1, a = { d = 2, c = { 3, 4 } } }), '{"a":{"c":[3,4],"d":2},"b":1}')
    H.eq(json.canonical(cjson.decode('{"x":1.0,"y":0.1}')), '{"x":1,"y":0.10000000000000001}')
end)

H.test("the digest form: data cannot forge structure; keys sorted; numbers as doubles", function()
    local d = cache_key.digest_form
    H.ne(d({ a = "x\",\"b\":\"y" }), d({ a = "x", b = "y" }))
    H.ne(d({ a = "s1:x" }), d({ a = "x" }))
    H.ne(d({ "1" }), d({ ["1"] = "1" }))
    H.ne(d({ 1 }), d({ "1" }))
    H.ne(d({ { 1, 2 }, 3 }), d({ { 1 }, 2, 3 }))
    H.ne(d({ a = true }), d({ a = "t" }))
    H.ne(d({ a = cjson.null }), d({ a = "z" }))
    H.eq(d({ b = 1, a = { d = 2, c = { 3, 4 } } }), "o2:s1:ao2:s1:ca2:n3;n4;s1:dn2;s1:bn1;")
    H.eq(d(cjson.decode('{"x":1.0,"y":0.1}')), d(cjson.decode('{"y":0.1,"x":1}')))
    local long = string.rep("\"x\\\n", 100)
    H.eq(d({ long }), "a1:s" .. #long .. ":" .. long, "long strings as they are")
end)

H.test("cacheability", function()
    local function c(t, cc) return (cache_key.cacheable(cjson.decode(t), "chat", cc)) end
    H.eq(c([[{"temperature":0,"messages":[]}]]), true)
    H.eq(c([[{"temperature":0.7,"seed":3,"messages":[]}]]), true)
    H.eq(c([[{"temperature":0.7,"messages":[]}]]), false)
    H.eq(c([[{"messages":[]}]]), false)
    H.eq(c([[{"temperature":0,"messages":[]}]], "no-store"), false)
    H.eq(c([[{"temperature":0,"messages":[]}]], "max-age=0, No-Store"), false)
    H.eq(c([[{"temperature":0,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}]]), false)
    H.eq(c([[{"temperature":0,"messages":[{"role":"user","content":[{"type":"text","text":"a"},"b"]}]}]]), true)
    -- repeated Cache-Control headers come as a list: no-store in any of them counts
    H.eq(c([[{"temperature":0,"messages":[]}]], { "max-age=0", "no-store" }), false)
    H.eq(c([[{"temperature":0,"messages":[]}]], { "max-age=0", "no-cache" }), true)
end)

H.test("a seed past 2^53 cannot make a request cacheable (doubles collide there)", function()
    local function c(t) return cache_key.cacheable(cjson.decode(t), "chat") end
    H.eq((c([[{"temperature":0.7,"seed":9007199254740991,"messages":[]}]])), true)
    local ok, why = c([[{"temperature":0.7,"seed":9007199254740992,"messages":[]}]])
    H.eq(ok, false); H.eq(why, "seed-imprecise")
    H.eq((c([[{"temperature":0.7,"seed":1.5,"messages":[]}]])), false)
    -- temperature 0 is deterministic whatever the seed
    H.eq((c([[{"temperature":0,"seed":9007199254740993,"messages":[]}]])), true)
end)

H.test("no-cache asks for revalidation, in any Cache-Control header", function()
    H.eq(cache_key.revalidate("no-cache"), true)
    H.eq(cache_key.revalidate({ "max-age=0", "No-Cache" }), true)
    H.eq(cache_key.revalidate("no-store"), false)
    H.eq(cache_key.revalidate(nil), false)
end)

local NAMES = { "authorization", "api-key", "x-api-key" }

local function cred(headers, names)
    return assert(cache_key.credential(headers, names or NAMES))
end

H.test("the credential scopes the key; only its digest enters the material", function()
    local r = cjson.decode(BASE)
    local none = cred({})
    local a = cred({ authorization = "Bearer sk-a" })
    local b = cred({ authorization = "Bearer sk-b" })
    H.eq(none, cache_key.NO_CREDENTIAL)
    H.eq(#a, 64)
    H.ne(a, b)
    H.eq(cred({ authorization = "Bearer sk-a", ["user-agent"] = "x" }), a)
    local keys = {}
    for _, c in ipairs({ none, a, b, cred({ authorization = "" }) }) do
        local k = cache_key.key(r, "chat", "default", 1, c)
        H.truthy(k:match("^kvgate:resp:v1:default:%x+$"), k)
        H.truthy(not keys[k], "two credentials share " .. k)
        keys[k] = true
        H.truthy(not cache_key.material(r, "chat", "default", 1, c):find("sk-", 1, true))
    end
    -- nil cred is the anonymous caller
    H.eq(cache_key.key(r, "chat", "default", 1), cache_key.key(r, "chat", "default", 1, none))
end)

H.test("every listed header scopes the key: api-key and x-api-key callers are not anonymous", function()
    local none = cred({})
    local seen = { [none] = "none" }
    local cases = {
        { ["api-key"] = "k1" }, { ["x-api-key"] = "k1" }, { authorization = "k1" }, { ["api-key"] = "k2" },
        { authorization = "Bearer a", ["api-key"] = "k" }, { authorization = "Bearer a", ["x-api-key"] = "k" },
        { authorization = "Bearer a", ["api-key"] = "k", ["x-api-key"] = "k" },
        { ["api-key"] = "k", ["x-api-key"] = "k" },
    }
    for i, h in ipairs(cases) do
        local d = cred(h)
        H.truthy(not seen[d], "case " .. i .. " collides with " .. tostring(seen[d]))
        seen[d] = i
    end
    -- headers that are not listed do not count
    H.eq(cred({ cookie = "s=1", ["proxy-authorization"] = "x" }), none)
    H.eq(cred({ authorization = "Bearer a", cookie = "s=1" }), cred({ authorization = "Bearer a" }))
    -- the policy's list decides: a header left out of it is not read
    H.eq(cred({ authorization = "Bearer a", ["x-api-key"] = "k" }, { "x-api-key" }), cred({ ["x-api-key"] = "k" }, { "x-api-key" }))
    H.eq(cred({ authorization = "Bearer a" }, { "x-api-key" }), none)
end)

H.test("every value of a repeated credential header counts, in order", function()
    local one = cred({ ["x-api-key"] = "x" })
    H.eq(cred({ ["x-api-key"] = { "x" } }), one)
    local seen = { [one] = true }
    for _, v in ipairs({ { "x", "y" }, { "y", "x" }, { "x,", "y" }, { "x", ",y" }, { "x", "" }, { "x", "x" } }) do
        local d = cred({ ["x-api-key"] = v })
        H.truthy(not seen[d], table.concat(v, "|") .. " collides")
        seen[d] = true
    end
end)

H.test("no two combinations of names and values give the same digest input", function()
    -- values shaped like the encoding itself (name, count, length-prefixed values)
    local combos = {
        { authorization = "x", ["api-key"] = "y" },
        { authorization = "x\napi-key\n1\n1:y" },
        { authorization = "x1:y" },
        { authorization = { "x", "y" } },
        { authorization = { "x", "api-key", "y" } },
        { authorization = { "x" }, ["api-key"] = { "y", "" } },
        { ["api-key"] = "x", ["x-api-key"] = "y" },
        { ["api-key"] = { "x", "y" } },
        { ["x-api-key"] = { "x", "y" } },
        { authorization = "" }, { ["api-key"] = "" }, { authorization = "", ["api-key"] = "" },
    }
    local seen = {}
    for i, h in ipairs(combos) do
        local d = cred(h)
        H.truthy(not seen[d], "combination " .. i .. " collides with " .. tostring(seen[d]))
        seen[d] = i
    end
end)

H.test("the query string scopes the key too: an engine may authenticate by it", function()
    local names = { "authorization", "api-key", "x-api-key" }
    local anon = cache_key.credential({}, names)
    H.eq(anon, cache_key.NO_CREDENTIAL)
    H.eq(cache_key.credential({}, names, ""), anon)
    local a = cache_key.credential({}, names, "api_key=A")
    local b = cache_key.credential({}, names, "api_key=B")
    H.truthy(a ~= anon and b ~= anon and a ~= b)
    -- a header and a query string never pass for one another
    H.truthy(cache_key.credential({ authorization = "x" }, names, "y") ~= cache_key.credential({ authorization = "x" }, names))
    H.truthy(cache_key.credential({}, names, "authorization\n1\n1:x") ~= cache_key.credential({ authorization = "x" }, names))
end)

H.test("the key is the sha256 of material(), also for long strings", function()
    local hash = require "kvgate.hash"
    for _, n in ipairs({ 10, 1000, 4097, 5000, 40000 }) do
        local r = cjson.decode(BASE)
        r.messages[2].content = string.rep("ab", n)
        r.messages[1].content = string.rep("s", math.floor(n / 2) + 1)
        local k = cache_key.key(r, "chat", "default", 1, "none")
        H.eq(k, "kvgate:resp:v1:default:" .. hash.sha256_hex(cache_key.material(r, "chat", "default", 1, "none")), n)
    end
end)

H.test("the key's values are those of the joined digest form (golden, before the buffer)", function()
    -- computed by the cache_key.lua of commit 232d2f4 (material joined with table.concat)
    local reqs = {
        [==[{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}],"temperature":0,"max_tokens":16}]==],
        [==[{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\"b\\c\u00e9"}]}],"temperature":0,"seed":12345,"stop":["\n","x"],"logit_bias":{"50256":-100,"7":3.25},"top_p":0.9,"n":null,"logprobs":true,"echo":false,"response_format":{}}]==],
        [==[{"model":"m","prompt":[[1,2,3],[4]],"temperature":0,"max_tokens":1e300,"x":-0.1}]==],
    }
    local want = {
        "kvgate:resp:v3:te%3Anant:94f5a6d91c75d61e274f932f909013995f90097e8aaef8ed380860a135336538",
        "kvgate:resp:v3:te%3Anant:20f828ce08415ce8719c6df1355cca275745b4b8a489584d87f8cfcdf4c3bc4c",
        "kvgate:resp:v3:te%3Anant:cb7278816f47a32af12703ae2149892f1643cbe33439f48d96f65beae81a4618",
    }
    for i, r in ipairs(reqs) do
        local t = cjson.decode(r)
        if i == 3 then
            t.long = string.rep("abcdefgh", 6000)
        end
        H.eq(cache_key.key(t, i == 3 and "completions" or "chat", "te:nant", 3, i == 2 and "abc" or nil), want[i], i)
    end
end)

H.done()
