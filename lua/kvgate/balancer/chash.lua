-- The chash balancer: a route key goes to its home node on the pool's ring
-- (kvgate.balancer.ring, points from node ids), the next node of its walk when the home
-- is down, failed or already tried. Runs in balancer_by_lua (kvgate.balancer.balance).
--
-- What nginx's `hash $kvgate_route_key consistent` with `max_fails=1 fail_timeout=10s`
-- did, and this keeps:
--   * weights: 160 × weight points per node (weight= units, kvgate.render.WEIGHT_SCALE);
--   * down (weight 0): the node keeps its place and is skipped, so only its keys move;
--   * failover once, before any byte reached the client: the retry (proxy_next_upstream,
--     capped by proxy_next_upstream_tries 2) goes to the key's next node not yet tried.
--     nginx gives the request as many tries as the upstream has servers not `down`
--     (ngx_http_lua_balancer_init_peer runs the round-robin init), so a pool with one
--     serving node gets no retry and its node's own 502/503 reaches the client, as with
--     the native hash; asking for more (set_more_tries) would turn it into "no live
--     upstreams";
--   * passive failures: balancer_by_lua has no max_fails, so a try that failed (error,
--     timeout, 502, 503: get_last_failure() = "failed") marks its node in the shared dict
--     kvgate_state for FAIL_TIMEOUT_S; marked nodes are skipped by every worker (nginx
--     counted per worker) unless every node is marked (then they are tried again, as
--     nginx resets its fail counts when all peers failed). A worker sees its own marks at
--     once and the others' within REFRESH_S (refresh(), on a timer): a shared-dict read
--     per request would cost more than the rest of the balancer. A new config (reload)
--     forgets the marks (forget(), from init), as nginx's fresh workers did;
--   * an empty route key: smooth weighted round robin (nginx's), per worker.
-- No node left: ngx.exit(NGX_BUSY), nginx's "no live upstreams" (a 502, answered by
-- @kvgate_upstream_error like any failed node).
local ring = require "kvgate.balancer.ring"
local ngx_balancer = require "ngx.balancer"

local ngx = ngx
local var = ngx.var
local shared = ngx.shared
local crc32_long = ngx.crc32_long
local set_current_peer = ngx_balancer.set_current_peer
local get_last_failure = ngx_balancer.get_last_failure
local ipairs = ipairs
local type = type
local tonumber = tonumber
local tostring = tostring
local match = string.match
local sub = string.sub
local lower = string.lower

local _M = {}

_M.NAME = "chash"
_M.FAIL_TIMEOUT_S = 10
_M.DOWN_WEIGHT = 1
_M.FAIL_PREFIX = "fail:"
_M.REFRESH_S = 0.2

local DICT = "kvgate_state"
-- ngx_http_upstream_get_peer's NGX_BUSY: nginx logs "no live upstreams" and answers 502
local NGX_BUSY = -3

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

--- new(pool) -> balancer | nil, err
-- pool: a pool of kvgate.json: name, nodes = {{id, weight (0 = down), peer}} (peer: the
-- address to connect to, written by kvgate.render; address when absent)
function _M.new(pool)
    if type(pool) ~= "table" or type(pool.nodes) ~= "table" then
        return nil, "no nodes"
    end
    local nodes = {}
    for i, n in ipairs(pool.nodes) do
        local host, port = _M.parse_peer(n.peer or n.address)
        if not host then
            return nil, "node " .. tostring(n.id) .. ": " .. port
        end
        local w = tonumber(n.weight) or 0
        nodes[i] = {
            id = n.id,
            weight = w > 0 and w or _M.DOWN_WEIGHT,
            down = w <= 0,
            rr_weight = w > 0 and w or 0,
            cw = 0,
            failed = false,
            host = host,
            port = port,
            fail_key = _M.FAIL_PREFIX .. pool.name .. ":" .. tostring(n.id),
        }
    end
    local r, err = ring.new(nodes)
    if not r then
        return nil, err
    end
    return { pool = pool.name, ring = r, nodes = nodes }
end

-- skip(node, tried): down, tried by this request, or failed recently
local function skip_failed(node, tried)
    return node.down or (tried and tried[node]) or node.failed
end

local function skip_down(node, tried)
    return node.down or (tried and tried[node]) or false
end

-- rr(b, tried, skip) -> node | nil: nginx's smooth weighted round robin over the nodes skip
-- leaves
local function rr(b, tried, skip)
    local best, total = nil, 0
    for _, node in ipairs(b.nodes) do
        if node.rr_weight > 0 and not skip(node, tried) then
            node.cw = node.cw + node.rr_weight
            total = total + node.rr_weight
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

--- pick(b, point, tried) -> node, home | nil
-- point: the key's CRC-32 (nil for an empty key: round robin); tried: node -> true
function _M.pick(b, point, tried)
    if point then
        local node, home = ring.find(b.ring, point, skip_failed, tried)
        if not node then
            node = ring.find(b.ring, point, skip_down, tried)
        end
        return node, home
    end
    return rr(b, tried, skip_failed) or rr(b, tried, skip_down)
end

--- mark_failed(b, node): skip node for FAIL_TIMEOUT_S (this worker at once, the others
-- at their next refresh)
function _M.mark_failed(b, node)
    node.failed = true
    local d = shared[DICT]
    if d then
        d:set(node.fail_key, true, _M.FAIL_TIMEOUT_S)
    end
end

--- refresh(b): this worker's view of the failure marks, from kvgate_state (expired ones clear)
function _M.refresh(b)
    local d = shared[DICT]
    if not d then
        return
    end
    for _, node in ipairs(b.nodes) do
        node.failed = d:get(node.fail_key) ~= nil
    end
end

--- forget(b): drop the failure marks of b's nodes (every worker, at its next refresh)
function _M.forget(b)
    local d = shared[DICT]
    for _, node in ipairs(b.nodes) do
        node.failed = false
        if d then
            d:delete(node.fail_key)
        end
    end
end

--- node(b, id) -> the balancer's node with that id, or nil
function _M.node(b, id)
    for _, node in ipairs(b.nodes) do
        if node.id == id then
            return node
        end
    end
    return nil
end

--- balance(b): balancer_by_lua for one try of the request
-- ngx.ctx.balancer = {point, node, home, tried} across the tries of one request
function _M.balance(b)
    local ctx = ngx.ctx
    local st = ctx.balancer
    local tried
    if st == nil then
        -- set by the access phase (gateway.lua); $kvgate_route_key where nothing set it
        local key = ctx.route_key
        if key == nil then
            key = var.kvgate_route_key
        end
        st = { point = (key and key ~= "") and crc32_long(key) or nil }
        ctx.balancer = st
    else
        -- a retry: the last try failed (error, timeout, 502/503) or was passed on (403/404)
        local prev = st.node
        if prev and get_last_failure() == "failed" then
            _M.mark_failed(b, prev)
        end
        tried = st.tried or {}
        if prev then
            tried[prev] = true
        end
        st.tried = tried
    end
    local node, home = _M.pick(b, st.point, tried)
    if home then
        st.home = home.id
    end
    if not node then
        local d = shared[DICT]
        if d and d:add("warned:no_node:" .. b.pool, true, 60) then
            ngx.log(ngx.WARN, "kvgate pool ", b.pool, ": no node left to try (all down or tried); 502")
        end
        return ngx.exit(NGX_BUSY)
    end
    st.node = node
    local ok, err = set_current_peer(node.host, node.port)
    if not ok then
        ngx.log(ngx.ERR, "kvgate pool ", b.pool, ": cannot use node ", node.id, " (", node.host, "): ", err)
        return ngx.exit(NGX_BUSY)
    end
end

return _M
