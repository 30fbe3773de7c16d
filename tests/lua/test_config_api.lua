-- config_api.authorized: the internal listener's push secret check (the handler itself runs
-- against nginx in tests/integration/test_gateway_dynamic.py).
local H = dofile("tests/lua/helper.lua")
_G.ngx = { var = {}, ctx = {}, shared = {}, print = function() end, exit = function() end,
           log = function() end, header = {}, req = {} }
package.loaded["ngx.balancer"] = {}
local hash = require "kvgate.hash"
local api = require "kvgate.config_api"

local SECRET = "s3cret-token"
local CFG = { internal = { push_secret_sha256 = hash.sha256_hex(SECRET) } }

H.test("the right bearer secret passes", function()
    H.eq(api.authorized(CFG, "Bearer " .. SECRET), true)
    H.eq(api.authorized(CFG, "bearer  " .. SECRET .. " "), true)
end)

H.test("a missing, wrong or non-bearer secret is 401", function()
    for _, h in ipairs({ false, "", "Bearer", "Bearer wrong", "Bearer " .. SECRET .. "x", SECRET,
                         "Basic " .. SECRET, "Bearer " .. hash.sha256_hex(SECRET) }) do
        local ok, status, msg = api.authorized(CFG, h or nil)
        H.eq(ok, nil, tostring(h))
        H.eq(status, 401, tostring(h))
        H.truthy(not msg:find(SECRET, 1, true), "the message never echoes a secret")
    end
end)

H.test("no push secret configured: every call is refused with 403, saying why", function()
    for _, cfg in ipairs({ {}, { internal = {} }, { internal = { push_secret_sha256 = "" } } }) do
        local ok, status, msg, code = api.authorized(cfg, "Bearer " .. SECRET)
        H.eq(ok, nil)
        H.eq(status, 403)
        H.eq(code, "push_disabled")
        H.truthy(msg:find("push_secret_sha256", 1, true), msg)
    end
end)

H.done()
