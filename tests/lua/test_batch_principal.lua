-- kvgate.batch_principal: the X-Kvgate-Batch header's parse and check (HMAC-SHA1 from libcrypto,
-- as ngx.hmac_sha1 computes it). Expected macs: Python's hmac.new(secret, msg, sha1).hexdigest().
local H = dofile("tests/lua/helper.lua")
local bp = require "kvgate.batch_principal"
local ffi = require "ffi"

ffi.cdef [[
typedef struct evp_md_st EVP_MD;
const EVP_MD *EVP_sha1(void);
unsigned char *HMAC(const EVP_MD *evp_md, const void *key, int key_len, const unsigned char *d, size_t n,
                    unsigned char *md, unsigned int *md_len);
]]

local function hmac_sha1(key, text)
    local md = ffi.new("unsigned char[20]")
    local len = ffi.new("unsigned int[1]")
    ffi.C.HMAC(ffi.C.EVP_sha1(), key, #key, text, #text, md, len)
    return ffi.string(md, len[0])
end

local SECRET = "s3cret"
local SIGNED = "v1.batch_0123456789abcdef01234567.7.t1.2000000000"
-- python3 -c 'import hmac,hashlib;print(hmac.new(b"s3cret",b"v1.batch_0123456789abcdef01234567.7.t1.2000000000",hashlib.sha1).hexdigest())'
local MAC = "c5741172e949219d0fac6622490b04d53cc2d7af"
local VALUE = SIGNED .. "." .. MAC

H.test("a valid header gives its batch, line and tenant", function()
    local p, why = bp.verify(VALUE, SECRET, 1999999999, hmac_sha1)
    H.truthy(p, why)
    H.eq(p.id, "batch_0123456789abcdef01234567")
    H.eq(p.line, 7)
    H.eq(p.tenant, "t1")
    H.eq(p.expires, 2000000000)
end)

H.test("upper-case hex is the same mac", function()
    H.truthy(bp.verify(SIGNED .. "." .. MAC:upper(), SECRET, 0, hmac_sha1))
end)

H.test("refusals say why", function()
    local _, why = bp.verify(VALUE, "", 0, hmac_sha1)
    H.eq(why, "disabled")
    _, why = bp.verify(VALUE, "other", 0, hmac_sha1)
    H.eq(why, "mac")
    _, why = bp.verify(VALUE, SECRET, 2000000001, hmac_sha1)
    H.eq(why, "expired")
    _, why = bp.verify(SIGNED:gsub("%.t1%.", ".t2.") .. "." .. MAC, SECRET, 0, hmac_sha1)
    H.eq(why, "mac")
end)

H.test("malformed headers", function()
    for _, v in ipairs({
        "", "v1", SIGNED, "v2" .. VALUE:sub(3), VALUE .. "0", VALUE:sub(1, -2),
        "v1.batch_x.a.t1.1." .. MAC, "v1.batch_x.1.T1.1." .. MAC, "v1.batch_x.1.t.1.1." .. MAC,
        "v1.file-x.1.t1.1." .. MAC, { VALUE, VALUE }, string.rep("a", 600),
    }) do
        local p, why = bp.verify(v, SECRET, 0, hmac_sha1)
        H.eq(p, nil, tostring(v))
        H.eq(why, "malformed", tostring(v))
    end
end)

H.test("the anonymous tenant (auth off) is an empty field", function()
    local signed = "v1.batch_ab.0..2000000000"
    local mac = bp.verify(signed .. "." .. string.rep("0", 40), SECRET, 0, hmac_sha1)
    H.eq(mac, nil)
    local p = bp.parse(signed .. "." .. string.rep("0", 40))
    H.eq(p.tenant, "")
end)

H.test("equal", function()
    H.truthy(bp.equal("abc", "abc"))
    H.truthy(not bp.equal("abc", "abd"))
    H.truthy(not bp.equal("abc", "ab"))
end)

H.done()
