-- The batch principal (issue 14; docs/gateway.md, The batch principal): the header the Batch
-- API's worker sends with each line it runs through the client listener, instead of a
-- tenant's API key. PURE (the HMAC function is passed in: ngx.hmac_sha1 in nginx).
--
--   X-Kvgate-Batch: v1.<batch_id>.<line>.<tenant>.<expires>.<mac>
--     batch_id  "batch_" + hex (kvgate.batch.records.new_batch_id)
--     line      0-based line index in the batch's input file (decimal)
--     tenant    the tenant id ("" with gateway.auth off): policy ids are [a-z0-9_-], no dot
--     expires   unix seconds after which the header is refused
--     mac       lowercase hex of HMAC-SHA1(secret, "v1.<batch_id>.<line>.<tenant>.<expires>")
--   secret = kvgate.batch.records.batch_secret(admin token), kvgate.json's `batch_secret`
--   ("": every batch header is refused).
--
-- verify() answers the principal or why not; the mac is compared in time independent of
-- where the strings differ, and the header's value is never logged nor echoed.
local bit = require "bit"

local type = type
local byte = string.byte
local match = string.match
local tonumber = tonumber
local bxor = bit.bxor
local bor = bit.bor
local format = string.format
local gsub = string.gsub

local _M = {}

_M.HEADER = "X-Kvgate-Batch"
_M.MAX_BYTES = 512          -- a real header is ~110 bytes
_M.MAC_HEX = 40             -- SHA-1: 20 bytes

-- a SHA-1 digest in one format call (gsub with a callback is ~10x slower: the JIT does not
-- compile it)
local HEX20 = string.rep("%02x", 20)

local function hex(s)
    if #s == 20 then
        return (format(HEX20, byte(s, 1, 20)))
    end
    return (gsub(s, ".", function(c)
        return format("%02x", byte(c))
    end))
end

--- equal(a, b) -> true when the strings a and b are equal; for equal lengths the time does not
-- depend on where they differ (a mac must not be guessable byte by byte)
function _M.equal(a, b)
    local n = #a
    if n ~= #b then
        return false
    end
    local diff = 0
    for i = 1, n do
        diff = bor(diff, bxor(byte(a, i), byte(b, i)))
    end
    return diff == 0
end

--- parse(value) -> {id, line, tenant, expires, signed, mac} | nil (malformed). value: the header
-- (a table when repeated: malformed)
function _M.parse(value)
    if type(value) ~= "string" or #value > _M.MAX_BYTES then
        return nil
    end
    -- captures in order of their opening parenthesis: the signed text first
    local signed, id, line, tenant, expires, mac =
        match(value, "^(v1%.(batch_%w+)%.(%d+)%.([a-z0-9_-]*)%.(%d+))%.(%x+)$")
    if not signed then
        return nil
    end
    if #line > 9 or #expires > 12 or #mac ~= _M.MAC_HEX then
        return nil
    end
    return { id = id, line = tonumber(line), tenant = tenant, expires = tonumber(expires), signed = signed,
             mac = mac }
end

--- verify(value, secret, now, hmac_sha1) -> principal | nil, why
-- value: the header; secret: kvgate.json's batch_secret ("" or nil: refused); now: unix seconds;
-- hmac_sha1(key, text) -> the raw 20-byte digest (ngx.hmac_sha1).
-- why: "disabled" (no secret), "malformed", "mac" (not signed with the secret), "expired".
-- The tenant's existence is the caller's (it knows gateway.auth and the tenants).
function _M.verify(value, secret, now, hmac_sha1)
    if type(secret) ~= "string" or secret == "" then
        return nil, "disabled"
    end
    local p = _M.parse(value)
    if not p then
        return nil, "malformed"
    end
    local want = hex(hmac_sha1(secret, p.signed))
    -- the header's hex may be upper case: compared lowercased
    if not _M.equal(want, (p.mac:lower())) then
        return nil, "mac"
    end
    if p.expires < now then
        return nil, "expired"
    end
    return p
end

return _M
