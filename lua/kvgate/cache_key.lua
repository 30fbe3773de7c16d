-- Response-cache key and cacheability. PURE.
--
-- key = "kvgate:resp:v<N>:<tenant>:" .. sha256(digest form of
--        {endpoint, tenant, v, cred, req = request minus EXCLUDED fields})
-- The digest form (digest_form() below) is canonical like json.canonical (keys sorted at
-- every level) but never escapes a string: each is written as its length and its bytes, so
-- a 40 KB prompt is copied once instead of re-encoded by cjson (~100 µs at 40 KB; the
-- sha256 of it is ~25 µs).
-- cred is the digest of the caller's credential headers (credential()): callers with
-- different credentials, or with none, never share an entry. Only that digest enters the material
-- and the key is a hash of the material, so the credential never reaches Redis, and the
-- key does not show which entries belong to one caller.
-- Every other top-level field is part of the key, as sent: the model, the whole
-- messages/prompt (system prompt included), tools, and every sampling/output
-- parameter. A parameter that is absent is not the same as one sent with its
-- default value (the engine's default may change). Keys are sorted recursively,
-- so reordering JSON keys gives the same key.
local hash = require "kvgate.hash"
local json = require "kvgate.json"
local keys = require "kvgate.keys"
local prompt = require "kvgate.prompt"
local buffer = require "string.buffer"

local type = type
local pairs = pairs
local rawget = rawget
local gsub = string.gsub
local format = string.format
local byte = string.byte
local lower = string.lower
local find = string.find
local tostring = tostring
local tonumber = tonumber
local sort = table.sort
local floor = math.floor
local huge = math.huge

local _M = {}

local MAX_EXACT_INT = 2 ^ 53

-- Fields that do not change the answer: transport (`stream`, `stream_options`:
-- a hit is replayed in either form) and the end-user id (`user`, which OpenAI
-- uses for abuse monitoring; the credential, and later tenants, scope the cache instead).
_M.EXCLUDED = { stream = true, stream_options = true, user = true }

local scopes = {} -- tenant -> escaped (the tenants are the config's: bounded)

local function escape_scope(s)
    local e = scopes[s]
    if e == nil then
        e = gsub(s, "[^%w_.-]", function(c)
            return format("%%%02X", byte(c))
        end)
        scopes[s] = e
    end
    return e
end

-- cred of a request that sends none of the credential headers (the anonymous scope)
_M.NO_CREDENTIAL = "none"

--- credential(headers, names[, args]) -> digest | nil, err
-- headers: ngx.req.get_headers() (lowercase names; a value is a string, or a list of
-- strings when the header is repeated). names: the lowercase credential header names, in
-- the policy's order (cfg.cache.credential_headers). Returns NO_CREDENTIAL when none of
-- them is present, else the sha256 hex of every present one: its name, its count of
-- values and each value length-prefixed (all values count, in order, since the engine may
-- read any of them). Names hold no newline (policy-validated header names), so the input
-- parses back one way only: no two combinations of headers and values collide.
-- args: the request's query string ($args), which nginx forwards to the engine: an engine or
-- proxy may authenticate by it (`?api_key=`), so a non-empty one is part of the scope too
-- (as `?` + length-prefixed text: `?` is no header name, so it cannot pass for one).
function _M.credential(headers, names, args)
    local input
    for i = 1, #names do
        local name = names[i]
        -- rawget: names are lowercase already, so a miss skips ngx_lua's lowercasing __index
        local v = rawget(headers, name)
        if v ~= nil then
            local part
            if type(v) == "table" then
                part = name .. "\n" .. #v .. "\n"
                for j = 1, #v do
                    local s = tostring(v[j])
                    part = part .. #s .. ":" .. s
                end
            else
                part = name .. "\n1\n" .. #v .. ":" .. v
            end
            -- no table for the common case of one or two headers sent once
            input = input and input .. part or part
        end
    end
    if args and args ~= "" then
        local part = "?\n" .. #args .. ":" .. args
        input = input and input .. part or part
    end
    if not input then
        return _M.NO_CREDENTIAL
    end
    return hash.sha256_hex(input)
end

local is_array = json.is_array

local function number(v)
    if v ~= v or v == huge or v == -huge then
        return "z"
    end
    if floor(v) == v and v > -2 ^ 53 and v < 2 ^ 53 then
        return format("n%d;", v)
    end
    return format("n%.17g;", v)
end

-- put_form(v, b): appends v's digest form to the string.buffer b. Every value is
-- self-delimiting, so the form is injective (request data cannot forge structure):
--   string  "s" <byte length> ":" <bytes>        number "n" <%d or %.17g> ";"
--   true "t", false "f", null (and anything else) "z"
--   array   "a" <count> ":" <elements>           object "o" <count> ":" (<key string> <value>)*
-- with object keys sorted (byte order) at every level; `{}` and `[]` are one value, as in
-- json.canonical (cjson decodes both to an empty table).
-- A buffer, not a joined string: the material of every cacheable request has the same
-- length and the same bytes where LuaJIT's string hash samples (start, end, middle,
-- quarter) when requests differ only in, say, the seed, so interning it walked a chain of
-- equal-hash strings with a memcmp each (~10 % of a worker's CPU on the 2 KB miss path).
local function put_form(v, b)
    local t = type(v)
    if t == "string" then
        b:put("s", #v, ":", v)
    elseif t == "number" then
        b:put(number(v))
    elseif t == "boolean" then
        b:put(v and "t" or "f")
    elseif t == "table" then
        if is_array(v) then
            local count = #v
            b:put("a", count, ":")
            for i = 1, count do
                put_form(v[i], b)
            end
            return
        end
        local keys, count = {}, 0
        for k in pairs(v) do
            count = count + 1
            keys[count] = tostring(k)
        end
        sort(keys)
        b:put("o", count, ":")
        for i = 1, count do
            local k = keys[i]
            b:put("s", #k, ":", k)
            local val = v[k]
            if val == nil then
                val = v[tonumber(k)]
            end
            put_form(val, b)
        end
    else
        b:put("z")
    end
end

-- one buffer per worker, reset for each form: nothing between reset and use yields
local form_buf = buffer.new(4096)

--- digest_form(v) -> the digest form of v (see above): canonical, injective, for hashing only
function _M.digest_form(v)
    local b = form_buf:reset()
    put_form(v, b)
    return b:tostring()
end

-- material_buf(...) -> the per-worker buffer holding the material's digest form
local function material_buf(req, endpoint, tenant, version, cred)
    local filtered = {}
    for k, v in pairs(req) do
        if not _M.EXCLUDED[k] then
            filtered[k] = v
        end
    end
    local b = form_buf:reset()
    put_form({ endpoint = endpoint, tenant = tenant, v = version, cred = cred or _M.NO_CREDENTIAL,
               req = filtered }, b)
    return b
end

--- material(req, endpoint, tenant, version, cred) -> canonical string that is hashed
-- cred: credential()'s digest (NO_CREDENTIAL when nil)
function _M.material(req, endpoint, tenant, version, cred)
    return material_buf(req, endpoint, tenant, version, cred):tostring()
end

--- key(req, endpoint, tenant, version, cred) -> "kvgate:resp:v<N>:<tenant>:<sha256hex>" or nil, err
-- cred: credential()'s digest of the caller's credential (NO_CREDENTIAL when nil)
function _M.key(req, endpoint, tenant, version, cred)
    -- the digest of material() read from the buffer: the material never becomes a Lua string
    local b = material_buf(req, endpoint, tenant, version, cred)
    local ptr, len = b:ref()
    local h, err = hash.sha256_hex_ptr(ptr, len)
    b:reset()
    if not h then
        return nil, err
    end
    return keys.resp(version, escape_scope(tenant), h)
end

local function has_directive(cache_control, directive)
    if type(cache_control) == "table" then
        for i = 1, #cache_control do
            if has_directive(cache_control[i], directive) then
                return true
            end
        end
        return false
    end
    return type(cache_control) == "string" and find(lower(cache_control), directive, 1, true) ~= nil
end

--- revalidate(cache_control) -> true when the client asked for a fresh answer
-- (`Cache-Control: no-cache`, RFC 9111 §5.2.1.4): the cache is not read, but the new
-- answer is stored for the next client.
function _M.revalidate(cache_control)
    return has_directive(cache_control, "no-cache")
end

--- cacheable(req, endpoint, cache_control) -> true | false, reason
-- Deterministic requests only: temperature == 0 or a seed (an embedding always is); text
-- only; no `Cache-Control: no-store`. cache_control: nil, a string, or a list of strings (one
-- per Cache-Control header, as ngx.req.get_headers() gives repeated headers).
function _M.cacheable(req, endpoint, cache_control)
    if has_directive(cache_control, "no-store") then
        return false, "no-store"
    end
    if endpoint == "embeddings" then
        -- an embedding is a function of its input (no sampling): always deterministic
        return true
    end
    local seed = req.seed
    local seeded = type(seed) == "number"
    if not (req.temperature == 0 or seeded) then
        return false, "not-deterministic"
    end
    -- JSON numbers decode to doubles: seeds past 2^53 collide (2^53 and 2^53+1 hash
    -- alike) although a sampling engine tells them apart, so such a seed cannot key a
    -- cache (greedy decoding at temperature 0 ignores the seed).
    if seeded and req.temperature ~= 0 and (seed >= MAX_EXACT_INT or seed <= -MAX_EXACT_INT or seed % 1 ~= 0) then
        return false, "seed-imprecise"
    end
    if endpoint == "chat" and type(req.messages) == "table" then
        for i = 1, #req.messages do
            local m = req.messages[i]
            if type(m) == "table" and prompt.has_non_text(m.content) then
                return false, "non-text"
            end
        end
    end
    return true
end

return _M
