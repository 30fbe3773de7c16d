-- Cost of the prefix balancer's work per request (kvgate.prefix_index): the canonical prompt,
-- its chained chunk hashes, the index lookups of 4 nodes and the record of the picked node's
-- chain, for a 48 KB chat prompt (a 3.6 KB system prompt + a 44 KB user message: the demo
-- trace's median request) and an 860 KB one (the trace's largest). Not a test (the runner
-- picks up test_*.lua only). Figures are the best of 5 runs, in microseconds per request;
-- inputs vary per call (64 distinct prompts), so the JIT cannot fold a call away.
--
-- Under plain luajit the shared dict is a Lua table (the dict's own cost is not in it):
--   luajit tests/lua/bench_prefix.lua
-- Inside nginx with the real lua_shared_dict (its locks and copies), from the repo root:
--   d=$(mktemp -d); mkdir -p $d/logs; printf '%s\n' 'load_module /usr/lib/nginx/modules/ndk_http_module.so;' \
--     'load_module /usr/lib/nginx/modules/ngx_http_lua_module.so; error_log stderr notice; pid logs/nginx.pid;' \
--     'events {} http { lua_package_path "'$PWD'/lua/?.lua;;"; lua_shared_dict kvgate_prefix 16m;' \
--     'init_worker_by_lua_block { ngx.timer.at(0, function() dofile("'$PWD'/tests/lua/bench_prefix.lua")' \
--     'os.exit(0) end) } }' > $d/nginx.conf; nginx -p $d -c nginx.conf -g 'daemon off; master_process off;'
local in_nginx = ngx ~= nil and ngx.shared ~= nil and ngx.shared.kvgate_prefix ~= nil
if not in_nginx then
    package.path = "./lua/?.lua;" .. package.path
    local store = {}
    local d = {}
    function d.get(_, k) return store[k] end
    function d.set(_, k, v) store[k] = v return true end
    function d.incr(_, k, v, init)
        local cur = store[k] or init
        store[k] = cur + v
        return cur + v
    end
    function d.flush_all() store = {} end
    _G.ngx = { shared = { kvgate_prefix = d }, log = function() end, WARN = 4 }
end
local out = in_nginx and function(s) ngx.log(ngx.NOTICE, s) end or print
local cjson = require "cjson.safe"
local prompt = require "kvgate.prompt"
local pi = require "kvgate.prefix_index"

local function bench(name, n, fn)
    for i = 1, n do
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
    out(string.format("%-66s %8.1f us", name, best))
end

local WORDS = {}
for i = 1, 4096 do
    WORDS[i] = string.format("%06x", i * 2654435761 % 16777216)
end
local function text(seed, bytes)
    local parts, len, i = {}, 0, 0
    while len < bytes do
        i = i + 1
        local w = WORDS[(seed * 7919 + i) % 4096 + 1]
        parts[i] = w
        len = len + #w + 1
    end
    return table.concat(parts, " "):sub(1, bytes)
end

local SYSTEM = text(0, 3600)
local N = 64
local function requests(user_bytes)
    local reqs = {}
    for i = 1, N do
        -- decoded from JSON, as the request stage leaves it
        reqs[i] = cjson.decode(cjson.encode({ model = "m", messages = {
            { role = "system", content = SYSTEM }, { role = "user", content = text(i, user_bytes) } } }))
    end
    return reqs
end

local idx = assert(pi.new("default", nil, ngx.shared.kvgate_prefix))
local slots = {}
for i = 1, 4 do
    slots[i] = pi.slot(idx, "n" .. i)
end

for _, case in ipairs({ { "48 KB", 44 * 1024, 2000 }, { "860 KB", 856 * 1024, 100 } }) do
    local label, user_bytes, iters = case[1], case[2], case[3]
    local reqs = requests(user_bytes)
    local canon = {}
    for i = 1, N do
        canon[i] = prompt.canonical(reqs[i], "chat", idx.max_chars)
    end
    out(string.format("%s prompt: %d bytes canonical, %d chunks of %d", label, #canon[1],
        math.floor(#canon[1] / idx.chunk), idx.chunk))
    bench(label .. ": prompt.canonical", iters, function(i)
        prompt.canonical(reqs[(i - 1) % N + 1], "chat", idx.max_chars)
    end)
    bench(label .. ": chain (hashes of every full chunk)", iters, function(i)
        pi.chain(canon[(i - 1) % N + 1], idx.chunk, idx.seed, idx.max_chunks)
    end)
    -- a conversation the index has: n1 holds all of it, n2..n4 its system prompt
    for i = 1, N do
        local n = pi.prepare(idx, reqs[i], "chat")
        pi.record(idx, slots[1], n, 0, nil)
        for j = 2, 4 do
            pi.record(idx, slots[j], 1, 0, nil)
        end
    end
    -- what a pick does: prepare, match on 4 nodes, record on the longest (a hit: no new chunk)
    bench(label .. ": start + pick, held on 1 of 4 nodes (prepare, 4 matches, record)", iters, function(i)
        local n = pi.prepare(idx, reqs[(i - 1) % N + 1], "chat")
        local depth, oldest = pi.match(idx, slots[1], n)
        for j = 2, 4 do
            pi.match(idx, slots[j], n)
        end
        pi.record(idx, slots[1], n, depth, oldest)
    end)
    -- a new conversation: nothing held past the system prompt, every chunk written
    local fresh = requests(user_bytes)
    for i = 1, N do
        fresh[i].messages[2].content = "x" .. fresh[i].messages[2].content
    end
    bench(label .. ": start + pick, a new prompt (prepare, 4 matches, every chunk written)", iters, function(i)
        local n = pi.prepare(idx, fresh[(i - 1) % N + 1], "chat")
        for j = 1, 4 do
            pi.match(idx, slots[j], n)
        end
        pi.record(idx, slots[2], n, 0, nil)
    end)
end
