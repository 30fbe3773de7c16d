-- What interning a Lua string costs when many live strings share its length and the bytes
-- LuaJIT's string hash samples (its first, last, middle and quarter 4 bytes): the chain walk
-- with a memcmp each, which cache_key.key() paid when it joined its digest form (cacheable
-- requests that differ only in their seed). Not a test (the runner picks up test_*.lua
-- only). Run from the repo root:  luajit tests/lua/bench_intern.lua
-- LIVE = strings still referenced (in-flight requests, garbage not yet collected).
local ffi = require "ffi"
pcall(ffi.load, "libcrypto.so.3", true)
package.path = "./lua/?.lua;" .. package.path
local cjson = require "cjson.safe"
local cache_key = require "kvgate.cache_key"

local size = tonumber(arg and arg[1]) or 2048
local text = string.rep("the quick brown fox jumps over a lazy dog ", math.floor(size / 42))
local reqs = {}
for i = 1, 1000 do
    -- seeds of one length: the materials differ only in bytes the hash does not sample
    reqs[i] = cjson.decode(cjson.encode({ model = "bench-model", temperature = 0, max_tokens = 16,
        messages = { { role = "user", content = text } }, seed = 100000 + i }))
end

local function bench(name, live, fn)
    local keep = {}
    local best = math.huge
    for _ = 1, 5 do
        local t = os.clock()
        for i = 1, 20000 do
            keep[i % live] = fn(reqs[i % 1000 + 1])
        end
        best = math.min(best, (os.clock() - t) / 20000 * 1e6)
    end
    print(string.format("%-52s %8.2f us", name .. " (" .. live .. " live)", best))
end

for _, live in ipairs({ 1, 64, 512 }) do
    bench("material() joined into a string", live, function(r)
        return cache_key.material(r, "chat", "default", 1, "none")
    end)
    bench("key() from the buffer (+ sha256)", live, function(r)
        return cache_key.key(r, "chat", "default", 1, "none")
    end)
end
