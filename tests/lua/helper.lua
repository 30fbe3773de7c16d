-- Minimal harness for the pure kvgate modules under plain luajit (no nginx).
-- Run from the repo root: luajit tests/lua/test_x.lua
-- nginx.sha256 resolves SHA256_* through ffi.C; nginx links libcrypto, plain
-- luajit does not, so load it globally first.
local ffi = require "ffi"
local ok = pcall(ffi.load, "libcrypto.so.3", true)
if not ok then
    pcall(ffi.load, "crypto", true)
end
package.path = "./lua/?.lua;" .. package.path

local H = { passed = 0, failed = 0 }

function H.test(name, fn)
    local ok, err = pcall(fn)
    if ok then
        H.passed = H.passed + 1
    else
        H.failed = H.failed + 1
        io.stderr:write("FAIL ", name, ": ", tostring(err), "\n")
    end
end

function H.eq(a, b, msg)
    if a ~= b then
        error((msg or "values differ") .. ": " .. tostring(a) .. " ~= " .. tostring(b), 2)
    end
end

function H.ne(a, b, msg)
    if a == b then
        error((msg or "values are equal") .. ": " .. tostring(a), 2)
    end
end

function H.truthy(v, msg)
    if not v then
        error(msg or "expected a true value", 2)
    end
end

function H.done()
    print(string.format("%d passed, %d failed", H.passed, H.failed))
    os.exit(H.failed == 0 and 0 or 1)
end

return H
