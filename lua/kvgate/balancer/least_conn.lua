-- The least_conn balancer: the node with the fewest requests in flight per unit of weight
-- (inflight / weight, nginx's least_conn rule), counted across every worker in the shared
-- in-flight dict (kvgate.inflight: from the balancer's pick to the end of the request;
-- nginx's own least_conn counts per worker). Nodes with equal scores share requests by
-- smooth weighted round robin (as nginx tries them "in turn"). Down (weight 0), failed and
-- tried nodes are skipped; when every node taking traffic is failed they are tried again.
-- Tries, failure marks and the in-flight count: kvgate.balancer.peers; a keyed request's
-- home: its node on the pool's home ring (peers.home).
local peers = require "kvgate.balancer.peers"
local inflight = require "kvgate.inflight"

local count = inflight.count

local _M = {}

_M.NAME = "least_conn"

--- new(pool, prt, prev) -> balancer | nil, err (see kvgate.balancer.peers)
function _M.new(pool, prt, prev)
    local b, err = peers.base(pool, prt, prev)
    if not b then
        return nil, err
    end
    b.tied = {}
    peers.prepare_home(b, prev)
    return b
end

--- start(b, st, kctx): the route key's point (peers.start), for the key's home
_M.start = peers.start

-- least(b, tried, skip, counts) -> node | nil: the lowest inflight/weight (compared as
-- a.n × b.w < b.n × a.w), ties by smooth weighted round robin
local function least(b, tried, skip, counts)
    local nodes, tied = b.nodes, b.tied
    local nt = 0
    local bn, bw
    for i = 1, #nodes do
        local node = nodes[i]
        if node.w > 0 and not skip(node, tried) then
            local n = counts[i]
            if not bn or n * bw < bn * node.w then
                bn, bw = n, node.w
                nt = 1
                tied[1] = node
            elseif n * bw == bn * node.w then
                nt = nt + 1
                tied[nt] = node
            end
        end
    end
    if nt == 0 then
        return nil
    end
    if nt == 1 then
        return tied[1]
    end
    local best, total = nil, 0
    for i = 1, nt do
        local node = tied[i]
        node.cw = node.cw + node.w
        total = total + node.w
        if not best or node.cw > best.cw then
            best = node
        end
    end
    best.cw = best.cw - total
    return best
end

--- pick(b, st, tried) -> node, home | nil[, home]: home = the key's node on the home ring
-- (peers.home; nil without a route key)
function _M.pick(b, st, tried)
    local nodes = b.nodes
    local counts = {}
    for i = 1, #nodes do
        local node = nodes[i]
        counts[i] = node.w > 0 and count(node.inflight_key) or 0
    end
    local point = st.point
    local home = point and peers.home(b, point) or nil
    return least(b, tried, peers.skip_failed, counts) or least(b, tried, peers.skip_down, counts), home
end

--- balance(b): balancer_by_lua for one try of the request
function _M.balance(b)
    return peers.balance(_M, b)
end

return _M
