-- The chash balancer: a route key goes to its home node on the pool's ring
-- (kvgate.balancer.ring, points from node ids), the next node of its walk when the home
-- is down, failed or already tried. Runs in balancer_by_lua (kvgate.balancer.balance);
-- tries, failure marks and the in-flight count are kvgate.balancer.peers'.
--
-- What nginx's `hash $kvgate_route_key consistent` with `max_fails=1 fail_timeout=10s`
-- did, and this keeps:
--   * weights: 160 × weight points per node (the runtime's weights, nginx weight= units,
--     kvgate.render.WEIGHT_SCALE);
--   * down (weight 0): the node keeps a place (160 points, nginx's weight 1 of a `down`
--     server) and is skipped, so only its keys move;
--   * failover once, before any byte reached the client: the retry (proxy_next_upstream,
--     capped by proxy_next_upstream_tries 2) goes to the key's next node not yet tried;
--   * passive failures shared by every worker (peers.mark_failed); a node that comes back
--     into service forgets its mark (kvgate.config_api, balancer.init);
--   * an empty route key: smooth weighted round robin (nginx's), per worker.
-- The ring is rebuilt only when a new runtime changes a node's ring weight (state-only
-- changes and other pools' changes reuse it): a ring of 4 nodes at weight=100 is 64,000 points.
-- The key's home (kctx.balancer.home, the request log's `home`) is its node on the home ring
-- (kvgate.balancer.peers: node ids at their home weights). When every ring weight equals its
-- home weight (every node taking traffic at its serving weight: the steady state) the two
-- rings are one, and the home is the routing lookup's first point's node, no second lookup;
-- otherwise (a node down, ramping ...) one more lookup on the home ring (built with the
-- instance, once per runtime version that changes a home weight, never in a request).
local ring = require "kvgate.balancer.ring"
local peers = require "kvgate.balancer.peers"

local find = ring.find
local skip_failed = peers.skip_failed
local skip_down = peers.skip_down
local sort = table.sort
local ipairs = ipairs

local _M = {}

_M.NAME = "chash"
_M.DOWN_WEIGHT = 1
-- kept here for the callers of the chash-only era (tests, the benchmark)
_M.FAIL_TIMEOUT_S = peers.FAIL_TIMEOUT_S
_M.FAIL_PREFIX = peers.FAIL_PREFIX
_M.REFRESH_S = peers.REFRESH_S
_M.parse_peer = peers.parse_peer
_M.mark_failed = peers.mark_failed
_M.refresh = peers.refresh
_M.forget = peers.forget
_M.node = peers.node

local function by_id(a, b)
    return a.id < b.id
end

--- new(pool, prt, prev) -> balancer | nil, err
-- pool: a pool of kvgate.json (name, nodes = {{id, address, peer}}); prt: the pool's runtime
-- (weights; nil = kvgate.json's node weights); prev: the instance this replaces (its ring is
-- kept when no ring weight changed)
function _M.new(pool, prt, prev)
    local b, err = peers.base(pool, prt, prev)
    if not b then
        return nil, err
    end
    for _, node in ipairs(b.nodes) do
        -- the ring's weight: a node not taking traffic keeps nginx's `down` place (weight 1)
        node.weight = node.w > 0 and node.w or _M.DOWN_WEIGHT
    end
    local sig = peers.signature(b.nodes, "weight")
    local r
    if prev and prev.sig == sig and prev.ring then
        -- same ids and weights: the same points; only the node tables are new (ring.nodes is
        -- in id order, so are these)
        local sorted = {}
        for i, node in ipairs(b.nodes) do
            sorted[i] = node
        end
        sort(sorted, by_id)
        local old = prev.ring
        r = { n = old.n, hashes = old.hashes, owners = old.owners, nodes = sorted, count = old.count,
              first = old.first, shift = old.shift }
    else
        r, err = ring.new(b.nodes)
        if not r then
            return nil, err
        end
    end
    b.ring = r
    b.sig = sig
    -- the routing ring is the home ring when every ring weight is the home weight
    b.home_is_ring = sig == b.home_sig
    if b.home_is_ring then
        b.home_ring = r
    else
        peers.home_ring(b) -- here (init, the sync timer), not in a request; kept when unchanged
    end
    return b
end

--- start(b, st, kctx): the key's CRC-32 (st.point, peers.start; none for an empty key:
-- round robin)
_M.start = peers.start

--- pick(b, st, tried) -> node, home | nil[, home]
-- st.point: the key's CRC-32 (nil: round robin); tried: node id -> true
function _M.pick(b, st, tried)
    local point = st.point
    if point then
        local node, home = find(b.ring, point, skip_failed, tried)
        if not node then
            node = find(b.ring, point, skip_down, tried)
        end
        if not b.home_is_ring then
            home = peers.home(b, point)
        end
        return node, home
    end
    return peers.rr(b.nodes, tried, peers.skip_failed) or peers.rr(b.nodes, tried, peers.skip_down)
end

--- balance(b): balancer_by_lua for one try of the request (kctx.balancer: node, home, point, tried)
function _M.balance(b)
    return peers.balance(_M, b)
end

return _M
