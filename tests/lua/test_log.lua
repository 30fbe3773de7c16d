-- kvgate.log.warn_every: one warning per key and interval across workers (the shared dict)
local H = dofile("tests/lua/helper.lua")

local store, lines, now = {}, {}, 0
local dict = {}
function dict:add(k, v, ttl)
    local e = store[k]
    if e and e.exp > now then
        return false, "exists"
    end
    store[k] = { v = v, exp = now + ttl }
    return true
end
_G.ngx = { shared = { kvgate_state = dict }, WARN = 5,
    log = function(_, ...) lines[#lines + 1] = table.concat({ ... }) end }
local log = require "kvgate.log"

H.test("one warning per key per interval", function()
    H.eq(log.warn_every("a", 10, "first ", 1), true)
    H.eq(log.warn_every("a", 10, "second"), false)
    H.eq(log.warn_every("b", 10, "other key"), true)
    H.eq(#lines, 2)
    H.eq(lines[1], "first 1")
    now = 11
    H.eq(log.warn_every("a", 10, "again"), true)
    H.eq(#lines, 3)
end)

H.test("without the dict every call logs", function()
    ngx.shared.kvgate_state = nil
    H.eq(log.warn_every("a", 10, "x"), true)
    H.eq(log.warn_every("a", 10, "x"), true)
end)

H.done()
