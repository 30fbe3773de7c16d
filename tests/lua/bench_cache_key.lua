-- Access-phase cost of the cache key's credential scope (cache_key.credential). Not a
-- test (the runner picks up test_*.lua only). Run from the repo root:
--   luajit tests/lua/bench_cache_key.lua
-- Against an older cache_key.lua whose credential() took one header's value
-- (credential(headers["authorization"])):
--   old=$(mktemp --suffix .lua); git show <rev>:lua/kvgate/cache_key.lua > "$old"
--   CACHE_KEY="$old" CACHE_KEY_SINGLE=1 luajit tests/lua/bench_cache_key.lua
-- Header tables carry ngx_lua's metatable (a missing name is lowercased and looked up
-- again) and ~10 ordinary headers; values vary per call (1000 distinct) so the JIT
-- cannot fold a call away. Figures: best of 5 runs, microseconds per call.
local ffi = require "ffi"
pcall(ffi.load, "libcrypto.so.3", true)
package.path = "./lua/?.lua;" .. package.path
local cache_key
if os.getenv("CACHE_KEY") then
    cache_key = dofile(os.getenv("CACHE_KEY"))
    print("cache_key: " .. os.getenv("CACHE_KEY"))
else
    cache_key = require "kvgate.cache_key"
end
local single = os.getenv("CACHE_KEY_SINGLE") ~= nil

local NAMES = { "authorization", "api-key", "x-api-key" }
local N = 1000

local function bench(name, n, fn)
    for i = 1, math.min(n, 20000) do
        fn(i)
    end
    local best = math.huge
    for _ = 1, 5 do
        local t = os.clock()
        for i = 1, n do
            fn(i)
        end
        best = math.min(best, (os.clock() - t) / n * 1e6)
    end
    print(string.format("%-56s %8.3f us", name, best))
end

-- ngx_lua's header table (lua-resty-core's req_headers_mt)
local mt = { __index = function(t, k) return rawget(t, (string.gsub(string.lower(k), "_", "-"))) end }

local function headers(extra)
    local h = { host = "gw:8080", ["user-agent"] = "OpenAI/Python 1.51.0", accept = "application/json",
                ["accept-encoding"] = "gzip, deflate", ["content-type"] = "application/json",
                ["content-length"] = "412", ["x-stainless-lang"] = "python", ["x-stainless-os"] = "Linux",
                ["x-stainless-arch"] = "x64", ["x-stainless-runtime"] = "CPython" }
    for k, v in pairs(extra) do
        h[k] = v
    end
    return setmetatable(h, mt)
end

local anon, bearer, both, repeated = {}, {}, {}, {}
for i = 1, N do
    anon[i] = headers({})
    bearer[i] = headers({ authorization = "Bearer sk-proj-" .. i .. string.rep("x", 40) })
    both[i] = headers({ authorization = "Bearer sk-proj-" .. i .. string.rep("x", 40),
                        ["api-key"] = "azure-" .. i .. string.rep("k", 26) })
    repeated[i] = headers({ ["x-api-key"] = { "k-" .. i, "k-" .. (i + 1) } })
end

local function pick(t, i)
    return t[(i - 1) % #t + 1]
end

local cred
if single then
    cred = function(h) return cache_key.credential(h["authorization"]) end
else
    cred = function(h) return cache_key.credential(h, NAMES) end
end

print("-- cache_key.credential (access phase, cacheable requests only)" ..
      (single and ", one header: authorization" or ", headers: " .. table.concat(NAMES, ", ")))
bench("no credential header (the none scope)", 2e6, function(i) return cred(pick(anon, i)) end)
bench("Authorization: Bearer <52 chars>", 5e5, function(i) return cred(pick(bearer, i)) end)
bench("Authorization and api-key", 5e5, function(i) return cred(pick(both, i)) end)
bench("x-api-key repeated (two values)", 5e5, function(i) return cred(pick(repeated, i)) end)
