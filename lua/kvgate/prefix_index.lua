-- Approximate prefix index of a pool: which nodes recently computed which prompt prefixes,
-- so the `prefix` balancer (kvgate.balancer.prefix) can send a request where most of its
-- prompt is already in a KV cache, with no `prefix_chars` window to tune.
--
-- Chain: the canonical prompt (kvgate.prompt.canonical) is cut into chunks of chunk_chars
-- bytes; chunk k's hash covers bytes 1 .. k × chunk_chars (a running state, like vLLM's block
-- hashes, each of which covers its parent), so "node n holds chunk k" implies that it held
-- the whole prefix up to there. Only full chunks are hashed (an engine caches full blocks
-- only). The hash is a 64-bit xxh64-style multiply-rotate over 8-byte words in LuaJIT FFI
-- (no allocation; ~19 us for 48 KB, tests/lua/bench_prefix.lua), seeded by the pool's name.
-- Not cryptographic on purpose: the index only steers routing. A collision (2^-64 per pair)
-- or a forged one costs a request its cache hit, never a security decision; the response
-- cache keys on sha256 (kvgate.cache_key). No prompt text is stored: only 8-byte hashes.
--
-- Store: lua_shared_dict kvgate_prefix (all workers), one entry per (chunk, node):
--   key   8 bytes: chain hash XOR the node's salt (a 64-bit hash of pool and node id)
--   value the chunk's stamp on the node's write counter when it was (re)written there
--   ttl   ttl_s (entries of a node that stops serving, or of a restarted engine, age out)
--   "c:<pool>:<id>"  the node's write counter: bytes of new prefix recorded on it so far
-- Capacity: an engine evicts least recently used blocks once full, so a chunk stamped S is
-- taken as gone once the node has been given capacity_chars more new bytes (counter − S ≥
-- capacity_chars): the node's KV capacity (vllm:cache_config_info num_gpu_blocks ×
-- block_size tokens, from the policy: the gateway has no engine figures) times
-- chars_per_token. A prompt's chunks are stamped as vLLM frees a finished sequence's blocks,
-- tail first: the head gets the counter, each chunk before the tail one chunk less, so under
-- pressure the end of a prompt goes before its (more shared) beginning and what the index
-- still holds of a chain is always a leading part of it. Reused chunks are re-stamped (an
-- LRU touch) when older than a quarter of the capacity, so most hits write nothing. The dict
-- itself is LRU when full (set() evicts the least recently used entries): a bound on
-- memory, not on truth.
-- Races between workers lose at most a stamp; the index is approximate by design.
local ffi = require "ffi"
local bit = require "bit"
local prompt = require "kvgate.prompt"

local ngx = ngx
local rol, bxor, rshift, band = bit.rol, bit.bxor, bit.rshift, bit.band
local floor = math.floor
local tonumber = tonumber
local tostring = tostring
local type = type
local byte = string.byte
local ffi_string = ffi.string
local cast = ffi.cast

local _M = {}

_M.DICT = "kvgate_prefix"
_M.DEFAULTS = {
    chunk_chars = 2048,            -- bytes of canonical prompt per chunk (a multiple of 8)
    capacity_chars = 4194304,      -- per node: 1,048,576 tokens × 4 chars per token
    chars_per_token = 4,
    ttl_s = 3600,
    max_chars = 1048576,           -- the index covers at most this much of a prompt
}
-- the chain buffer's size: max_chars / chunk_chars may not exceed it (checked in new())
_M.MAX_CHUNKS = 8192
-- a chunk is held until the node was given REMEMBER × its capacity of newer prefix. The
-- engine keeps blocks longer than the write counter says: they are recent from the end of
-- their request (pinned until then), not from its pick, and the counter also counts as new
-- what the index forgot but the engine still had. Erring long is cheap (a node believed to
-- hold a prefix it lost gets a request any node would have computed in full), erring short
-- costs hits: on the demo replay at 1 × (with 7 bytes per token, the trace's words) 150 of
-- 560 continuations went to a node other than their previous turn's, most after a gap of
-- 12 s or more; at 4 × (with the default 4 bytes per token) 1 did, 0.97 of the ceiling.
_M.REMEMBER = 4

local P1 = 0x9E3779B185EBCA87ULL
local P2 = 0xC2B2AE3D27D4EB4FULL
local P3 = 0x165667B19E3779F9ULL
local FNV_OFFSET = 0xcbf29ce484222325ULL
local FNV_PRIME = 0x100000001b3ULL
local u64p = ffi.typeof("const uint64_t *")

-- per worker: the chain of the last prompt hashed, and an 8-byte key buffer. Nothing
-- between chain() and the lookups that read it yields, so no two requests interleave here.
local hashes = ffi.new("uint64_t[?]", _M.MAX_CHUNKS)
local keybuf = ffi.new("uint64_t[1]")
_M.hashes = hashes

--- seed(s) -> uint64 cdata: FNV-1a 64 of the string s (pool names, node ids: short, once
-- per instance)
function _M.seed(s)
    local h = FNV_OFFSET
    for i = 1, #s do
        h = bxor(h, byte(s, i)) * FNV_PRIME
    end
    return h
end

--- chain(s, chunk, seed, max_chunks) -> n: the chain hashes of the first n full chunks of
-- the string s in _M.hashes[0 .. n-1] (n = min(#s // chunk, max_chunks)); chunk: bytes,
-- a multiple of 8; seed: uint64 (the pool's)
function _M.chain(s, chunk, seed, max_chunks)
    local n = floor(#s / chunk)
    if n > max_chunks then
        n = max_chunks
    end
    if n == 0 then
        return 0
    end
    local p = cast(u64p, s)
    local words = chunk / 8
    local acc = seed + 0ULL
    local w = 0
    for k = 0, n - 1 do
        for i = w, w + words - 1 do
            acc = rol(acc + p[i] * P2, 31) * P1
        end
        w = w + words
        -- xxh64's avalanche of the running state: chunk k's key, acc goes on unchanged
        local h = bxor(acc, rshift(acc, 33)) * P2
        h = bxor(h, rshift(h, 29)) * P3
        hashes[k] = bxor(h, rshift(h, 32))
    end
    return n
end

--- point(k) -> the low 32 bits of chain hash k (0-based) as a number: a place on the ring
function _M.point(k)
    return tonumber(band(hashes[k], 0xffffffffULL)) % 4294967296
end

--- new(pool_name, opts, dict) -> index: {pool, chunk, cap, cpt, ttl, max_chunks, seed, dict}
-- opts: kvgate.json's pool.prefix_index (nil: DEFAULTS); dict: the shared dict (nil:
-- ngx.shared.kvgate_prefix; the index is off without one). Errors: nil, message.
function _M.new(pool_name, opts, dict)
    opts = type(opts) == "table" and opts or {}
    local D = _M.DEFAULTS
    local chunk = tonumber(opts.chunk_chars) or D.chunk_chars
    if chunk < 8 or chunk % 8 ~= 0 then
        return nil, "prefix_index.chunk_chars must be a multiple of 8, got " .. tostring(chunk)
    end
    local max_chars = tonumber(opts.max_chars) or D.max_chars
    local max_chunks = floor(max_chars / chunk)
    if max_chunks > _M.MAX_CHUNKS then
        max_chunks = _M.MAX_CHUNKS
    end
    if dict == nil and ngx and ngx.shared then
        dict = ngx.shared[_M.DICT]
    end
    return {
        pool = pool_name,
        chunk = chunk,
        cap = (tonumber(opts.capacity_chars) or D.capacity_chars) * _M.REMEMBER,
        cpt = tonumber(opts.chars_per_token) or D.chars_per_token,
        ttl = tonumber(opts.ttl_s) or D.ttl_s,
        max_chars = max_chunks * chunk,
        max_chunks = max_chunks,
        seed = _M.seed(pool_name),
        dict = dict or false,
    }
end

--- slot(index, id) -> a node's handle in the index: {salt (uint64), ckey (its counter's key)}
function _M.slot(index, id)
    id = tostring(id)
    return { salt = _M.seed(index.pool .. "\0" .. id), ckey = "c:" .. index.pool .. ":" .. id }
end

local function key(k, salt)
    keybuf[0] = bxor(hashes[k], salt)
    return ffi_string(keybuf, 8)
end

-- counter(d, ckey) -> the node's write counter (0 when none: a new node, or evicted)
local function counter(d, ckey)
    return tonumber(d:get(ckey)) or 0
end

--- match(index, slot, n) -> depth, head, count: how many leading chunks of the chain in
-- _M.hashes[0 .. n-1] the node still holds (0 .. n), the first chunk's stamp (when the chain
-- was last written there: nil when depth is 0), and the node's write counter. One dict read
-- per chunk held, plus two.
function _M.match(index, slot, n)
    local d = index.dict
    if not d or n == 0 then
        return 0, nil, 0
    end
    local c = counter(d, slot.ckey)
    local cap, salt = index.cap, slot.salt
    local head
    for k = 0, n - 1 do
        local v = d:get(key(k, salt))
        -- a stamp above the counter: the counter was evicted or reset, the entry is stale
        if not v or c - v >= cap or v > c then
            return k, head, c
        end
        if k == 0 then
            head = v
        end
    end
    return n, head, c
end

--- record(index, slot, n, depth, head): the node computes the chain in _M.hashes[0 .. n-1],
-- of which it held the first `depth` chunks (match()'s figures): the new chunks are written
-- with their stamps, the held ones re-stamped when the chain was last written more than a
-- quarter of the capacity ago. Shared-dict writes only (balancer or log phase).
function _M.record(index, slot, n, depth, head)
    local d = index.dict
    if not d or n == 0 then
        return
    end
    local new = n - depth
    local c, err = d:incr(slot.ckey, new * index.chunk, 0)
    if not c then
        if ngx and ngx.log then
            ngx.log(ngx.WARN, "kvgate prefix index: ", err)
        end
        return
    end
    local salt, ttl, chunk = slot.salt, index.ttl, index.chunk
    local from = depth
    if depth > 0 and head and c - head > index.cap / 4 then
        from = 0
    end
    -- the tail is the least recent (freed first): chunk k is stamped k chunks before the head
    for k = from, n - 1 do
        d:set(key(k, salt), c - k * chunk, ttl)
    end
end

--- prepare(index, req, endpoint) -> n, chars: the chain of a decoded request (chat or
-- completions) in _M.hashes[0 .. n-1]; chars: the bytes of its canonical prompt (at most
-- index.max_chars: longer prompts are indexed and counted that far)
function _M.prepare(index, req, endpoint)
    local p = prompt.canonical(req, endpoint, index.max_chars)
    return _M.chain(p, index.chunk, index.seed, index.max_chunks), #p
end

--- held_tokens(index, depth) -> the prompt tokens a node holding `depth` chunks already has
-- (depth × chunk_chars ÷ chars_per_token): the figure a load count discounts
function _M.held_tokens(index, depth)
    return depth * index.chunk / index.cpt
end

return _M
