-- Helper of tests/unit/test_ring.py (not a test itself): maps keys through the chash balancer.
-- luajit tests/lua/ring_map.lua SPEC.json, SPEC = {"nodes": [[id, weight], ...],
-- "down": [id, ...], "keys": "path, one key a line"}; prints "point home route" per key
-- (route: the first node of the key's walk that is not down; "None", as Python prints it, when
-- none is left).
package.path = "./lua/?.lua;" .. package.path
local cjson = require "cjson.safe"
local ring = require "kvgate.balancer.ring"
-- through the balancer as it runs (kvgate.balancer.chash built from a pool of kvgate.json and
-- a runtime: weight 0 = down), with stand-ins for what it needs of ngx
_G.ngx = { shared = {}, ctx = {}, var = {}, crc32_long = ring.crc32, log = function() end }
package.loaded["ngx.balancer"] = {}
local chash = require "kvgate.balancer.chash"

local f = assert(io.open(arg[1], "rb"))
local spec = assert(cjson.decode(f:read("*a")))
f:close()
local down = {}
for _, id in ipairs(spec.down) do
    down[id] = true
end
local pool = { name = "p", nodes = {} }
local prt = { balancer = "chash", nodes = {} }
for i, n in ipairs(spec.nodes) do
    pool.nodes[i] = { id = n[1], address = "127.0.0.1:" .. (9000 + i) }
    -- a down node's ring weight is chash.DOWN_WEIGHT whatever the spec says (the oracle's too)
    prt.nodes[n[1]] = { weight = down[n[1]] and 0 or n[2], state = down[n[1]] and "down" or "active" }
end
local b = assert(chash.new(pool, prt))
local st = {}
local out = {}
for key in io.lines(spec.keys) do
    local point = ring.crc32(key)
    st.point = point
    local node, home = chash.pick(b, st, nil)
    out[#out + 1] = string.format("%d %s %s", point, home.id, node and node.id or "None")
    if #out == 10000 then
        io.write(table.concat(out, "\n"), "\n")
        out = {}
    end
end
if #out > 0 then
    io.write(table.concat(out, "\n"), "\n")
end
