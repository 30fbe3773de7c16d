-- A proxied answer's usage record (issue 13; docs/gateway.md, The request log): the token
-- counts of its `usage` object, its time to first byte, the chain of block hashes of its
-- prompt and what it cost and saved in whole nano-dollars (n$, so every sum is exact).
--
-- Tokens are read from the answer's end, where `usage` sits (the last members of a JSON
-- answer; the last data event of a stream, before `[DONE]`). The body filter keeps only the
-- last chunks (feed: two references per chunk, a concatenation only while the newest is
-- shorter than KEEP bytes), so a long stream costs no copying; the log phase reads the last
-- TAIL_BYTES of them once. Streams carry usage only when asked: the access stage (access())
-- asks the engine for it whenever the client did not, and kvgate.limits.strip_usage takes it
-- out again on the way back, byte for byte.
--
-- Money (contract of issue 13, CONTRACT "Request-log entry"): prices per pool in kvgate.json
-- (pools.<p>.prices = {input, cached, output: n$ per token; batch_discount: 0..1}).
--   cost         HIT 0; else (prompt - cached) × input + cached × cached + completion × output,
--                less the batch discount for a batch request (floor)
--   saved_cache  HIT: prompt × input + completion × output (the request it answered); else 0
--   saved_prefix cached × (input - cached price); HIT 0
--   saved_batch  a batch request's discount (its full cost - cost), else 0
-- nil (written "") = unknown: a pool without prices, or an answer without usage.
local bit = require "bit"
local limits = require "kvgate.limits"
local prompt = require "kvgate.prompt"
local prefix_index = require "kvgate.prefix_index"
local scan = require "kvgate.json_scan"

local ngx = ngx
local find = string.find
local sub = string.sub
local match = string.match
local tonumber = tonumber
local floor = math.floor
local concat = table.concat
local tohex = bit.tohex
local ffi = require "ffi"
local cast = ffi.cast
local u64p = ffi.typeof("const uint64_t *")

local _M = {}

-- bytes of the answer's end parsed for usage (a usage object with details is ~150 bytes, the
-- `[DONE]` event after it 14)
_M.TAIL_BYTES = 2048
-- the newest chunk kept is at least this long before it becomes the previous one: what the
-- two cover is never less than KEEP bytes, however small the engine's writes
_M.KEEP = 512
local KEEP = _M.KEEP
local TAIL_BYTES = _M.TAIL_BYTES

_M.DEFAULT_CHUNK = prefix_index.DEFAULTS.chunk_chars

--- feed(u, chunk, now): body filter; u: kctx.log (u.first = when the first byte came,
-- ngx.now() seconds; u.ucur, u.uprev = the last chunks)
function _M.feed(u, chunk, now)
    if chunk == nil or chunk == "" then
        return
    end
    local cur = u.ucur
    if cur == nil then
        u.ucur = chunk
        u.first = now
    elseif #cur < KEEP then
        u.ucur = cur .. chunk
    else
        u.uprev = cur
        u.ucur = chunk
    end
end

--- tail(u) -> the last TAIL_BYTES (or fewer) of the answer fed so far, or nil (no body)
function _M.tail(u)
    local cur = u.ucur
    if cur == nil then
        return nil
    end
    local n = #cur
    if n >= TAIL_BYTES then
        return sub(cur, -TAIL_BYTES)
    end
    local prev = u.uprev
    if prev == nil then
        return cur
    end
    return sub(prev, n - TAIL_BYTES) .. cur
end

--- parse(s[, no_completion]) -> prompt, completion, cached: the last `usage` object's
-- prompt_tokens, completion_tokens and prompt_tokens_details.cached_tokens in s (an answer's
-- end: JSON or SSE); nil, nil, nil without one (`"usage": null`, or none); cached 0 when the
-- usage has no details. A quote inside a JSON string is escaped, so `"usage"` only matches a
-- member name. no_completion: an answer that generates nothing (an embedding: usage
-- {prompt_tokens, total_tokens}): a missing completion_tokens is 0.
function _M.parse(s, no_completion)
    if not s then
        return nil
    end
    local at
    local from = 1
    while true do
        local i = find(s, '"usage"', from, true)
        if not i then
            break
        end
        at = i
        from = i + 7
    end
    if not at then
        return nil
    end
    local u = sub(s, at + 7)
    if not match(u, "^%s*:%s*{") then
        return nil -- "usage": null
    end
    local p = match(u, '"prompt_tokens"%s*:%s*(%d+)')
    local c = match(u, '"completion_tokens"%s*:%s*(%d+)')
    if not c and no_completion then
        c = 0
    end
    if not (p and c) then
        return nil
    end
    local cached = match(u, '"cached_tokens"%s*:%s*(%d+)')
    return tonumber(p), tonumber(c), tonumber(cached) or 0
end

--- read(u, hit_entry[, no_completion]) -> prompt, completion, cached: of a cache HIT's entry
-- (the stored JSON; cached is then 0: no engine computed it) or of the answer fed into u; nil
-- when unknown. no_completion: as for parse (an embedding)
function _M.read(u, hit_entry, no_completion)
    if hit_entry then
        local n = #hit_entry
        local p, c = _M.parse(n > TAIL_BYTES and sub(hit_entry, -TAIL_BYTES) or hit_entry, no_completion)
        if p then
            return p, c, 0
        end
        return nil
    end
    return _M.parse(_M.tail(u), no_completion)
end

--- costs(prices, prompt, completion, cached, hit, batch) -> cost, saved_cache, saved_prefix,
-- saved_batch: integer n$ each (see the header), nil = unknown. prices: the pool's
-- {input, cached, output (n$ per token), batch_discount} or nil; batch: true for a batch
-- request.
function _M.costs(prices, p, c, cached, hit, batch)
    if not prices or not p then
        return nil
    end
    local pin, pout = prices.input, prices.output
    if hit then
        return 0, p * pin + c * pout, 0, 0
    end
    local pc = prices.cached
    local full = (p - cached) * pin + cached * pc + c * pout
    local cost, saved_batch = full, 0
    if batch then
        local d = prices.batch_discount or 0
        cost = floor(full * (1 - d))
        saved_batch = full - cost
    end
    return cost, 0, cached * (pin - pc), saved_batch
end

local seeds = {} -- pool name -> its chain seed (prefix_index.seed)
local HEX = {}

--- blocks(req, endpoint, pool_name, chunk, max_blocks[, chain, whole]) -> the chain of block
-- hashes of the request's canonical prompt (kvgate.prefix_index.chain, the pool's chunk_chars
-- and name as its seed): 16 hex digits per full chunk, at most max_blocks, concatenated; ""
-- for none. chain: the same chain already computed (the prefix balancer's, kctx.balancer.chain:
-- its uint64 hashes as a string), used when it has max_blocks hashes or covers the whole
-- prompt (whole)
function _M.blocks(req, endpoint, pool_name, chunk, max_blocks, chain, whole)
    if not max_blocks or max_blocks < 1 then
        return ""
    end
    if chain then
        local n = #chain / 8
        if n >= max_blocks or whole then
            if n > max_blocks then
                n = max_blocks
            end
            local h = cast(u64p, chain)
            for k = 0, n - 1 do
                HEX[k + 1] = tohex(h[k], 16)
            end
            return concat(HEX, "", 1, n)
        end
    end
    chunk = chunk or _M.DEFAULT_CHUNK
    local cap = prefix_index.MAX_CHUNKS
    if max_blocks > cap then
        max_blocks = cap
    end
    local p = prompt.canonical(req, endpoint, max_blocks * chunk)
    if not p or #p < chunk then
        return ""
    end
    local seed = seeds[pool_name]
    if not seed then
        seed = prefix_index.seed(pool_name)
        seeds[pool_name] = seed
    end
    local n = prefix_index.chain(p, chunk, seed, max_blocks)
    local h = prefix_index.hashes
    for k = 0, n - 1 do
        HEX[k + 1] = tohex(h[k], 16)
    end
    return concat(HEX, "", 1, n)
end

local set_body_data = ngx and ngx.req and ngx.req.set_body_data
local pairs = pairs
local type = type

--- value_span(body, name) -> first, last byte of the value of the top-level member `name` of
-- the JSON object `body` (PURE), or nil (kvgate.json_scan: a scan of the whole body, so only
-- for the rare stream whose `stream_options` must be rewritten, never on the common path)
function _M.value_span(body, name)
    local start = scan.skip_ws(body, 1)
    local top = start and scan.members(body, start)
    local r = top and top[name]
    if not r then
        return nil
    end
    return r[1], r[2]
end

-- stream_options whose only member, if any, is include_usage (not true): the gateway may put
-- include_usage: true in their place and strip the usage again (anything else: left alone)
local function only_include_usage(so)
    if so == ngx.null then
        return true
    end
    if type(so) ~= "table" or so.include_usage == true then
        return false
    end
    for k in pairs(so) do
        if k ~= "include_usage" then
            return false
        end
    end
    return true
end

_M.USAGE_OPTIONS = '{"include_usage":true}'

--- access(kctx, cfg): stage "usage" (after the cache: a hit needs nothing): a stream whose
-- client did not ask for usage (no stream_options, null, {} or include_usage false) asks the
-- engine for it, and the body filter strips it again (kctx.log.strip), so every stream is
-- billed and the client gets exactly the stream it asked for
function _M.access(kctx, cfg)
    local r = kctx.req
    local req = r.parsed
    if not (req and req.stream == true) then
        return
    end
    local so = req.stream_options
    local body
    if so == nil then
        body = limits.ask_usage(r.body)
    elseif only_include_usage(so) then
        local vs, ve = _M.value_span(r.body, "stream_options")
        if vs then
            body = sub(r.body, 1, vs - 1) .. _M.USAGE_OPTIONS .. sub(r.body, ve + 1)
        end
    end
    if body then
        set_body_data(body)
        kctx.log.strip = true
    end
end

return _M
