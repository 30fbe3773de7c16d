-- Single flight for the exact cache (nginx's proxy_cache_lock idea, across workers and gateways).
--
-- A cacheable request's lookup is one Redis script instead of a GET (the same round trip,
-- batched like the GET: kvgate.redis.call): the entry if there is one, else the request tries to
-- take the key's flight lock (SET kvgate:flight:<exact key> NX PX <wait>):
--   leader    it took the lock: it goes to an engine; the lock goes when its answer is stored
--             (DEL in the store's pipeline, kvgate.cache) or when it ends without one (release())
--   follower  another request holds the lock: it polls the same script (every POLL_MIN_S, growing
--             to POLL_MAX_S) until the entry appears (served as a HIT, reason "flight"), the lock
--             goes without an entry (the leader failed: this request takes the lock and goes on as
--             the new leader) or the wait bound passes (cache.single_flight_wait_ms: it goes to an
--             engine itself, reason "flight-timeout").
-- A request that is not a duplicate pays nothing more than the GET it did before (the lock's SET
-- runs inside the script), plus the lock's DEL in the store pipeline after its answer.
-- Redis errors fail open (the request is a MISS and goes to an engine; counted by the caller).
local kredis = require "kvgate.redis"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local type = type
local null = ngx.null
local sleep = ngx.sleep
local now = ngx.now
local min = math.min

local _M = {}

_M.LOCK_PREFIX = keys.FLIGHT_PREFIX
_M.POLL_MIN_S = 0.005
_M.POLL_MAX_S = 0.05
_M.METRIC = "kvgate_cache_flight_total"

metrics.FAMILIES[_M.METRIC] = { "counter",
    "Single flight of the exact cache, by result: leader (a miss that took the lock and went to an engine), "
    .. "hit (a duplicate served the leader's answer), timeout (a duplicate that waited the whole bound and went "
    .. "to an engine), takeover (the leader ended without an answer; this duplicate became the leader), error." }

-- KEYS[1] the entry, KEYS[2] the lock; ARGV[1] the lock's lifetime (ms).
-- -> the entry | 1 (the lock is this request's now) | 0 (another request holds it)
_M.SCRIPT = [[
local v = redis.call('GET', KEYS[1])
if v then return v end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
]]

--- lock_key(key) -> the flight lock of an exact-cache key
function _M.lock_key(key)
    return _M.LOCK_PREFIX .. key
end

local function count(result)
    metrics.incr(_M.METRIC, { result = result })
end

-- step(rcfg, key, lock, wait_ms) -> entry | 1 | 0 | nil, err
local function step(rcfg, key, lock, wait_ms)
    local v, err = kredis.call(rcfg, { "eval", _M.SCRIPT, 2, key, lock, wait_ms })
    if v == nil then
        return nil, err
    end
    if type(v) == "table" then
        return nil, v[2]
    end
    if v == null then
        return nil, "no reply"
    end
    return v
end

--- lookup(rcfg, key, wait_ms) -> entry | false (a miss) | nil, err; and how:
-- "hit" (the entry was there), "leader" (this request holds the lock: it must store its answer
-- or release()), "flight" (a duplicate served the leader's answer), "timeout" (waited wait_ms,
-- no lock held), "takeover" (the leader ended without an answer: this request is the leader now)
-- Where cosockets are (access). wait_ms > 0.
function _M.lookup(rcfg, key, wait_ms)
    local lock = _M.lock_key(key)
    local v, err = step(rcfg, key, lock, wait_ms)
    if v == nil then
        return nil, err
    end
    if type(v) == "string" then
        return v, "hit"
    end
    if v == 1 then
        count("leader")
        return false, "leader"
    end
    -- a duplicate: wait for the leader's answer
    local deadline = now() + wait_ms / 1000
    local pause = _M.POLL_MIN_S
    while true do
        local left = deadline - now()
        if left <= 0 then
            count("timeout")
            return false, "timeout"
        end
        sleep(min(pause, left))
        pause = min(pause * 2, _M.POLL_MAX_S)
        v, err = step(rcfg, key, lock, wait_ms)
        if v == nil then
            count("error")
            return nil, err
        end
        if type(v) == "string" then
            count("hit")
            return v, "flight"
        end
        if v == 1 then
            count("takeover")
            return false, "takeover"
        end
    end
end

-- the locks of leaders that end without a stored answer, deleted from one timer per worker
local pending, npending = {}, 0
local scheduled = false

local function flush(premature, rcfg)
    scheduled = false
    local batch, n = pending, npending
    pending, npending = {}, 0
    if premature or n == 0 then
        return
    end
    local cmds = {}
    for i = 1, n do
        cmds[i] = { "del", batch[i] }
    end
    local ok, err = kredis.pipeline(rcfg, cmds)
    if not ok then
        -- the locks expire by their TTL (the wait bound): followers go to an engine then
        ngx.log(ngx.INFO, "kvgate flight: cannot release ", n, " locks: ", err)
    end
end

--- release(rcfg, key): the leader of key ended without storing an answer (an error, a stream
-- not cached, a client abort): its lock goes now, so the waiting duplicates take over at once
-- (log phase: from a timer)
function _M.release(rcfg, key)
    if npending >= 10000 then
        return
    end
    npending = npending + 1
    pending[npending] = _M.lock_key(key)
    if not scheduled then
        if ngx.timer.at(0, flush, rcfg) then
            scheduled = true
        else
            pending, npending = {}, 0
        end
    end
end

return _M
