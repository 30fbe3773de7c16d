-- reqlog.lua (the Redis commands of one flush) and inflight.lua (gauge values), with
-- stand-ins for the shared dicts and the Redis client.
local H = dofile("tests/lua/helper.lua")

local function fake_dict()
    local store = {}
    return {
        store = store,
        incr = function(_, k, v, init)
            store[k] = (store[k] or init) + v
            return store[k], nil, false
        end,
        get = function(_, k) return store[k] end,
        get_keys = function()
            local keys = {}
            for k in pairs(store) do keys[#keys + 1] = k end
            return keys
        end,
    }
end

local metrics_dict, inflight_dict = fake_dict(), fake_dict()
_G.ngx = { shared = { kvgate_metrics = metrics_dict, kvgate_inflight = inflight_dict },
           log = function() end, WARN = 4 }
package.loaded["kvgate.redis"] = {} -- nginx.redis needs the ngx API
local reqlog = require "kvgate.reqlog"
local inflight = require "kvgate.inflight"
local metrics = require "kvgate.metrics"

local FP1, FP2 = string.rep("a", 64), string.rep("b", 64)
local CFG = { pools = { p = { hot_window_s = 600, nodes = { { id = "n1" }, { id = "n2" } } } } }

local function entry(t)
    local e = { ts = 1800000000.25, pool = "p", node = "n1", status = 200, cache = "MISS", kind = "prefix",
                fp = FP1, key = "0123456789abcdef", ms = 12, point = 4294967295, tries = 2 }
    for k, v in pairs(t or {}) do e[k] = v end
    return e
end

H.test("one XADD per entry with every field, MAXLEN ~ 100000", function()
    local cmds, xadds = reqlog.commands({ entry(), entry({ fp = "", kind = "fallback", key = "" }) }, 2, CFG)
    H.eq(#xadds, 2)
    local c = cmds[xadds[1]]
    H.eq(table.concat(c, " ", 1, 6), "xadd kvgate:log MAXLEN ~ 100000 *")
    local f = {}
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.ts, "1800000000.250")
    H.eq(f.pool, "p")
    H.eq(f.node, "n1")
    H.eq(f.status, "200")
    H.eq(f.cache, "MISS")
    H.eq(f.kind, "prefix")
    H.eq(f.fp, FP1)
    H.eq(f.key, "0123456789abcdef")
    H.eq(f.ms, "12")
    H.eq(f.point, "4294967295") -- crc32 up to 2^32-1, written as an integer
    H.eq(f.tries, "2")
    local names = {}
    for i = 7, #c, 2 do names[#names + 1] = c[i] end
    H.eq(table.concat(names, " "), "ts pool node status cache kind fp key ms point tries home spill tenant " ..
        "key_id model prompt cached completion ttft batch blocks cost saved_cache saved_prefix saved_batch")
    H.eq(table.concat(names, " "), table.concat(require("kvgate.keys").LOG_FIELDS, " "), "keys.LOG_FIELDS order")
    H.eq(f.home, "", "no home: not balanced")
    f = {}
    c = reqlog.commands({ entry({ home = "n2" }) }, 1, CFG)[1]
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.home, "n2")
    f = {}
    c = reqlog.commands({ entry({ spill = "bound" }) }, 1, CFG)[1]
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.spill, "bound")
    c = cmds[xadds[1]]
    for _, v in ipairs(c) do H.eq(type(v), "string") end
    -- no key, no upstream (cache hit): point "" and tries 0
    c = reqlog.commands({ entry({ point = false, tries = 0, node = "cache", cache = "HIT" }) }, 1, CFG)[1]
    f = {}
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.point, "")
    H.eq(f.tries, "0")
    -- an entry spilled by a worker running the previous code has neither field
    local old = entry()
    old.point, old.tries = nil, nil
    c = reqlog.commands({ old }, 1, CFG)[1]
    f = {}
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.point, "")
    H.eq(f.tries, "")
    H.eq(#c, 6 + 2 * 26) -- every field of keys.LOG_FIELDS (home added in issue 10, spill in 11, tenant in 12,
    -- the usage record in 13)
    H.eq(f.prompt, "", "usage unknown")
    H.eq(f.cost, "")
    c = reqlog.commands({ entry({ key_id = "k1", model = "m", prompt = 1200, cached = 1024, completion = 7, ttft = 35,
                                  blocks = string.rep("0123456789abcdef", 2), cost = 123456789012, saved_cache = 0,
                                  saved_prefix = 5, saved_batch = 0 }) }, 1, CFG)[1]
    f = {}
    for i = 7, #c, 2 do f[c[i]] = c[i + 1] end
    H.eq(f.key_id, "k1")
    H.eq(f.model, "m")
    H.eq(f.prompt, "1200")
    H.eq(f.cached, "1024")
    H.eq(f.completion, "7")
    H.eq(f.ttft, "35")
    H.eq(f.batch, "")
    H.eq(f.blocks, string.rep("0123456789abcdef", 2))
    H.eq(f.cost, "123456789012", "n$ beyond 2^31 as an integer")
    H.eq(f.saved_cache, "0")
    H.eq(f.saved_prefix, "5")
end)

H.test("hot sets: counts summed per pool/minute/fp, one EXPIRE of hot_window_s + 120 per key", function()
    local batch = { entry(), entry(), entry({ fp = FP2 }), entry({ fp = "" }),
                    entry({ ts = 1800000000.25 + 60 }), entry({ pool = "other" }) }
    local cmds = reqlog.commands(batch, #batch, CFG)
    local minute = string.format("%d", math.floor(1800000000.25 / 60))
    local z, ex = {}, {}
    for _, c in ipairs(cmds) do
        if c[1] == "zincrby" then z[c[2] .. " " .. c[4]] = c[3] end
        if c[1] == "expire" then ex[#ex + 1] = c[2] .. " " .. c[3] end
    end
    H.eq(z["kvgate:hot:p:" .. minute .. " " .. FP1], "2")
    H.eq(z["kvgate:hot:p:" .. minute .. " " .. FP2], "1")
    H.eq(z["kvgate:hot:p:" .. (minute + 1) .. " " .. FP1], "1")
    H.eq(z["kvgate:hot:other:" .. minute .. " " .. FP1], "1")
    table.sort(ex)
    H.eq(#ex, 3)
    H.eq(ex[1], "kvgate:hot:other:" .. minute .. " 3720") -- pool not in the config: default window
    H.eq(ex[2], "kvgate:hot:p:" .. minute .. " 720")
end)

H.test("a captured prefix is one SET ... EX ttl NX; no capture, no SET", function()
    local cmds, _, sets = reqlog.commands({ entry({ cap = '{"model":"m"}', cap_ttl = 3600 }), entry() }, 2, CFG)
    H.eq(#sets, 1)
    H.eq(table.concat(cmds[sets[1]], " "), "set kvgate:prefix:p:" .. FP1 .. ' {"model":"m"} EX 3600 NX')
    local n = 0
    for _, c in ipairs(cmds) do if c[1] == "set" then n = n + 1 end end
    H.eq(n, 1)
end)

H.test("inflight: every configured node appears, 0 without traffic; removed nodes only while non-zero", function()
    local ctx = {}
    inflight.begin(ctx, "p", "n1")
    inflight.begin(ctx, "p", "n1") -- once per request
    local ctx2 = {}
    inflight.begin(ctx2, "p", "gone")
    local v = inflight.values(CFG, inflight_dict)
    H.eq(v['{node="n1",pool="p"}'], 1)
    H.eq(v['{node="n2",pool="p"}'], 0)
    H.eq(v['{node="gone",pool="p"}'], 1)
    inflight.finish(ctx)
    inflight.finish(ctx) -- only once
    inflight.finish(ctx2)
    inflight.finish({}) -- never counted: nothing to undo
    v = inflight.values(CFG, inflight_dict)
    H.eq(v['{node="n1",pool="p"}'], 0)
    H.eq(v['{node="gone",pool="p"}'], nil)
    for _, x in pairs(inflight_dict.store) do H.eq(x, 0) end
end)

H.test("the gauge renders with # TYPE gauge, once per series", function()
    local ctx = {}
    inflight.begin(ctx, "p", "n2")
    local text = metrics.render({ [inflight.NAME] = inflight.lines(CFG, inflight_dict) })
    H.truthy(text:find("# TYPE kvgate_upstream_inflight gauge\n", 1, true), text)
    H.truthy(text:find('\nkvgate_upstream_inflight{node="n1",pool="p"} 0\n', 1, true), text)
    H.truthy(text:find('\nkvgate_upstream_inflight{node="n2",pool="p"} 1\n', 1, true), text)
    local _, count = text:gsub("\nkvgate_upstream_inflight{", "")
    H.eq(count, 2)
    inflight.finish(ctx)
    -- the new counter families are declared even before they count anything
    for _, f in ipairs({ "kvgate_request_log_written_total", "kvgate_request_log_dropped_total",
                         "kvgate_stream_errors_total", "kvgate_prefix_capture_skipped_total",
                         "kvgate_prefix_captures_total" }) do
        H.truthy(text:find("# TYPE " .. f .. " counter\n", 1, true), f)
    end
end)

H.test("the flush's wire-format XADDs are exactly the command tables in RESP", function()
    local batch = { entry(), entry({ fp = "", kind = "fallback", key = "", point = false, tries = 0 }),
                    entry({ home = "n2", node = "", status = 502 }),
                    entry({ key_id = "k", model = "m", prompt = 10, cached = 0, completion = 3, ttft = 4, batch = "",
                            blocks = "00ff00ff00ff00ff", cost = 99, saved_cache = 0, saved_prefix = 0,
                            saved_batch = 0 }) }
    local tables, tx = reqlog.commands(batch, #batch, CFG)
    local wire, wx = reqlog.commands(batch, #batch, CFG, true)
    H.eq(#wire, #tables)
    for i = 1, #tx do
        H.eq(wx[i], tx[i])
        H.eq(type(wire[wx[i]]), "string")
        H.eq(wire[wx[i]], reqlog.resp(tables[tx[i]]))
    end
    H.eq(reqlog.resp({ "set", "k", "vv" }), "*3\r\n$3\r\nset\r\n$1\r\nk\r\n$2\r\nvv\r\n")
end)

H.done()
