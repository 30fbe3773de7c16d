-- The consistent-hash ring of a chash pool: ketama points built from node ids.
-- PURE (no ngx.*): tests/oracles/ring.py is its executable spec and test oracle
-- (tests/data/ring_vectors.json holds golden vectors both are checked against).
--
-- Construction (nginx's ketama, ngx_http_upstream_init_chash, with the node id where
-- nginx puts "HOST \0 PORT"):
--   base  = CRC-32 state after the bytes  id .. "\0"   (init 0xffffffff, no final xor)
--   point = final(update(base, prev as 4 little-endian bytes)), prev = that point,
--           160 × weight times, prev starting at 0
-- so a node's place on the ring is a function of its id and weight only: a new address,
-- a host written `localhost` here and `127.0.0.1` there, or another order of the nodes
-- moves no key. Raising a weight appends points (the first 160 × w stay), so keys move
-- only to that node. Points are sorted by hash; of equal hashes the point of the node
-- whose id sorts first (bytewise) is kept, the others dropped (nginx keeps the first of
-- a run too). Lookup: the first point >= the key's CRC-32, wrapping past the last.
--
-- Points live in FFI arrays out of the GC's way (4 + 2 bytes a point, plus a bucket index
-- of 4 to 8 bytes a point): 4 nodes at weight=100 are 64,000 points, at the policy's cap
-- (weight=1000) 640,000.
local ffi = require "ffi"
local bit = require "bit"

local band = bit.band
local bxor = bit.bxor
local rshift = bit.rshift
local byte = string.byte
local sort = table.sort
local type = type
local floor = math.floor

local _M = {}

_M.POINTS_PER_WEIGHT = 160
_M.MAX_NODES = 65535

local U32 = ffi.typeof("uint32_t[?]")
local U16 = ffi.typeof("uint16_t[?]")
local I32 = ffi.typeof("int32_t[?]")
local TWO32 = 4294967296

-- the CRC-32 table of ngx_crc32 (reflected polynomial 0xedb88320)
local T = {}
for n = 0, 255 do
    local c = n
    for _ = 1, 8 do
        if band(c, 1) == 1 then
            c = bxor(rshift(c, 1), 0xEDB88320)
        else
            c = rshift(c, 1)
        end
    end
    T[n] = c
end
-- slicing-by-4 tables for fill()'s inner loop, FFI arrays (the point loop runs 160 × weight
-- times a node, 16,000 at weight=100): T1[i] is T[i] followed by one zero byte, T2 by two, T3
-- by three, so the CRC of the 4 bytes of prev onto c is T3[x & 255] ^ T2[x >> 8 & 255] ^
-- T1[x >> 16 & 255] ^ T[x >> 24] with x = c ^ prev: four independent lookups, not a chain of four
local T0, T1, T2, T3 = ffi.new("int32_t[256]"), ffi.new("int32_t[256]"), ffi.new("int32_t[256]"),
    ffi.new("int32_t[256]")
for n = 0, 255 do
    T0[n] = T[n]
end
for n = 0, 255 do
    T1[n] = bxor(rshift(T0[n], 8), T0[band(T0[n], 0xFF)])
    T2[n] = bxor(rshift(T1[n], 8), T0[band(T1[n], 0xFF)])
    T3[n] = bxor(rshift(T2[n], 8), T0[band(T2[n], 0xFF)])
end

local function update(crc, s)
    for i = 1, #s do
        crc = bxor(T[band(bxor(crc, byte(s, i)), 0xFF)], rshift(crc, 8))
    end
    return crc
end

local function unsigned(v)
    if v < 0 then
        return v + TWO32
    end
    return v
end

--- crc32(s) -> the standard CRC-32 of s as an unsigned integer (= ngx.crc32_long(s),
-- the key's point; used where ngx is not loaded)
function _M.crc32(s)
    return unsigned(bxor(update(0xFFFFFFFF, s), 0xFFFFFFFF))
end

-- fill(hashes, owners, at, id, weight, owner) -> next free index: the 160 × weight points
-- of one node, in generation order
local function fill(hashes, owners, at, id, weight, owner)
    local base = update(0xFFFFFFFF, id .. "\0")
    local prev = 0
    for _ = 1, _M.POINTS_PER_WEIGHT * weight do
        local x = bxor(base, prev)
        prev = bxor(T3[band(x, 0xFF)], T2[band(rshift(x, 8), 0xFF)], T1[band(rshift(x, 16), 0xFF)],
                    T0[rshift(x, 24)], 0xFFFFFFFF)
        hashes[at] = unsigned(prev)
        owners[at] = owner
        at = at + 1
    end
    return at
end

--- points(id, weight) -> array of the node's 160 × weight point hashes, in generation order
function _M.points(id, weight)
    local n = _M.POINTS_PER_WEIGHT * weight
    local hashes, owners = U32(n), U16(n)
    fill(hashes, owners, 0, id, weight, 1)
    local out = {}
    for i = 0, n - 1 do
        out[i + 1] = hashes[i]
    end
    return out
end

-- LSD radix sort of n (hash, owner) pairs by hash, 16 + 16 bits; stable, so of equal hashes
-- the one written first stays first. Both digits' counts come from one pass (a digit's count
-- does not depend on the order). Returns the sorted arrays.
local function radix_sort(h, o, n)
    local h2, o2 = U32(n), U16(n)
    local lo, hi = I32(65536), I32(65536)
    for i = 0, n - 1 do
        local v = h[i]
        local d = band(v, 0xFFFF)
        lo[d] = lo[d] + 1
        d = rshift(v, 16)
        hi[d] = hi[d] + 1
    end
    for pass = 1, 2 do
        local count = pass == 1 and lo or hi
        local shift = pass == 1 and 0 or 16
        local sum = 0
        for d = 0, 65535 do
            local c = count[d]
            count[d] = sum
            sum = sum + c
        end
        for i = 0, n - 1 do
            local v = h[i]
            local d = band(rshift(v, shift), 0xFFFF)
            local at = count[d]
            count[d] = at + 1
            h2[at] = v
            o2[at] = o[i]
        end
        h, h2 = h2, h
        o, o2 = o2, o
    end
    return h, o
end

-- bucket bits for n points: about one point a bucket, 2^8 to 2^22 buckets
local function bucket_bits(n)
    local bits = 8
    while bits < 22 and (2 ^ bits) < n do
        bits = bits + 1
    end
    return bits
end

local function by_id(a, b)
    return a.id < b.id
end

--- new(nodes) -> ring | nil, err
-- nodes: array of tables with `id` (string) and `weight` (integer >= 1, nginx weight=
-- units); other fields are kept. ring.nodes is that array sorted by id; owner numbers
-- are indexes into it. Order of `nodes` does not matter.
function _M.new(nodes)
    if type(nodes) ~= "table" or #nodes == 0 then
        return nil, "a ring needs at least one node"
    end
    if #nodes > _M.MAX_NODES then
        return nil, "more than " .. _M.MAX_NODES .. " nodes"
    end
    local sorted = {}
    local total = 0
    for i = 1, #nodes do
        local node = nodes[i]
        local w = node.weight
        if type(node.id) ~= "string" or node.id == "" then
            return nil, "node " .. i .. " has no id"
        end
        if type(w) ~= "number" or w < 1 or w ~= floor(w) then
            return nil, "node " .. node.id .. ": weight must be an integer >= 1"
        end
        sorted[i] = node
        total = total + _M.POINTS_PER_WEIGHT * w
    end
    sort(sorted, by_id)
    for i = 2, #sorted do
        if sorted[i].id == sorted[i - 1].id then
            return nil, "node id " .. sorted[i].id .. " appears twice"
        end
    end
    local hashes, owners = U32(total), U16(total)
    local at = 0
    for k = 1, #sorted do
        at = fill(hashes, owners, at, sorted[k].id, sorted[k].weight, k)
    end
    hashes, owners = radix_sort(hashes, owners, total)
    -- bucket index: first[b] = the first point with hash >= b << shift, about one point a
    -- bucket, so a lookup reads first[] and steps over a point or two instead of a binary
    -- search's ~17 probes (the balancer runs once per request, mostly interpreted).
    -- first[b] = the number of points in buckets below b: each kept point is counted into
    -- first[its bucket + 1] (in the same pass that drops equal hashes), then summed up.
    local bits = bucket_bits(total)
    local shift = 32 - bits
    local buckets = 2 ^ bits
    local first = U32(buckets + 1)
    -- keep the first point of each run of equal hashes (the lowest id: written first)
    local n = 0
    local last = -1
    for i = 0, total - 1 do
        local v = hashes[i]
        if v ~= last then
            hashes[n] = v
            owners[n] = owners[i]
            n = n + 1
            last = v
            local d = rshift(v, shift) + 1
            first[d] = first[d] + 1
        end
    end
    if bucket_bits(n) ~= bits then
        -- dropped points changed the bucket count (n just past a power of two): count again
        bits = bucket_bits(n)
        shift = 32 - bits
        buckets = 2 ^ bits
        first = U32(buckets + 1)
        for i = 0, n - 1 do
            local d = rshift(hashes[i], shift) + 1
            first[d] = first[d] + 1
        end
    end
    local run = 0
    for b = 1, buckets do
        run = run + first[b]
        first[b] = run
    end
    return { n = n, hashes = hashes, owners = owners, nodes = sorted, count = #sorted, first = first, shift = shift }
end

--- index(ring, point) -> 0-based index of the first point with hash >= point (0 past the last)
function _M.index(ring, point)
    local hashes, n = ring.hashes, ring.n
    local i = ring.first[rshift(point, ring.shift)]
    while i < n and hashes[i] < point do
        i = i + 1
    end
    if i == n then
        return 0
    end
    return i
end

--- home(ring, point) -> the node (a table of ring.nodes) owning the key's point
function _M.home(ring, point)
    return ring.nodes[ring.owners[_M.index(ring, point)]]
end

--- find(ring, point, skip, arg) -> node, home | nil, home
-- The first node of the key's walk (the distinct owners of the points from the key's
-- place on, in ring order) for which skip(node, arg) is false; skip is called at most
-- once per node. home is the key's home node (skipped or not). nil: every node skipped.
function _M.find(ring, point, skip, arg)
    local i = _M.index(ring, point)
    local owners, nodes = ring.owners, ring.nodes
    local o = owners[i]
    local home = nodes[o]
    if not skip or not skip(home, arg) then
        return home, home
    end
    local left = ring.count - 1
    if left == 0 then
        -- one node, skipped: no walk over its points (160 × weight of them)
        return nil, home
    end
    local checked = { [o] = true }
    local n = ring.n
    for _ = 2, n do
        i = i + 1
        if i == n then
            i = 0
        end
        o = owners[i]
        if not checked[o] then
            local node = nodes[o]
            if not skip(node, arg) then
                return node, home
            end
            left = left - 1
            if left == 0 then
                break
            end
            checked[o] = true
        end
    end
    return nil, home
end

--- walk(ring, point) -> array of the distinct nodes in ring order from the key's home
function _M.walk(ring, point)
    local out, seen = {}, {}
    local i = _M.index(ring, point)
    for _ = 1, ring.n do
        local o = ring.owners[i]
        if not seen[o] then
            seen[o] = true
            out[#out + 1] = ring.nodes[o]
            if #out == ring.count then
                break
            end
        end
        i = i + 1
        if i == ring.n then
            i = 0
        end
    end
    return out
end

return _M
