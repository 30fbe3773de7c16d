-- The other gateways' in-flight prefill work per node, summed through Redis (issue 17 item 2),
-- so that the bounded balancers (chash_bounded, prefix) of every gateway of one policy judge a
-- node's load bound on the same figures and send a key to the same node.
--
-- Each gateway counts its own in-flight work in lua_shared_dict kvgate_load (kvgate.balancer.
-- load: "<pool>\t<node>" per node, "<pool>\t" per pool). With more than one member in the
-- rendered config (cfg.gateway.members, from the policy's `gateways:`), worker 0 of each gateway
-- runs a timer every SYNC_S (gateway.load_sync_s, 50 ms by default) that, in one round trip
-- (the SYNC script, EVALSHA):
--   * replaces this gateway's hash kvgate:gwload:<id> with its own figures (field = the dict
--     key, value = tokens in flight; zeros left out) and gives it a TTL of EXPIRE_SYNCS x SYNC_S,
--     so a gateway that stops (killed, partitioned) drops out of the others' sums by itself
--     (EXPIRE_SYNCS rounds: 0.2 s by default);
--   * reads every other member's hash and answers their sums per field.
-- A pool with an admission queue also publishes its admitted requests ("<pool>\tadm"): the
-- other gateways' sum goes into kvgate_state (kvgate.admission.remote_key), and the pool's
-- slots (node_capacity x serving nodes) are shared by the whole tier instead of each gateway's.
-- The sums go into the same dict under "<key>\tr" (remote_key), with the same short expiry: a
-- failed round (Redis down, the breaker open) lets them lapse, and the balancers fall back to
-- this gateway's own figures (as with one gateway) instead of trusting an old sum. The
-- balancers add the remote figure to the local one for each node and for the pool's total.
--
-- Staleness: another gateway's figure is at most one of its rounds old when written and read
-- at the next of ours, so a change there is seen here within about 2 x SYNC_S (plus a Redis
-- round trip); tests/integration/test_gateway_load_sync.py measures it.
--
-- Cost: nothing in the request path (the balancers read one more dict key per node they
-- consider only when there are other members); per gateway one EVALSHA per SYNC_S carrying
-- 2 fields per node with traffic. Prefix-index entries are not shared: each gateway learns
-- from the answers it saw (docs/scale-out.md says why).
local hash = require "kvgate.hash"
local load = require "kvgate.balancer.load"
local admission = require "kvgate.admission"

local ngx = ngx
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local type = type
local find = string.find

local _M = {}

-- the field of a pool's admitted requests (kvgate.admission), beside the load's fields
local ADM = "\tadm"

_M.SYNC_S = 0.05 -- the default of gateway.load_sync_s (the config's is used)
_M.EXPIRE_SYNCS = 4
_M.PREFIX = require("kvgate.keys").GWLOAD_PREFIX

-- KEYS[1]: this gateway's hash, KEYS[2..]: the other members'; ARGV[1]: TTL (ms), then
-- field, value pairs. Answers field, sum pairs over the other members (sums as strings).
_M.SYNC = [[
redis.call("DEL", KEYS[1])
local n = #ARGV
local i = 2
while i <= n do
  local j = math.min(n, i + 999)
  redis.call("HSET", KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
if n > 1 then
  redis.call("PEXPIRE", KEYS[1], ARGV[1])
end
local sums, order = {}, {}
for k = 2, #KEYS do
  local h = redis.call("HGETALL", KEYS[k])
  for m = 1, #h, 2 do
    local f = h[m]
    local v = tonumber(h[m + 1]) or 0
    if sums[f] == nil then
      order[#order + 1] = f
      sums[f] = v
    else
      sums[f] = sums[f] + v
    end
  end
end
local out = {}
for _, f in ipairs(order) do
  out[#out + 1] = f
  out[#out + 1] = tostring(sums[f])
end
return out
]]

local sync_sha

-- sync_s(cfg) -> the round's period (seconds)
local function sync_s(cfg)
    local g = cfg and cfg.gateway
    return g and tonumber(g.load_sync_s) or _M.SYNC_S
end

--- key(id) -> "kvgate:gwload:<gateway id>"
function _M.key(id)
    return _M.PREFIX .. id
end

--- shared(cfg) -> true when the config names other gateways (the sums are on)
function _M.shared(cfg)
    local g = cfg and cfg.gateway
    return type(g) == "table" and type(g.members) == "table" and #g.members > 1 and g.id ~= nil
end

--- args(cfg, d) -> the SYNC script's EVALSHA command for this gateway's figures (tests)
function _M.args(cfg, d)
    local g = cfg.gateway
    local cmd = { "evalsha", sync_sha, 0 }
    local nkeys = 1
    cmd[4] = _M.key(g.id)
    for _, id in ipairs(g.members) do
        if id ~= g.id then
            nkeys = nkeys + 1
            cmd[#cmd + 1] = _M.key(id)
        end
    end
    cmd[3] = nkeys
    cmd[#cmd + 1] = tostring(math.floor(_M.EXPIRE_SYNCS * sync_s(cfg) * 1000))
    local state = ngx.shared[admission.DICT]
    for name, pool in pairs(cfg.pools) do
        if pool.admission and state then
            local a = state:get(admission.inflight_key(name)) or 0
            if a > 0 then
                cmd[#cmd + 1] = name .. ADM
                cmd[#cmd + 1] = tostring(a)
            end
        end
        local tk = load.total_key(name)
        local t = d:get(tk) or 0
        if t > 0 then
            cmd[#cmd + 1] = tk
            cmd[#cmd + 1] = tostring(t)
            for _, node in ipairs(pool.nodes or {}) do
                local k = load.key(name, node.id)
                local v = d:get(k) or 0
                if v > 0 then
                    cmd[#cmd + 1] = k
                    cmd[#cmd + 1] = tostring(v)
                end
            end
        end
    end
    return cmd
end

-- store(cfg, d, reply): the other members' sums into the dict's remote keys (absent = 0)
local function store(cfg, d, reply)
    local sums = {}
    for i = 1, #reply - 1, 2 do
        sums[reply[i]] = tonumber(reply[i + 1])
    end
    local ttl = _M.EXPIRE_SYNCS * sync_s(cfg)
    local state = ngx.shared[admission.DICT]
    for name, pool in pairs(cfg.pools) do
        if pool.admission and state then
            state:set(admission.remote_key(name), sums[name .. ADM] or 0, ttl)
        end
        local tk = load.total_key(name)
        d:set(load.remote_key(tk), sums[tk] or 0, ttl)
        for _, node in ipairs(pool.nodes or {}) do
            local k = load.key(name, node.id)
            d:set(load.remote_key(k), sums[k] or 0, ttl)
        end
    end
end

local function noscript(r)
    return type(r) == "table" and r[1] == false and find(tostring(r[2]), "NOSCRIPT", 1, true)
end

--- sync(cfg) -> true | nil, err: one round (worker 0's timer; tests)
function _M.sync(cfg)
    local kredis = require "kvgate.redis" -- (here: the pure balancer tests load this module)
    local d = ngx.shared[load.DICT]
    if not d or not _M.shared(cfg) then
        return true
    end
    if kredis.down() then
        return nil, "redis down (breaker open)"
    end
    sync_sha = sync_sha or hash.to_hex(ngx.sha1_bin(_M.SYNC))
    local cmd = _M.args(cfg, d)
    local replies, err = kredis.pipeline(cfg.redis, { cmd })
    if replies and noscript(replies[1]) then
        cmd[1], cmd[2] = "eval", _M.SYNC
        replies, err = kredis.pipeline(cfg.redis, { cmd })
    end
    if not replies then
        kredis.trip()
        return nil, err
    end
    local r = replies[1]
    if type(r) ~= "table" or r[1] == false then
        return nil, "SYNC: " .. tostring(type(r) == "table" and r[2] or r)
    end
    store(cfg, d, r)
    return true
end

local function tick(premature)
    if premature then
        return
    end
    local cfg = require("kvgate.config").get()
    if not cfg or not _M.shared(cfg) then
        return
    end
    local ok, err = _M.sync(cfg)
    if not ok then
        require("kvgate.log").warn_every("gwload", 10, "kvgate gwload: the other gateways' load not read ",
            "(the bound uses this gateway's own until they are): ", err)
    end
end

--- init_worker(): worker 0's sync timer (every SYNC_S; a config with one member does nothing)
function _M.init_worker()
    local cfg = require("kvgate.config").get()
    if ngx.worker.id() ~= 0 or not ngx.shared[load.DICT] or not _M.shared(cfg) then
        return -- (the members are static config: a change is a reload, new workers)
    end
    local ok, err = ngx.timer.every(sync_s(cfg), tick)
    if not ok then
        ngx.log(ngx.ERR, "kvgate gwload: cannot start the sync timer: ", err)
    end
end

return _M
