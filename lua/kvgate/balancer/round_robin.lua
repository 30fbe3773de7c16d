-- The round_robin balancer: nginx's smooth weighted round robin (ngx_http_upstream_get_peer:
-- each pick adds every node's weight to its current weight, takes the largest and subtracts
-- the total from it), per worker, over the nodes taking traffic (runtime weight > 0) that
-- are neither failed recently nor tried by this request; when every such node is failed,
-- they are tried again. Weights 5, 1, 1 give a a b a c a a. A new runtime starts the
-- sequence afresh. Tries, failure marks and the in-flight count: kvgate.balancer.peers.
-- A keyed request's home (the request log's `home`) is its node on the pool's home ring
-- (peers.home), wherever round robin sends it.
local peers = require "kvgate.balancer.peers"

local _M = {}

_M.NAME = "round_robin"

--- new(pool, prt, prev) -> balancer | nil, err (see kvgate.balancer.peers)
function _M.new(pool, prt, prev)
    local b, err = peers.base(pool, prt, prev)
    if b then
        peers.prepare_home(b, prev)
    end
    return b, err
end

--- start(b, st, kctx): the route key's point (peers.start), for the key's home
_M.start = peers.start

--- pick(b, st, tried) -> node, home | nil[, home]: home = the key's node on the home ring
-- (peers.home; nil without a route key)
function _M.pick(b, st, tried)
    local point = st.point
    local home = point and peers.home(b, point) or nil
    return peers.rr(b.nodes, tried, peers.skip_failed) or peers.rr(b.nodes, tried, peers.skip_down), home
end

--- balance(b): balancer_by_lua for one try of the request
function _M.balance(b)
    return peers.balance(_M, b)
end

return _M
