-- kvgate.balancer.prefix: longest match among the eligible nodes, ties and no match on the ring,
-- the load bound on a hot prefix, failover as chash's; against stand-ins for ngx (ctx, shared
-- dicts, now, exit) and ngx.balancer. The real nginx runs tests/integration/test_gateway_prefix.py.
local H = dofile("tests/lua/helper.lua")
local ring = require "kvgate.balancer.ring"

local now = 1000
local function new_dict()
    local store = {}
    local d = {}
    local function live(k)
        local e = store[k]
        if e and e.exp and e.exp <= now then
            store[k] = nil
            return nil
        end
        return e
    end
    function d.get(_, k)
        local e = live(k)
        return e and e.v
    end
    function d.set(_, k, v, ttl)
        store[k] = { v = v, exp = ttl and ttl > 0 and now + ttl or nil }
        return true
    end
    function d.delete(_, k)
        store[k] = nil
    end
    function d.incr(self, k, v, init, init_ttl)
        local e = live(k)
        if not e then
            if init == nil then
                return nil, "not found"
            end
            self:set(k, init + v, init_ttl)
            return init + v
        end
        e.v = e.v + v
        return e.v
    end
    function d.reset()
        store = {}
    end
    return d
end
local state, inflight_dict, prefix_dict, load_dict = new_dict(), new_dict(), new_dict(), new_dict()
_G.ngx = {
    var = {}, ctx = {},
    shared = { kvgate_state = state, kvgate_inflight = inflight_dict, kvgate_prefix = prefix_dict,
               kvgate_load = load_dict, kvgate_metrics = new_dict() },
    crc32_long = ring.crc32, now = function() return now end,
    log = function() end, WARN = 4, ERR = 3,
    exit = function(code) return "exit", code end,
}
local B = { peer = nil, failure = nil }
package.loaded["ngx.balancer"] = {
    set_current_peer = function(host, port)
        B.peer = port and (host .. ":" .. port) or host
        return true
    end,
    set_more_tries = function() return true end,
    get_last_failure = function() return B.failure end,
}
local prefix = require "kvgate.balancer.prefix"
local chash = require "kvgate.balancer.chash"
local inflight = require "kvgate.inflight"
local load = require "kvgate.balancer.load"
local cjson = require "cjson.safe"

local CHUNK = 256
local function pool(n)
    local nodes, prt = {}, { nodes = {} }
    for i = 1, n do
        local id = string.char(96 + i)
        nodes[i] = { id = id, address = "127.0.0.1:" .. (9000 + i) }
        prt.nodes[id] = { weight = 100, state = "active" }
    end
    return { name = "p", nodes = nodes, prefix_chars = 2048,
             prefix_index = { chunk_chars = CHUNK, capacity_chars = 1e9, ttl_s = 600, max_chars = 1e6 } }, prt
end

local function id_of(peer)
    return string.char(96 + tonumber(peer:match(":(%d+)$")) - 9000)
end

local function words(seed, n)
    local parts, len, i = {}, 0, 0
    while len < n do
        i = i + 1
        local w = string.format("t%d_%d ", seed, i)
        parts[#parts + 1] = w
        len = len + #w
    end
    return table.concat(parts):sub(1, n)
end

local SYSTEM = words(0, 16 * CHUNK)

-- chat(user, turns) -> a chat request: the shared system prompt, then the user's text
local function chat(user, extra)
    local msgs = { { role = "system", content = SYSTEM }, { role = "user", content = user } }
    if extra then
        msgs[3] = { role = "assistant", content = extra }
        msgs[4] = { role = "user", content = "and then?" }
    end
    return { model = "m", messages = msgs }
end

-- one request through the balancer: key/kind as the route stage leaves them; failures: the
-- retries' get_last_failure; -> ids tried, the request's kctx. The request has ended when this
-- returns (its load released, as the log phase does) unless `hold`.
local function request(b, req, key, kind, failures, hold)
    ngx.ctx = {}
    local kctx = require("kvgate.ctx").get()
    kctx.req.parsed, kctx.req.endpoint = req, "chat"
    kctx.req.body = cjson.encode(req)
    kctx.route.key, kctx.route.kind = key or "", kind or "prefix"
    kctx.route.fp = "fp-of-the-window"
    local out = {}
    for t = 1, 1 + #(failures or {}) do
        B.failure = t > 1 and failures[t - 1] or nil
        B.peer = nil
        if prefix.balance(b) == "exit" then
            out[#out + 1] = "busy"
            break
        end
        out[#out + 1] = id_of(B.peer)
    end
    if not hold then
        inflight.finish(kctx.log)
        load.finish(kctx.log)
    end
    return out, kctx
end

-- first turns that arrive together (each stays in flight until all are sent): the bound
-- spreads them; -> the node of each
local function burst(b, reqs)
    local ids, held = {}, {}
    for i, req in ipairs(reqs) do
        local got, kctx = request(b, req, "", "prefix", nil, true)
        ids[i], held[i] = got[1], kctx
    end
    for _, kctx in ipairs(held) do
        inflight.finish(kctx.log)
        load.finish(kctx.log)
    end
    return ids
end

local function reset()
    state.reset()
    inflight_dict.reset()
    prefix_dict.reset()
    load_dict.reset()
    now = 1000
end

H.test("a conversation's next turn goes to the node holding its previous turn, whatever the key", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local first = words(1, 6 * CHUNK)
    local n1 = request(b, chat(first), "", "prefix")[1]
    for i = 1, 5 do
        -- later turns, with a route key that would hash elsewhere
        local got = request(b, chat(first, words(100 + i, 3 * CHUNK)), "u:someone-" .. i, "prefix")[1]
        H.eq(got, n1, "turn " .. i + 1)
    end
end)

H.test("two conversations sharing a long system prompt each land by their own longest match", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    -- 40 first turns: the system prompt soon on every node (a tie), each conversation's own
    -- first chunk decides
    local firsts = {}
    for i = 1, 40 do
        firsts[i] = chat(words(200 + i, 4 * CHUNK))
    end
    local homes = burst(b, firsts)
    for i = 1, 40 do
        local got, kctx = request(b, chat(words(200 + i, 4 * CHUNK), words(300 + i, 2 * CHUNK)))
        H.eq(got[1], homes[i], "conversation " .. i)
        H.eq(kctx.balancer.depth, 16 + 4, "matched its system prompt and its first turn")
    end
    local seen = {}
    for i = 1, 40 do
        seen[homes[i]] = true
    end
    local n = 0
    for _ in pairs(seen) do
        n = n + 1
    end
    H.truthy(n >= 3, "new conversations spread over the nodes: " .. n)
end)

H.test("a session key breaks a tie on its ring point; a longer match elsewhere still wins", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    -- the system prompt on every node
    local firsts = {}
    for i = 1, 40 do
        firsts[i] = chat(words(400 + i, CHUNK))
    end
    burst(b, firsts)
    local want = chash.pick(b, { point = ngx.crc32_long("s:abc") })
    local got = request(b, chat(words(999, 2 * CHUNK)), "s:abc", "session")[1]
    H.eq(got, want.id, "tie at the system prompt -> the session key's node")
end)

H.test("hot prefix: every request shares one system prompt and one route key; the bound spreads them", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local work, hits, total = {}, 0, 0
    local flight = {} -- 16 requests in flight: each ends when the 16th after it starts
    for i = 1, 400 do
        local got, kctx = request(b, chat(words(500 + i, 2 * CHUNK)), "p:the-same-key", "prefix", nil, true)
        flight[#flight + 1] = kctx
        if #flight > 16 then
            load.finish(table.remove(flight, 1).log)
        end
        local id = got[1]
        local cost = (16 + 2 - kctx.balancer.depth) * CHUNK
        work[id] = (work[id] or 0) + cost
        total = total + cost
        if kctx.balancer.depth >= 16 then
            hits = hits + 1
        end
        now = now + 0.01
    end
    local mean = total / 4
    for _, id in ipairs({ "a", "b", "c", "d" }) do
        H.truthy((work[id] or 0) <= 1.3 * mean, id .. " computed " .. tostring(work[id]) .. " of mean " .. mean)
    end
    H.truthy(hits >= 396, "the shared prompt still hits after the first request per node: " .. hits)
end)

H.test("a longest match over its bound gives way to the next eligible node, counted as a spill", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local first = words(21, 6 * CHUNK)
    local home = request(b, chat(first))[1]
    -- 8 long requests in flight on the home, nothing elsewhere
    local node = b.by_id[home]
    load_dict:incr(node.load_key, 80000, 0)
    load_dict:incr(b.total_key, 80000, 0)
    local got, kctx = request(b, chat(first, words(22, CHUNK)))
    H.ne(got[1], home)
    H.eq(kctx.balancer.spill, "bound")
    H.eq(kctx.balancer.depth, 0, "the other nodes hold nothing of it")
    -- and its load went back when it ended
    H.eq(load_dict:get(b.by_id[got[1]].load_key), 0)
end)

H.test("sticky until saturated: the sole holder keeps the request up to STICKY_BOUND x its share", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local first = words(31, 12 * CHUNK)
    local home = request(b, chat(first))[1]
    local function put(id, tokens)
        load_dict:incr(b.by_id[id].load_key, tokens, 0)
        load_dict:incr(b.total_key, tokens, 0)
    end
    -- home at 2000 tokens in flight, the others at 1000: over 1.25 x its share (1,560), under 2.5 x
    for _, id in ipairs({ "a", "b", "c", "d" }) do
        put(id, id == home and 2000 or 1000)
    end
    local got, kctx = request(b, chat(first, words(32, CHUNK)))
    H.eq(got[1], home)
    H.eq(kctx.balancer.spill, nil)
    -- at 6000 (over 2.5 x its share of 9,000: 5,625): it gives way, counted
    put(home, 4000)
    got, kctx = request(b, chat(first, words(33, CHUNK)))
    H.ne(got[1], home)
    H.eq(kctx.balancer.spill, "bound")
end)

H.test("failover: the retry goes to the key's next node on the ring; the failed node is skipped after", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local first = words(7, 6 * CHUNK)
    local home = request(b, chat(first))[1]
    local got = request(b, chat(first, words(8, CHUNK)), "p:k", "prefix", { "failed" })
    H.eq(got[1], home)
    H.ne(got[2], home)
    -- the failed node is marked: the next turn goes elsewhere too
    local again = request(b, chat(first, words(9, CHUNK)), "p:k", "prefix")
    H.ne(again[1], home)
end)

H.test("no full chunk: chash's choice for the route key", function()
    reset()
    local b = assert(prefix.new(pool(4)))
    local want = chash.pick(b, { point = ngx.crc32_long("p:k") })
    local got = request(b, { model = "m", messages = { { role = "user", content = "hi" } } }, "p:k", "prefix")
    H.eq(got[1], want.id)
    -- the route stage left the prefix key unhashed (kind only): the fingerprint's key is used
    want = chash.pick(b, { point = ngx.crc32_long("p:fp-of-the-window") })
    got = request(b, { model = "m", messages = { { role = "user", content = "hi" } } }, "", "prefix")
    H.eq(got[1], want.id)
end)

H.test("held_tokens: what the index says a node holds of this request", function()
    reset()
    local b = assert(prefix.new(pool(2)))
    local first = words(11, 4 * CHUNK)
    local _, kctx = request(b, chat(first))
    local node = b.by_id[kctx.balancer.node]
    local st = {}
    prefix.start(b, st, { route = { kind = "prefix", key = "" }, req = { parsed = chat(first, words(12, CHUNK)),
                                                                         endpoint = "chat" } })
    H.eq(prefix.held_tokens(b, st, node), (16 + 4) * CHUNK / 4)
end)

H.test("a new runtime keeps the index and the node slots", function()
    reset()
    local p, prt = pool(3)
    local b = assert(prefix.new(p, prt))
    local first = words(13, 4 * CHUNK)
    local home = request(b, chat(first))[1]
    local b2 = assert(prefix.new(p, prt, b))
    H.eq(b2.index, b.index)
    H.eq(request(b2, chat(first, words(14, CHUNK)))[1], home)
end)

H.done()
