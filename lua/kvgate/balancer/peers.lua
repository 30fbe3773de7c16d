-- What the three balancers share: a pool's nodes as the runtime weighs them, the passive
-- failure marks (shared by every worker), nginx's smooth weighted round robin, and the
-- try logic of balancer_by_lua (tries, failover once, the in-flight count, kctx.balancer).
--
-- A balancer module (kvgate.balancer.chash, round_robin, least_conn) is
--   impl.NAME
--   impl.new(pool, prt, prev) -> instance | nil, err
--       pool: the pool of kvgate.json (name, nodes = {{id, address, peer}}); prt: the pool's
--       part of the runtime ({balancer, nodes = {[id] = {weight, state}}}; nil: the weights of
--       kvgate.json); prev: the instance it replaces (nil at first), for state worth keeping
--   impl.start(b, st, kctx)            first try of a request: read what pick needs (the key's
--                                      point: peers.start)
--   impl.pick(b, st, tried) -> node, home | nil
--       tried: node id -> true (nil on the first try); home: the key's home node (nil
--       without a route key)
-- and peers.balance(impl, b) runs one try with it.
--
-- The home ring: a key's *home* node (logged as `home` in the request log, the admin page's
-- affinity) is its node on a ring of the pool's node ids at their home weights (the
-- runtime's home_weight: the serving weight, which for a node not taking traffic is its
-- target weight), the same ketama construction as chash's routing ring. So a drain shows as
-- keys away from home and moves no other node's homes, whatever the balancer. Built once
-- per instance and kept across instances while no home weight changes: chash builds it with
-- the instance (in init or the sync timer, never in a request; in the steady state it is the
-- routing ring itself); round_robin/least_conn lazily at the pool's first keyed request (a
-- pool whose requests carry no key never builds it), then with each new instance
-- (prepare_home) once the previous one had it.
--
-- Failures: balancer_by_lua has no max_fails. A try that failed (error, timeout, 502, 503:
-- get_last_failure() = "failed") counts against its node's circuit breaker (kvgate.breaker,
-- shared by every worker in kvgate_state): failover.breaker_failures in a row open it for
-- breaker_open_s, then one trial request (half-open) closes it or opens it again for twice as
-- long (up to breaker_open_max_s). The defaults (1 failure, 10 s) are nginx's max_fails=1
-- fail_timeout=10s. Open and half-open nodes are skipped (node.failed) by every worker unless
-- every node is (then they are tried again, as nginx resets its fail counts when all peers
-- failed). A worker sees its own transitions at once and the others' within REFRESH_S
-- (refresh(), on a timer): a shared-dict read per request would cost more than the rest of
-- the balancer. The half-open trial is claimed at a request's first try (balance()).
--
-- Failover: a retry goes to the key's next eligible node on the ring (chash, chash_bounded:
-- the walk from the key's point skipping tried, down and open nodes; the same node for the
-- same key, its "second home"), only before any byte reached the client (nginx's
-- proxy_next_upstream), immediately: balancer_by_lua cannot sleep (no ngx.sleep, no timer
-- wait) and nginx has no delay between tries, so there is no backoff between two tries of one
-- request (they go to different nodes). The exponential backoff is the breaker's: a node that
-- keeps failing is tried again after 10, 20, 40 ... s (breaker_open_s doubled per failed
-- trial, at most breaker_open_max_s), by one request at a time.
-- Each retry counts in kvgate_upstream_failover_total{pool,node = the node left}.
--
-- Keyless requests (no route key) under chash: power of two choices by a load score
-- (p2c(): kvgate.score, the engines' queues, the measured header time, KV use) when the pool's
-- failover.keyless is "p2c" (the default); keyless(b, tried) is the same choice for the other
-- balancers' keyless branches.
--
-- Tries: nginx gives a request as many tries as its upstream has server lines (the round
-- robin init of ngx_http_lua_balancer_init_peer), capped by proxy_next_upstream_tries 2.
-- The server lines carry no weight or `down` any more (weights are runtime), so on the
-- first try of a pool with one node taking traffic the balancer takes the retry away
-- (set_more_tries(1 - servers)): that node's own 502/503 then reaches the client, as with
-- nginx's native balancers, instead of a retry with no node left ("no live upstreams").
local ngx_balancer = require "ngx.balancer"
local ring = require "kvgate.balancer.ring"
local kvctx = require "kvgate.ctx"
local inflight = require "kvgate.inflight"
local klog = require "kvgate.log"
local breaker = require "kvgate.breaker"
local score = require "kvgate.score"
local node_load = require "kvgate.node_load"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local shared = ngx.shared
local set_current_peer = ngx_balancer.set_current_peer
local set_more_tries = ngx_balancer.set_more_tries
local get_last_failure = ngx_balancer.get_last_failure
local take = inflight.take
local ipairs = ipairs
local type = type
local tonumber = tonumber
local tostring = tostring
local match = string.match
local sub = string.sub
local lower = string.lower
local concat = table.concat
local sort = table.sort
local ring_home = ring.home
local crc32_long = ngx.crc32_long
local random = math.random
local count = inflight.count
local get_load = node_load.get
local node_score = score.score
local failover_total = metrics.counter(keys.METRICS.upstream_failover, { "pool", "node" })

local _M = {}

-- now() -> ngx.now() (0 where there is none: the luajit stand-ins)
local function now()
    local f = ngx.now
    return f and f() or 0
end

-- the breaker's open time with the default policy (kvgate.breaker.DEFAULTS)
_M.FAIL_TIMEOUT_S = breaker.DEFAULTS.breaker_open_s
-- a node's "open until" key in kvgate_state is FAIL_PREFIX .. pool .. ":" .. id (deleting it
-- closes the breaker: kvgate.config_api for a node back in service)
_M.FAIL_PREFIX = "bo:"
_M.REFRESH_S = 0.2

local DICT = "kvgate_state"
-- ngx_http_upstream_get_peer's NGX_BUSY: nginx logs "no live upstreams" and answers 502
local NGX_BUSY = -3
_M.NGX_BUSY = NGX_BUSY

--- parse_peer(address) -> host, port | nil, err
-- "IP:PORT", "[IPv6]:PORT" (what set_current_peer wants: no name resolution in a
-- request) or "unix:/path" (port nil)
function _M.parse_peer(addr)
    if type(addr) ~= "string" or addr == "" then
        return nil, "no address"
    end
    if lower(sub(addr, 1, 5)) == "unix:" then
        if #addr == 5 then
            return nil, "unix: without a path"
        end
        return addr, nil
    end
    local host, digits = match(addr, "^(.+):(%d+)$")
    local port = tonumber(digits)
    if not host or not port or port < 1 or port > 65535 then
        return nil, "expected IP:PORT or unix:PATH, got " .. addr
    end
    -- set_current_peer resolves no names: a host name here would fail every request to the
    -- node at run time, so it fails the config load instead (kvgate.render resolves hosts)
    if not match(host, "^%d+%.%d+%.%d+%.%d+$") and not match(host, "^%[[%x:.]+%]$") then
        return nil, "expected an IP address (the host resolved by kvgate.render), got " .. addr
    end
    return host, port
end

--- fail_key(pool, id) -> the key of the node's open breaker in kvgate_state
function _M.fail_key(pool, id)
    return _M.FAIL_PREFIX .. pool .. ":" .. tostring(id)
end

--- nodes(pool, prt) -> array of nodes in kvgate.json's order | nil, err
-- node: {id, w (the runtime's weight, 0 = not taking traffic), hw (the home ring's weight >= 1:
-- the runtime's home_weight; without one w, or the node's base weight in kvgate.json when w
-- is 0), down, host, port, cw (smooth round robin), failed (breaker open or half-open), half
-- (half-open), brk (any failure known), bk (breaker keys), lat (EWMA header time s | nil),
-- fail_key, inflight_key, lat_key}; plus
-- eligible (nodes with w > 0) and by_id
function _M.nodes(pool, prt)
    if type(pool) ~= "table" or type(pool.nodes) ~= "table" then
        return nil, "no nodes"
    end
    local rnodes = prt and prt.nodes
    local out, by_id, eligible = {}, {}, 0
    for i, n in ipairs(pool.nodes) do
        local host, port = _M.parse_peer(n.peer or n.address)
        if not host then
            return nil, "node " .. tostring(n.id) .. ": " .. port
        end
        local r = rnodes and rnodes[n.id]
        local w = tonumber(r and r.weight or (not rnodes and n.weight)) or 0
        local hw = tonumber(r and r.home_weight)
        if not hw or hw < 1 then
            hw = w > 0 and w or tonumber(n.weight) or 1
        end
        local node = {
            id = n.id,
            w = w > 0 and w or 0,
            hw = hw >= 1 and hw or 1,
            down = w <= 0,
            state = r and r.state,
            host = host,
            port = port,
            cw = 0,
            failed = false,
            half = false,
            brk = false,
            bk = breaker.keys_for(pool.name, n.id),
            fail_key = _M.fail_key(pool.name, n.id),
            inflight_key = inflight.key(pool.name, n.id),
            lat_key = score.key(pool.name, n.id),
        }
        if w > 0 then
            eligible = eligible + 1
        end
        out[i] = node
        by_id[n.id] = node
    end
    return out, by_id, eligible
end

--- base(pool, prt, prev) -> instance fields every balancer has | nil, err:
-- {pool, nodes, by_id, eligible, servers (server lines of the upstream)}; from prev (the
-- instance replaced by a new runtime) each node keeps this worker's failure view and its
-- round-robin weight, so a push neither forgets a failure nor restarts a sequence
function _M.base(pool, prt, prev)
    local nodes, by_id, eligible = _M.nodes(pool, prt)
    if not nodes then
        return nil, by_id
    end
    if prev and prev.by_id then
        for _, node in ipairs(nodes) do
            local old = prev.by_id[node.id]
            if old then
                node.failed = old.failed
                node.half = old.half
                node.brk = old.brk
                node.lat = old.lat
                node.cw = old.cw
            end
        end
    end
    local hsig = _M.signature(nodes, "hw")
    local b = { pool = pool.name, nodes = nodes, by_id = by_id, eligible = eligible, servers = #nodes,
                home_sig = hsig }
    _M.failover_settings(b, pool)
    if prev then
        b.half = prev.half
        b.lat_mean = prev.lat_mean
    end
    if prev and prev.home_sig == hsig then
        -- same ids and home weights: the same home ring (its nodes are looked up by id)
        b.home_ring = prev.home_ring
    end
    return b
end

--- failover_settings(b, pool): b.breaker = {failures, open_s, open_max_s}, b.fail_status
-- (status -> true: answers that count as failures), b.p2c (keyless requests by p2c), b.kv_weight,
-- b.alpha (latency EWMA), b.wmean (mean serving weight), b.half (half-open nodes in this
-- worker's view), from kvgate.json's pool.failover (defaults: kvgate.breaker.DEFAULTS, score)
function _M.failover_settings(b, pool)
    local f = pool.failover or {}
    local failures, open_s, open_max_s = breaker.settings(pool)
    b.breaker = { failures = failures, open_s = open_s, open_max_s = open_max_s }
    local fs = {}
    for _, st in ipairs(f.failure_statuses or { 502, 503, 504 }) do
        fs[st] = true
    end
    b.fail_status = fs
    b.p2c = (f.keyless or "p2c") == "p2c" -- else "round_robin": the balancer's own
    b.kv_weight = tonumber(f.kv_weight) or score.KV_WEIGHT
    b.alpha = tonumber(f.latency_alpha) or score.ALPHA
    local sum, n = 0, 0
    for _, node in ipairs(b.nodes) do
        if node.w > 0 then
            sum = sum + node.w
            n = n + 1
        end
    end
    b.wmean = n > 0 and sum / n or 1
    b.half = 0
end

--- signature(nodes, field) -> "id=<node[field]>;..." in id order: equal signatures, equal rings
function _M.signature(nodes, field)
    local parts = {}
    for i = 1, #nodes do
        parts[i] = nodes[i].id .. "=" .. nodes[i][field]
    end
    sort(parts)
    return concat(parts, ";")
end

--- home_ring(b) -> the pool's home ring (kvgate.balancer.ring of {id, weight = hw}) | false
-- (it cannot be built: logged once per instance); built at the first call, kept in b
function _M.home_ring(b)
    local r = b.home_ring
    if r == nil then
        local list = {}
        for i, node in ipairs(b.nodes) do
            list[i] = { id = node.id, weight = node.hw }
        end
        local err
        r, err = ring.new(list)
        if not r then
            ngx.log(ngx.ERR, "kvgate pool ", b.pool, ": no home ring: ", err)
            r = false
        end
        b.home_ring = r
    end
    return r
end

--- prepare_home(b, prev): a new instance builds its home ring now (not in a request) when
-- the instance it replaces had one (the pool's requests carry keys) and it could not keep it
function _M.prepare_home(b, prev)
    if b.home_ring == nil and prev and prev.home_ring then
        _M.home_ring(b)
    end
end

--- home(b, point) -> the node of b (a table of b.nodes) that is the key's home: the owner of
-- the key's point on the home ring; nil when there is no home ring
function _M.home(b, point)
    local r = b.home_ring
    if r == nil then
        r = _M.home_ring(b)
    end
    if not r then
        return nil
    end
    return b.by_id[ring_home(r, point).id]
end

--- start(b, st, kctx): the route key's CRC-32 in st.point (its place on the rings; none for
-- an empty key). The key is the route stage's (kctx.route.key); $kvgate_route_key where no
-- stage ran (a bare nginx driving the balancer: tests, the benchmark)
function _M.start(_, st, kctx)
    local key = kctx.route.key
    if key == nil then
        key = ngx.var.kvgate_route_key
    end
    if key and key ~= "" then
        st.point = crc32_long(key)
    end
end

--- skip_failed(node, tried): down, tried by this request, or failed recently
function _M.skip_failed(node, tried)
    return node.down or (tried ~= nil and tried[node.id] ~= nil) or node.failed
end

--- skip_down(node, tried): down or tried (every node failed: try them again)
function _M.skip_down(node, tried)
    return node.down or (tried ~= nil and tried[node.id] ~= nil)
end

--- rr(nodes, tried, skip) -> node | nil: nginx's smooth weighted round robin
-- (ngx_http_upstream_get_peer) over the nodes skip leaves; per worker (cw lives in the nodes)
function _M.rr(nodes, tried, skip)
    local best, total = nil, 0
    for i = 1, #nodes do
        local node = nodes[i]
        if node.w > 0 and not skip(node, tried) then
            node.cw = node.cw + node.w
            total = total + node.w
            if not best or node.cw > best.cw then
                best = node
            end
        end
    end
    if best then
        best.cw = best.cw - total
    end
    return best
end

--- mark_failed(b, node): one failure of node for its breaker (kvgate.breaker.failure: open
-- after breaker_failures in a row; this worker at once, the others at their next refresh)
function _M.mark_failed(b, node)
    return breaker.failure(b, node, now())
end

--- succeeded(b, node): node answered with a status that is no failure (the breaker closes)
function _M.succeeded(b, node)
    if node.brk then
        breaker.success(b, node)
    end
end

--- answered(b, id, status): the header filter's report of the answering node's status: a
-- failure (b.fail_status) or a success for its breaker
function _M.answered(b, id, status)
    local node = b.by_id[id]
    if not node then
        return
    end
    if b.fail_status[status] then
        breaker.failure(b, node, now())
    elseif node.brk then
        breaker.success(b, node)
    end
end

local seeded = false

--- refresh(b): this worker's view of the breakers and the latencies, from kvgate_state;
-- worker 0 also writes the breaker gauge (kvgate_upstream_breaker_state)
function _M.refresh(b)
    if not seeded then
        -- workers are forked from one master: each its own random sequence (p2c)
        seeded = true
        local w = ngx.worker
        math.randomseed((w and w.pid() or 1) * 1000 + (now() * 1000) % 1000)
    end
    local w = ngx.worker
    local id = w and w.id()
    b.half = breaker.refresh(b, now(), id == 0 or id == nil)
    score.refresh(b)
end

--- forget(b, ids): close the breakers of b's nodes (all, or the ids listed: nodes that
-- come back into service), every worker at its next refresh
function _M.forget(b, ids)
    for _, node in ipairs(b.nodes) do
        if not ids or ids[node.id] then
            breaker.forget(b, node)
        end
    end
end

--- p2c(b, tried) -> node | nil: power of two choices: two distinct nodes drawn at random
-- by serving weight among those taking traffic, not tried, not open (every one open: among
-- the others), the one with the lower kvgate.score wins (ties: the first drawn)
function _M.p2c(b, tried)
    local nodes = b.nodes
    local total, n, only = 0, 0, nil
    for pass = 1, 2 do
        local skip = pass == 1 and _M.skip_failed or _M.skip_down
        total, n = 0, 0
        for i = 1, #nodes do
            local node = nodes[i]
            if node.w > 0 and not skip(node, tried) then
                total = total + node.w
                n = n + 1
                only = node
            end
        end
        if n > 0 then
            if n == 1 then
                return only
            end
            local a = _M.draw(nodes, tried, skip, total, nil)
            local c = _M.draw(nodes, tried, skip, total - a.w, a)
            local sa, sc = _M.score_of(b, a), _M.score_of(b, c)
            return sc < sa and c or a
        end
    end
    return nil
end

--- draw(nodes, tried, skip, total, except) -> a node at random by weight (total: the weights
-- of the candidates but except)
function _M.draw(nodes, tried, skip, total, except)
    local r = random() * total
    local last
    for i = 1, #nodes do
        local node = nodes[i]
        if node ~= except and node.w > 0 and not skip(node, tried) then
            last = node
            r = r - node.w
            if r < 0 then
                return node
            end
        end
    end
    return last
end

--- score_of(b, node) -> node's load score (kvgate.score): its engine's reported queue (else the
-- gateway's in-flight count), its EWMA header time (else the pool's mean), its KV use
function _M.score_of(b, node)
    local waiting, _, kv = get_load(b.pool, node.id)
    local q = waiting or count(node.inflight_key)
    local lat = node.lat or b.lat_mean or score.DEFAULT_LATENCY_S
    return node_score(q, lat, kv, b.kv_weight, node.w, b.wmean)
end

--- keyless(b, tried) -> node | nil: the pool's choice for a request without a route key when
-- it is p2c (failover.keyless), nil otherwise (the balancer's own: round robin)
function _M.keyless(b, tried)
    if b.p2c then
        return _M.p2c(b, tried)
    end
    return nil
end

-- balancers whose keyless requests p2c takes from peers.balance; a balancer module whose own
-- pick calls keyless() for a request without a point (and counts its load there) sets
-- impl.KEYLESS_P2C = true instead: its fallback-kind requests then lose their point too
local P2C_BY_BALANCE = { chash = true }

-- trial(b) -> a half-open node this request is the trial of, or nil
local function trial(b)
    local nodes = b.nodes
    for i = 1, #nodes do
        local node = nodes[i]
        if node.half and node.w > 0 and breaker.claim_trial(b, node) then
            return node
        end
    end
    return nil
end

--- node(b, id) -> the balancer's node with that id, or nil
function _M.node(b, id)
    return b.by_id[id]
end

local function busy(b)
    klog.warn_every("no_node:" .. b.pool, 60, "kvgate pool ", b.pool,
        ": no node left to try (all down or tried); 502")
    return ngx.exit(NGX_BUSY)
end

--- balance(impl, b): balancer_by_lua for one try of the request
-- kctx.balancer across the tries: node (chosen id), home (the key's home id on the home
-- ring; nil without a route key), try, tried (id -> true), and what impl.start keeps
function _M.balance(impl, b)
    local kctx = kvctx.get()
    local st = kctx.balancer
    local tried
    local try = st.try
    if try == nil then
        try = 1
        impl.start(b, st, kctx)
        if b.p2c and (P2C_BY_BALANCE[impl.NAME] or impl.KEYLESS_P2C) and kctx.route.kind == "fallback" then
            -- none of the pool's affinity keys: the fallback key would send every such request
            -- to one node; p2c spreads them by load (no home)
            st.point = nil
        end
    else
        -- a retry: the last try failed (error, timeout, 502/503) or was passed on (403/404)
        try = try + 1
        local prev = st.node
        if prev then
            local pnode = b.by_id[prev]
            if pnode and get_last_failure() == "failed" then
                _M.mark_failed(b, pnode)
            end
            failover_total(1, b.pool, prev)
        end
        tried = st.tried or {}
        if prev then
            tried[prev] = true
        end
        st.tried = tried
    end
    st.try = try
    local node, home
    if try == 1 and b.half > 0 then
        -- a half-open node's one trial (whatever the key: one request may miss its cache)
        node = trial(b)
        if node then
            st.trial = node.id
            home = st.point and _M.home(b, st.point) or nil
        end
    end
    if not node then
        if st.point == nil and b.p2c and P2C_BY_BALANCE[impl.NAME] then
            node = _M.p2c(b, tried)
        else
            node, home = impl.pick(b, st, tried)
        end
    end
    if not node then
        if home then
            st.home = home.id
        end
        -- on a retry the previous node stays counted: @kvgate_upstream_error releases it
        -- (balancer.failed_last)
        return busy(b)
    end
    st.node = node.id
    st.home = home and home.id or nil
    if try == 1 then
        if b.eligible == 1 and b.servers > 1 then
            set_more_tries(1 - b.servers)
        end
        take(kctx.log, node.inflight_key)
    else
        inflight.move(kctx.log, b.pool, node.id, node.inflight_key)
    end
    local ok, err = set_current_peer(node.host, node.port)
    if not ok then
        ngx.log(ngx.ERR, "kvgate pool ", b.pool, ": cannot use node ", node.id, " (", node.host, "): ", err)
        return ngx.exit(NGX_BUSY)
    end
end

return _M
