-- Helper of tests/unit/test_ring.py (not a test itself): maps keys on a Lua ring.
-- luajit tests/lua/ring_map.lua SPEC.json, SPEC = {"nodes": [[id, weight], ...],
-- "down": [id, ...], "keys": "path, one key a line"}; prints "point home route" per key
-- (route: the first node of the key's walk that is not down; "None", as Python prints it, when
-- none is left).
package.path = "./lua/?.lua;" .. package.path
local cjson = require "cjson.safe"
local ring = require "kvgate.balancer.ring"

local f = assert(io.open(arg[1], "rb"))
local spec = assert(cjson.decode(f:read("*a")))
f:close()
local down = {}
for _, id in ipairs(spec.down) do
    down[id] = true
end
local nodes = {}
for i, n in ipairs(spec.nodes) do
    nodes[i] = { id = n[1], weight = n[2], down = down[n[1]] }
end
local r = assert(ring.new(nodes))
local function skip(node)
    return node.down
end
local out = {}
for key in io.lines(spec.keys) do
    local point = ring.crc32(key)
    local node, home = ring.find(r, point, skip)
    out[#out + 1] = string.format("%d %s %s", point, home.id, node and node.id or "None")
    if #out == 10000 then
        io.write(table.concat(out, "\n"), "\n")
        out = {}
    end
end
if #out > 0 then
    io.write(table.concat(out, "\n"), "\n")
end
