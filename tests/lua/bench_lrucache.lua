-- Per-worker LRU caches of the access phase (the prefix-capture `seen`, the completions
-- shared-prefix detector): cost of inserting a new key into a full cache, resty.lrucache
-- against resty.lrucache.pureffi, side by side in one run. Not a test (the runner picks up
-- test_*.lua only). Run from the repo root: luajit tests/lua/bench_lrucache.lua
-- The plain implementation deletes from and inserts into a Lua hash table on each eviction,
-- which makes LuaJIT rehash it again and again once full; pureffi keeps its own hash in FFI.
_G.ngx = _G.ngx or { now = os.clock }
local plain = require "resty.lrucache"
local pure = require "resty.lrucache.pureffi"

local ITEMS, INSERTS = 4096, 20000

local function bench(mod)
    local best = math.huge
    for _ = 1, 5 do
        local c = mod.new(ITEMS)
        for i = 1, ITEMS do
            c:set("warm" .. i, 1, 60)
        end
        local t0 = os.clock()
        for i = 1, INSERTS do
            c:set("new" .. i, 1, 60)
        end
        best = math.min(best, (os.clock() - t0) / INSERTS * 1e6)
    end
    return best
end

local a, b = bench(plain), bench(pure)
print(string.format("insert into a full %d-item cache: resty.lrucache %.2f us, pureffi %.2f us (%.0fx)",
    ITEMS, a, b, a / b))
