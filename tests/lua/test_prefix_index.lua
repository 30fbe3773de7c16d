-- kvgate.prefix_index: the chained chunk hashes of a canonical prompt and the shared-dict index
-- (longest match per node, the capacity and TTL bounds, the LRU touch), against a stand-in
-- for lua_shared_dict (TTL and LRU eviction at a fixed number of entries, like set()'s when
-- the zone is full); the real dict runs in tests/integration/test_gateway_prefix.py.
local H = dofile("tests/lua/helper.lua")

local now = 0
local function new_dict(max_entries)
    local store, order, seq = {}, {}, 0
    local d = { writes = 0, reads = 0 }
    local function live(k)
        local e = store[k]
        if e and e.exp and e.exp <= now then
            store[k] = nil
            return nil
        end
        return e
    end
    local function touch(k)
        seq = seq + 1
        order[k] = seq
    end
    function d.get(_, k)
        d.reads = d.reads + 1
        local e = live(k)
        if e then
            touch(k)
            return e.v
        end
        return nil
    end
    function d.set(_, k, v, ttl)
        d.writes = d.writes + 1
        if not store[k] and max_entries then
            local n, lru, lseq = 0, nil, math.huge
            for key in pairs(store) do
                n = n + 1
                if order[key] < lseq then
                    lru, lseq = key, order[key]
                end
            end
            if n >= max_entries then
                store[lru] = nil
            end
        end
        store[k] = { v = v, exp = ttl and ttl > 0 and now + ttl or nil }
        touch(k)
        return true
    end
    function d.incr(self, k, v, init, init_ttl)
        local e = live(k)
        if not e then
            if init == nil then
                return nil, "not found"
            end
            self:set(k, init + v, init_ttl)
            return init + v
        end
        e.v = e.v + v
        touch(k)
        return e.v
    end
    function d.count()
        local n = 0
        for k in pairs(store) do
            if live(k) then
                n = n + 1
            end
        end
        return n
    end
    return d
end
_G.ngx = { shared = {}, now = function() return now end, log = function() end, WARN = 4 }

local pi = require "kvgate.prefix_index"

local CHUNK = 64
local function text(seed, n)
    -- n bytes of deterministic text, distinct per seed
    local parts, len, i = {}, 0, 0
    while len < n do
        i = i + 1
        local w = string.format("w%d_%d ", seed, i)
        parts[#parts + 1] = w
        len = len + #w
    end
    return table.concat(parts):sub(1, n)
end

local function chain_of(s, seed)
    local n = pi.chain(s, CHUNK, seed or pi.seed("p"), 1000)
    local out = {}
    for k = 0, n - 1 do
        out[k + 1] = tostring(pi.hashes[k])
    end
    return out
end

H.test("chain: full chunks only, deterministic, each hash covers everything before it", function()
    local sys = text(1, 3 * CHUNK)
    local a = chain_of(sys .. text(2, 2 * CHUNK + 10))
    local b = chain_of(sys .. text(3, 2 * CHUNK + 10))
    H.eq(#a, 5, "two full chunks of the user part, the 10-byte tail not hashed")
    H.eq(#chain_of(sys .. text(2, 2 * CHUNK + 10)), 5)
    H.eq(chain_of(sys .. text(2, 2 * CHUNK + 10))[5], a[5], "deterministic")
    for k = 1, 3 do
        H.eq(a[k], b[k], "shared chunk " .. k)
    end
    H.ne(a[4], b[4], "first chunk that differs")
    -- chunk 5 of the same bytes after a different chunk 4 still differs: chained
    local c = chain_of(sys .. text(3, CHUNK) .. text(2, 2 * CHUNK + 10):sub(CHUNK + 1))
    H.ne(c[5], a[5], "a chunk's hash covers its whole prefix")
    H.eq(#chain_of(text(1, CHUNK - 1)), 0, "shorter than a chunk: no chain")
    H.ne(chain_of(sys, pi.seed("p"))[1], chain_of(sys, pi.seed("q"))[1], "seeded by the pool")
end)

H.test("chain: a one-byte change moves every hash from its chunk on, none before", function()
    local s = text(7, 8 * CHUNK)
    local a = chain_of(s)
    local pos = 5 * CHUNK + 3
    local t = s:sub(1, pos - 1) .. (s:sub(pos, pos) == "x" and "y" or "x") .. s:sub(pos + 1)
    local b = chain_of(t)
    for k = 1, 5 do
        H.eq(a[k], b[k], "chunk " .. k)
    end
    for k = 6, 8 do
        H.ne(a[k], b[k], "chunk " .. k)
    end
end)

H.test("chain: capped at max_chunks", function()
    H.eq(pi.chain(text(1, 10 * CHUNK), CHUNK, pi.seed("p"), 4), 4)
end)

local function index(opts, dict)
    now = 0
    return assert(pi.new("p", opts or { chunk_chars = CHUNK, capacity_chars = 100 * CHUNK, ttl_s = 60,
                                        max_chars = 1000 * CHUNK }, dict or new_dict()))
end

H.test("new: bad chunk size refused; defaults without settings", function()
    local idx, err = pi.new("p", { chunk_chars = 100 }, new_dict())
    H.eq(idx, nil)
    H.truthy(err:find("multiple of 8"), err)
    local d = assert(pi.new("p", nil, new_dict()))
    H.eq(d.chunk, pi.DEFAULTS.chunk_chars)
    H.eq(d.max_chars, pi.DEFAULTS.max_chars)
end)

H.test("match: longest leading run per node, nodes apart", function()
    local idx = index()
    local a, b = pi.slot(idx, "a"), pi.slot(idx, "b")
    local sys = text(1, 3 * CHUNK)
    local n1 = pi.chain(sys .. text(2, 4 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    H.eq(n1, 7)
    H.eq((pi.match(idx, a, n1)), 0, "empty index")
    pi.record(idx, a, n1, 0, nil)
    H.eq((pi.match(idx, a, n1)), 7)
    H.eq((pi.match(idx, b, n1)), 0, "another node holds nothing")
    -- a second conversation with the same system prompt: a holds its first 3 chunks
    local n2 = pi.chain(sys .. text(3, 4 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    H.eq((pi.match(idx, a, n2)), 3)
    pi.record(idx, b, n2, 0, nil)
    -- the next turn of conversation 1 extends its prompt: a holds all of the old turn
    local n3 = pi.chain(sys .. text(2, 4 * CHUNK) .. text(9, 3 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    H.eq(n3, 10)
    H.eq((pi.match(idx, a, n3)), 7)
    H.eq((pi.match(idx, b, n3)), 3)
    H.eq(pi.held_tokens(idx, 7), 7 * CHUNK / pi.DEFAULTS.chars_per_token)
end)

H.test("capacity: chunks go once the node was given REMEMBER x capacity_chars of newer prefix, tail first", function()
    -- a capacity of 10 chunks as the index counts it
    local idx = index({ chunk_chars = CHUNK, capacity_chars = 10 * CHUNK / pi.REMEMBER, ttl_s = 600,
                        max_chars = 100 * CHUNK })
    H.eq(idx.cap, 10 * CHUNK)
    local a = pi.slot(idx, "a")
    local s1 = text(1, 4 * CHUNK)
    local function held()
        local n = pi.chain(s1, CHUNK, idx.seed, idx.max_chunks)
        return (pi.match(idx, a, n))
    end
    local function other(seed, chunks)
        local n = pi.chain(text(seed, chunks * CHUNK), CHUNK, idx.seed, idx.max_chunks)
        pi.record(idx, a, n, 0, nil)
    end
    local n = pi.chain(s1, CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n, 0, nil)
    -- as vLLM frees a finished sequence's blocks tail first: its last chunk is the least
    -- recent (stamped 3 chunks before its head), its first the most recent
    other(2, 6)
    H.eq(held(), 4, "6 chunks written since: 4 + 6 = capacity, all held")
    other(3, 1)
    H.eq(held(), 3, "one more: the tail chunk is evicted first")
    other(4, 2)
    H.eq(held(), 1, "the head goes last")
    other(5, 1)
    H.eq(held(), 0, "10 chunks written after the head: evicted (the engine's LRU)")
end)

H.test("capacity: a reused prefix is touched (re-stamped) and outlives newer ones", function()
    local dict = new_dict()
    local idx = index({ chunk_chars = CHUNK, capacity_chars = 8 * CHUNK / pi.REMEMBER, ttl_s = 600,
                        max_chars = 100 * CHUNK }, dict)
    local a = pi.slot(idx, "a")
    local sys = text(1, 2 * CHUNK)
    local k = 10
    for i = 1, 6 do
        -- each request: the shared 2 chunks + 1 own chunk
        local n = pi.chain(sys .. text(k + i, CHUNK), CHUNK, idx.seed, idx.max_chunks)
        local depth, oldest = pi.match(idx, a, n)
        if i > 1 then
            H.eq(depth, 2, "request " .. i .. " finds the shared prefix")
        end
        pi.record(idx, a, n, depth, oldest)
    end
    -- 2 + 6 = 8 chunks written: the shared prefix, touched on the way, is still held
    local n = pi.chain(sys, CHUNK, idx.seed, idx.max_chunks)
    H.eq((pi.match(idx, a, n)), 2)
    -- the first request's own chunk (written 7 chunks ago) is still there, its stamp
    local n1 = pi.chain(sys .. text(k + 1, CHUNK), CHUNK, idx.seed, idx.max_chunks)
    H.eq((pi.match(idx, a, n1)), 3)
    local w = dict.writes
    -- a touch only when the held part is older than capacity / 4: a fresh hit writes only its new chunk
    local n7 = pi.chain(sys .. text(k + 7, CHUNK), CHUNK, idx.seed, idx.max_chunks)
    local depth, oldest = pi.match(idx, a, n7)
    pi.record(idx, a, n7, depth, oldest)
    H.eq(dict.writes - w, 1 + 2, "the new chunk, and the shared prefix (last stamped > capacity/4 ago)")
    w = dict.writes
    local n8 = pi.chain(sys .. text(k + 8, CHUNK), CHUNK, idx.seed, idx.max_chunks)
    depth, oldest = pi.match(idx, a, n8)
    pi.record(idx, a, n8, depth, oldest)
    H.eq(dict.writes - w, 1, "just touched: only the new chunk (and the counter's incr)")
end)

H.test("ttl: entries age out after ttl_s", function()
    local idx = index({ chunk_chars = CHUNK, capacity_chars = 100 * CHUNK, ttl_s = 30, max_chars = 100 * CHUNK })
    local a = pi.slot(idx, "a")
    local n = pi.chain(text(1, 3 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n, 0, nil)
    now = 29
    H.eq((pi.match(idx, a, n)), 3)
    now = 31
    H.eq((pi.match(idx, a, n)), 0)
end)

H.test("dict bound: a full dict evicts least recently used entries, the index degrades to shorter matches", function()
    local dict = new_dict(12)
    local idx = index({ chunk_chars = CHUNK, capacity_chars = 1000 * CHUNK, ttl_s = 600, max_chars = 100 * CHUNK },
        dict)
    local a = pi.slot(idx, "a")
    local s1 = text(1, 4 * CHUNK)
    local n = pi.chain(s1, CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n, 0, nil)
    local n2 = pi.chain(text(2, 8 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n2, 0, nil)
    H.truthy(dict.count() <= 12, "bounded: " .. dict.count())
    n = pi.chain(s1, CHUNK, idx.seed, idx.max_chunks)
    H.truthy((pi.match(idx, a, n)) < 4, "the oldest chunks were evicted")
    n2 = pi.chain(text(2, 8 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    H.eq((pi.match(idx, a, n2)), 8, "the newest are held")
end)

H.test("a counter lost to eviction makes its node's entries stale, not immortal", function()
    local dict = new_dict()
    local idx = index(nil, dict)
    local a = pi.slot(idx, "a")
    local n = pi.chain(text(1, 3 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n, 0, nil)
    dict:set(a.ckey, nil)
    dict:set(a.ckey, 0)
    H.eq((pi.match(idx, a, n)), 0)
end)

H.test("no dict: the index is off (nothing matches, nothing is written)", function()
    local idx = assert(pi.new("p", { chunk_chars = CHUNK }, false))
    local a = pi.slot(idx, "a")
    local n = pi.chain(text(1, 3 * CHUNK), CHUNK, idx.seed, idx.max_chunks)
    pi.record(idx, a, n, 0, nil)
    H.eq((pi.match(idx, a, n)), 0)
end)

H.test("prepare: a chat request's chain is the chain of its canonical prompt", function()
    local idx = index({ chunk_chars = CHUNK, max_chars = 1000 * CHUNK })
    local prompt = require "kvgate.prompt"
    local req = { messages = { { role = "system", content = text(1, 5 * CHUNK) },
                               { role = "user", content = text(2, 3 * CHUNK) } } }
    local p = prompt.canonical(req, "chat")
    local n, chars = pi.prepare(idx, req, "chat")
    H.eq(chars, #p)
    local want = chain_of(p, idx.seed)
    H.eq(n, #want)
    H.eq(tostring(pi.hashes[n - 1]), want[n])
    -- cut at max_chars
    local small = index({ chunk_chars = CHUNK, max_chars = 2 * CHUNK })
    n, chars = pi.prepare(small, req, "chat")
    H.eq(n, 2)
    H.eq(chars, 2 * CHUNK)
end)

H.done()
