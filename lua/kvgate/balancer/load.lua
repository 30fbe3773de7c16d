-- In-flight prefill work per node, for the bounded balancers (kvgate.balancer.chash_bounded):
-- the estimated prompt tokens of the requests routed to each node, counted across every
-- worker in lua_shared_dict kvgate_load (atomic incr), from the balancer's pick until the
-- request ends; the gauge kvgate_upstream_load_tokens{pool,node} on /metrics.
--
-- Keys: "<pool>\t<node id>" per node and "<pool>\t" for the pool's total (the bound's
-- denominator: one get instead of a sum over the nodes). A request holds its tokens in a
-- holder table (the request context's kctx.log, kvgate.ctx): take() at the first try's pick,
-- move() on a failover (the tokens go from the node left to the one tried next; the total is
-- unchanged), finish() in the log phase (kvgate.phase.log, which also runs after a client
-- abort, an error answered by nginx and the end of a stream) and in @kvgate_upstream_error
-- (kvgate.balancer.failed_last). finish() is idempotent: the holder forgets the key, so the
-- tokens go back exactly once. Counts never go below 0 (a release without its take: a
-- worker that crashed while holding one). The dict survives `nginx -s reload`: an old
-- worker's streams release what they took.
--
-- The estimate (estimate()): ceil(request body bytes / BYTES_PER_TOKEN), from the length of
-- the body the request stage already holds (no pass over it). JSON framing and roles count
-- too; only ratios between nodes matter to the bound, and every request is estimated alike.
local metrics = require "kvgate.metrics"

local ngx = ngx
local tonumber = tonumber
local pairs = pairs
local ipairs = ipairs
local ceil = math.ceil

local _M = {}

_M.DICT = "kvgate_load"
_M.NAME = "kvgate_upstream_load_tokens"
_M.REMOTE_NAME = "kvgate_upstream_load_tokens_remote"
-- about 4 bytes of English text per BPE token (OpenAI's rule of thumb); the simulator's
-- words run 5-8 bytes, so its estimate is high by a constant factor, which the bound ignores
_M.BYTES_PER_TOKEN = 4

local SEP = "\t"

local the_dict
local function dict()
    local d = the_dict
    if d == nil then
        d = ngx.shared[_M.DICT] or false
        the_dict = d
    end
    return d
end

--- key(pool, node) -> the node's dict key;  total_key(pool) -> the pool's total's key
function _M.key(pool, node)
    return pool .. SEP .. node
end

function _M.total_key(pool)
    return pool .. SEP
end

-- The other gateways' figures (kvgate.gwload, summed through Redis): under "<key>\tr" in the
-- same dict, for a node's key and a pool's total. remote: whether the balancers add them
-- (a config with other gateway members; set by kvgate.balancer.init).
_M.remote = false

--- remote_key(key) -> the dict key of the other gateways' sum for a node's or total's key
function _M.remote_key(key)
    return key .. "\tr"
end

--- of(d, key, rkey) -> this gateway's count under key plus, with other gateways, their sum
-- under rkey (0 when absent or lapsed)
function _M.of(d, key, rkey)
    local l = d:get(key) or 0
    if _M.remote then
        l = l + (d:get(rkey) or 0)
    end
    return l
end

--- estimate(bytes) -> estimated prompt tokens (>= 1) of a request body of `bytes` bytes
function _M.estimate(bytes)
    local n = ceil((tonumber(bytes) or 0) / _M.BYTES_PER_TOKEN)
    if n < 1 then
        return 1
    end
    return n
end

local function add(d, key, v)
    local n, err = d:incr(key, v, 0)
    if not n then
        ngx.log(ngx.WARN, "kvgate load: ", err, " for ", key)
        return nil
    end
    if n < 0 then
        d:incr(key, -n)
        n = 0
    end
    return n
end

--- get(key) -> the count under a key (0 when none or without the dict)
function _M.get(key)
    local d = dict()
    return d and d:get(key) or 0
end

--- take(h, node_key, total_key, tokens): the request's tokens go on its node (once per
-- request: a holder already holding tokens is left alone)
function _M.take(h, node_key, total_key, tokens)
    if h.load_key then
        return
    end
    local d = dict()
    if not d then
        return
    end
    if add(d, node_key, tokens) then
        add(d, total_key, tokens)
        h.load_key = node_key
        h.load_total = total_key
        h.load_tokens = tokens
    end
end

--- move(h, node_key): a failover: the held tokens go to the node tried next
function _M.move(h, node_key)
    local prev = h.load_key
    if not prev or prev == node_key then
        return
    end
    local d = dict()
    if not d then
        return
    end
    local t = h.load_tokens
    add(d, prev, -t)
    if add(d, node_key, t) then
        h.load_key = node_key
    else
        -- the tokens left the pool's nodes: out of the total too
        add(d, h.load_total, -t)
        h.load_key = nil
    end
end

--- finish(h): the request ended: its tokens leave its node and the pool's total (once)
function _M.finish(h)
    local key = h and h.load_key
    if not key then
        return
    end
    h.load_key = nil
    local d = dict()
    if d then
        local t = h.load_tokens
        add(d, key, -t)
        add(d, h.load_total, -t)
    end
end

--- lines(cfg) -> sample lines of kvgate_upstream_load_tokens for metrics.render: every node
-- of the config (0 without traffic)
function _M.lines(cfg)
    local values = {}
    local d = dict()
    for pname, pool in pairs(cfg and cfg.pools or {}) do
        for _, node in ipairs(pool.nodes or {}) do
            values[metrics.labels({ pool = pname, node = node.id })] = d and d:get(_M.key(pname, node.id)) or 0
        end
    end
    return metrics.gauge_lines(_M.NAME, values)
end

--- remote_lines(cfg) -> sample lines of kvgate_upstream_load_tokens_remote (the other
-- gateways' sums), or nil with one gateway
function _M.remote_lines(cfg)
    if not _M.remote then
        return nil
    end
    local values = {}
    local d = dict()
    for pname, pool in pairs(cfg and cfg.pools or {}) do
        for _, node in ipairs(pool.nodes or {}) do
            values[metrics.labels({ pool = pname, node = node.id })] =
                d and d:get(_M.remote_key(_M.key(pname, node.id))) or 0
        end
    end
    return metrics.gauge_lines(_M.REMOTE_NAME, values)
end

return _M
