-- balancer/chash.lua against stand-ins for ngx (var, ctx, a shared dict, exit) and
-- ngx.balancer (records the peer set); the real thing runs in tests/integration.
local H = dofile("tests/lua/helper.lua")
local ring = require "kvgate.balancer.ring"

local now = 0
local store = {}
local dict = {
    get = function(_, k)
        local e = store[k]
        if e and (not e.exp or e.exp > now) then
            return e.v
        end
        return nil
    end,
    add = function(self, k, v, ttl)
        if self:get(k) ~= nil then
            return false, "exists"
        end
        return self:set(k, v, ttl)
    end,
    delete = function(_, k)
        store[k] = nil
    end,
    set = function(_, k, v, ttl)
        store[k] = { v = v, exp = ttl and ttl > 0 and now + ttl or nil }
        return true
    end,
    incr = function(self, k, v, init)
        local cur = self:get(k)
        if cur == nil then
            cur = init
        end
        store[k] = { v = cur + v }
        return cur + v
    end,
}
local var = {}
_G.ngx = {
    var = var, ctx = {}, shared = { kvgate_state = dict },
    crc32_long = ring.crc32,
    log = function() end, WARN = 4, ERR = 3,
    now = function() return now end,
    exit = function(code) return "exit", code end,
}
local B = { peer = nil, more = nil, failure = nil }
package.loaded["ngx.balancer"] = {
    set_current_peer = function(host, port)
        B.peer = port and (host .. ":" .. port) or host
        return true
    end,
    set_more_tries = function(n)
        B.more = n
        return true
    end,
    get_last_failure = function()
        return B.failure
    end,
}
local chash = require "kvgate.balancer.chash"
local peers = require "kvgate.balancer.peers"

local POOL = {
    name = "p",
    nodes = {
        { id = "n1", address = "localhost:9001", peer = "127.0.0.1:9001", weight = 100 },
        { id = "n2", address = "127.0.0.1:9002", peer = "127.0.0.1:9002", weight = 300 },
        { id = "n3", address = "unix:/run/n3.sock", weight = 100 },
        { id = "n4", address = "[::1]:9004", peer = "[::1]:9004", weight = 0 },
    },
}
local ADDR = { n1 = "127.0.0.1:9001", n2 = "127.0.0.1:9002", n3 = "unix:/run/n3.sock", n4 = "[::1]:9004" }
local ID = {}
for id, a in pairs(ADDR) do
    ID[a] = id
end

-- one request: the first try, then (failure = "failed"/"next") a retry; -> ids tried
local function request(b, key, failures)
    ngx.ctx = {}
    -- where the route stage leaves it
    require("kvgate.ctx").get().route.key = key
    local out = {}
    for t = 1, 1 + #(failures or {}) do
        B.failure = t > 1 and failures[t - 1] or nil
        B.peer = nil
        local r = chash.balance(b)
        if r == "exit" then
            out[#out + 1] = "busy"
            break
        end
        out[#out + 1] = ID[B.peer] or B.peer
    end
    return out
end

local function reset()
    store = {}
    now = 0
end

H.test("peers parse: IP:PORT, [IPv6]:PORT, unix:PATH; bad ones are errors", function()
    H.eq(select(2, chash.parse_peer("127.0.0.1:80")), 80)
    H.eq(chash.parse_peer("[::1]:8000"), "[::1]")
    local host, port = chash.parse_peer("unix:/run/x.sock")
    H.eq(host, "unix:/run/x.sock")
    H.eq(port, nil)
    H.eq(chash.parse_peer("127.0.0.1"), nil)
    H.eq(chash.parse_peer("unix:"), nil)
    H.eq(chash.parse_peer("h:99999"), nil)
    -- a host name would fail every request at run time (set_current_peer resolves nothing)
    local none, why = chash.parse_peer("gpu1.internal:8000")
    H.eq(none, nil)
    H.truthy(why:find("IP address", 1, true), why)
    H.eq(chash.parse_peer("localhost:8000"), nil)
    local b, err = chash.new({ name = "x", nodes = { { id = "a", address = "nope", weight = 1 } } })
    H.eq(b, nil)
    H.truthy(err:find("node a", 1, true))
end)

H.test("a key goes to its home; a down node is skipped, its keys go to the next node", function()
    reset()
    local b = assert(chash.new(POOL))
    local homes = {}
    for i = 1, 400 do
        local key = "s:k" .. i
        local home = ring.home(b.ring, ring.crc32(key)).id
        local got = request(b, key)[1]
        homes[home] = (homes[home] or 0) + 1
        H.ne(got, "n4", key)
        if home ~= "n4" then
            H.eq(got, home, key)
        end
        H.eq(ngx.ctx.kvgate.balancer.home, home)
        -- nginx's own tries (servers not down, capped by proxy_next_upstream_tries): none asked for
        H.eq(B.more, nil)
    end
    H.truthy(homes.n4 and homes.n4 > 0, "down n4 keeps points")
    H.truthy(homes.n2 > homes.n1 * 2, "weights")
end)

H.test("a failed try marks the node; the retry goes to the next node; then it is skipped", function()
    reset()
    local b = assert(chash.new(POOL))
    local key
    for i = 1, 400 do
        key = "s:f" .. i
        if ring.home(b.ring, ring.crc32(key)).id == "n2" then
            break
        end
    end
    local walk = ring.walk(b.ring, ring.crc32(key))
    local nxt
    for _, n in ipairs(walk) do
        if n.id ~= "n2" and not n.down then
            nxt = n.id
            break
        end
    end
    local tried = request(b, key, { "failed" })
    H.eq(tried[1], "n2")
    H.eq(tried[2], nxt)
    -- its breaker is open for FAIL_TIMEOUT_S (one failure: the default policy's, nginx's
    -- max_fails=1): the next request goes straight to the next node
    H.eq(request(b, key)[1], nxt)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), chash.FAIL_TIMEOUT_S)
    -- another worker (its own instance) sees the mark at its next refresh
    local other = assert(chash.new(POOL))
    H.eq(request(other, key)[1], "n2")
    chash.refresh(other)
    H.eq(request(other, key)[1], nxt)
    -- the open time passes: after the refresh the node is half-open, the next request (any
    -- key) is its one trial; the trial's answer closes the breaker
    now = chash.FAIL_TIMEOUT_S + 1
    H.eq(request(b, key)[1], nxt)
    chash.refresh(b)
    H.eq(b.by_id.n2.half, true)
    H.eq(request(b, "s:another")[1], "n2")
    H.eq(ngx.ctx.kvgate.balancer.trial, "n2")
    H.eq(request(b, key)[1], nxt, "one trial at a time")
    peers.answered(b, "n2", 200)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), nil)
    H.eq(request(b, key)[1], "n2")
    -- a new config (reload) forgets the marks
    chash.mark_failed(b, b.nodes[2])
    H.eq(request(b, key)[1], nxt)
    chash.forget(b)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), nil)
    H.eq(request(b, key)[1], "n2")
    -- "next" (a 403/404 passed on) is not a failure
    tried = request(b, key, { "next" })
    H.eq(tried[2], nxt)
    H.eq(request(b, key)[1], "n2")
end)

H.test("every node failed: they are tried again; every node down: busy (502)", function()
    reset()
    local b = assert(chash.new(POOL))
    for _, id in ipairs({ "n1", "n2", "n3" }) do
        dict:set(chash.FAIL_PREFIX .. "p:" .. id, now + 10)
    end
    chash.refresh(b)
    H.truthy(b.nodes[1].failed and b.nodes[2].failed and b.nodes[3].failed)
    local got = request(b, "s:any")[1]
    H.truthy(got == "n1" or got == "n2" or got == "n3")
    local down = assert(chash.new({ name = "d", nodes = {
        { id = "a", address = "127.0.0.1:1", weight = 0 }, { id = "b", address = "127.0.0.1:2", weight = 0 } } }))
    H.eq(request(down, "s:any")[1], "busy")
    -- one node: no retry to ask for; its failed retry has no node left
    local one = assert(chash.new({ name = "o", nodes = { { id = "a", address = "127.0.0.1:1", weight = 100 } } }))
    local tried = request(one, "s:any", { "failed" })
    H.eq(tried[2], "busy")
end)

H.test("an empty key, failover.keyless round_robin: smooth weighted round robin over the nodes up", function()
    reset()
    local pool = { name = POOL.name, nodes = POOL.nodes, failover = { keyless = "round_robin" } }
    local b = assert(chash.new(pool))
    local counts = {}
    for _ = 1, 50 do
        local got = request(b, "")[1]
        counts[got] = (counts[got] or 0) + 1
    end
    H.eq(counts.n1, 10)
    H.eq(counts.n2, 30)
    H.eq(counts.n3, 10)
    H.eq(counts.n4, nil)
    H.eq(ngx.ctx.kvgate.balancer.point, nil)
    -- the retry goes to another node
    local tried = request(b, "", { "failed" })
    H.ne(tried[1], tried[2])
end)

H.test("an empty key (failover.keyless p2c, the default): the better of two by load score", function()
    reset()
    local b = assert(chash.new(POOL))
    -- n2 answers slowly (its EWMA header time), n1 and n3 fast; no engine reports (the
    -- gateway's in-flight counts, none here)
    b.by_id.n1.lat, b.by_id.n2.lat, b.by_id.n3.lat = 0.05, 2.0, 0.05
    local counts = {}
    for _ = 1, 200 do
        local got = request(b, "")[1]
        counts[got] = (counts[got] or 0) + 1
    end
    H.eq(counts.n4, nil)
    -- n2 is drawn often (weight 300 of 500) but loses every comparison with another node
    H.eq(counts.n2, nil)
    H.truthy(counts.n1 > 50 and counts.n3 > 50, "n1 and n3 share")
    -- the retry goes to another node
    local tried = request(b, "", { "failed" })
    H.ne(tried[1], tried[2])
end)

H.test("breaker: N failures in a row open it; a failed trial opens it twice as long", function()
    reset()
    local pool = { name = POOL.name, nodes = POOL.nodes,
                   failover = { breaker_failures = 3, breaker_open_s = 5, breaker_open_max_s = 12 } }
    local b = assert(chash.new(pool))
    local n2 = b.by_id.n2
    H.eq(peers.mark_failed(b, n2), 0)
    peers.answered(b, "n2", 200) -- a success restarts the count
    H.eq(peers.mark_failed(b, n2), 0)
    H.eq(peers.mark_failed(b, n2), 0)
    peers.answered(b, "n2", 503) -- a counted status: the third in a row
    H.eq(n2.failed, true)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), 5)
    -- failures of requests in flight when it opened change nothing
    H.eq(peers.mark_failed(b, n2), 1)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), 5)
    -- half-open; the trial fails: open for 10 s, then 12 (the max)
    now = 6
    chash.refresh(b)
    H.eq(n2.half, true)
    peers.mark_failed(b, n2)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), 16)
    now = 17
    chash.refresh(b)
    peers.mark_failed(b, n2)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), 29)
    -- a 4xx is an answer: it closes a half-open breaker
    now = 30
    chash.refresh(b)
    peers.answered(b, "n2", 404)
    H.eq(n2.failed, false)
    H.eq(dict:get(chash.FAIL_PREFIX .. "p:n2"), nil)
end)

H.done()
