-- SHA-256 helpers shared by the route key and the cache key.
-- PURE (no ngx.*): nginx.sha256 is an FFI binding to libcrypto, which the nginx
-- binary already links; the plain-luajit tests load libcrypto globally first.
local sha256 = require "nginx.sha256"

local byte = string.byte
local format = string.format
local gsub = string.gsub

local _M = {}

local function hex_byte(c)
    return format("%02x", byte(c))
end

-- a sha256 digest in one format call: ~0.3 us against ~3 us for gsub with a callback
-- (which the JIT does not compile), paid by every route and cache key
local HEX32 = string.rep("%02x", 32)

--- to_hex(bin) -> lowercase hex string (nginx.string needs an nginx symbol, so not used here)
function _M.to_hex(bin)
    if #bin == 32 then
        return (format(HEX32, byte(bin, 1, 32)))
    end
    return (gsub(bin, ".", hex_byte))
end

local concat = table.concat

-- parts longer than this go to the digest as they are; shorter runs are joined first (an
-- update per part would cost more than the copy)
local BIG_PART = 8192

--- sha256_hex_parts(parts, n) -> sha256 hex of concat(parts, "", 1, n), or nil, err, without
-- building the whole string (a 40 KB prompt is not copied once more)
function _M.sha256_hex_parts(parts, n)
    local h = sha256:new()
    if not h then
        return nil, "sha256 unavailable"
    end
    local from = 1
    for i = 1, n do
        local p = parts[i]
        if #p > BIG_PART then
            if i > from then
                h:update(concat(parts, "", from, i - 1))
            end
            h:update(p)
            from = i + 1
        end
    end
    if n >= from then
        h:update(concat(parts, "", from, n))
    end
    return _M.to_hex(h:final())
end

--- sha256_hex(s) -> 64 hex chars, or nil, err
function _M.sha256_hex(s)
    local h = sha256:new()
    if not h then
        return nil, "sha256 unavailable"
    end
    h:update(s)
    return _M.to_hex(h:final())
end

return _M
