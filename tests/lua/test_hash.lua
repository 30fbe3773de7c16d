-- kvgate.hash: sha256 hex against known answers (FIPS 180-2 vectors), for the 32-byte
-- fast path of to_hex and the generic one.
local H = dofile("tests/lua/helper.lua")
local hash = require "kvgate.hash"

H.test("sha256_hex gives the standard digests", function()
    H.eq(hash.sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    H.eq(hash.sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    H.eq(hash.sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")
end)

H.test("to_hex: lowercase, two digits a byte, any length", function()
    H.eq(hash.to_hex(""), "")
    H.eq(hash.to_hex("\0\15\255"), "000fff")
    local all = {}
    for i = 0, 255 do
        all[#all + 1] = string.char(i)
    end
    local s = table.concat(all)
    local hex = hash.to_hex(s)
    H.eq(#hex, 512)
    H.eq(hex:sub(1, 8), "00010203")
    H.eq(hex:sub(-4), "feff")
    -- 32 bytes (a digest) takes the fast path: the same answer as byte by byte
    local d = s:sub(200, 231)
    H.eq(hash.to_hex(d), hash.to_hex(d .. "x"):sub(1, 64))
end)

H.done()
