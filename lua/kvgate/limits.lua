-- Tenants' limits (issue 12 items 2, 3, 5; docs/tenants.md, Limits): token buckets in Redis,
-- shared by every nginx worker and every gateway on the same Redis.
--
-- Each limit is a bucket holding at most one minute's worth (`cap` = the per-minute limit),
-- refilled continuously at cap/60 s: a burst of the whole minute is admitted at once, then the
-- rate. A bucket is a Redis hash {t = tokens left, ts = when (ms), n = requests admitted while
-- it lived} whose TTL is the time it needs to be full again (≤ one window, so 0 < TTL ≤ 2
-- windows always holds): a full bucket is an absent key. Nothing is keyed by a wall-clock
-- minute, so 10:37 on one day never meets 10:37 on the next. Concurrency is a sorted set of
-- request ids scored by when their slot's lease expires: cfg.limits.slot_lease_s (30 s) from
-- the admission, renewed every third of it while the request runs (the kvgate_leases dict lists
-- this gateway's slots; one worker a round renews them all in one pipeline, ZADD XX), so a
-- gateway that dies, or a release lost to a Redis blip, frees its slots within one lease. A slot
-- is renewed at most cfg.limits.slot_ttl_s (the dict entry's TTL: a request that never ends).
--
-- ADMIT checks every bucket of a request first and writes only when all admit (all or
-- nothing), each write followed by its PEXPIRE in the same script: no key is left without a
-- TTL, whatever fails (a failing read fails the script before any write; scripts run
-- atomically). The gateway passes its clock (ms) so tests can run the script on a fake one.
--
-- Tokens: the prompt estimate (kvgate.balancer.load.estimate) + max_tokens (or
-- cfg.limits.default_max_tokens) are taken at admission; when the request ends, SETTLE gives
-- back the difference to the answer's `usage.total_tokens` (or takes the excess), and the
-- concurrency slot is released; both from a timer, batched per worker (never in the request).
--
-- Redis unreachable: cfg.limits.on_redis_error = "allow" counts the request in this gateway's
-- own fixed windows (kvgate_state dict, keyed by the minute's index since the epoch, at
-- fallback_factor × each limit); "deny" answers 429. Counted in
-- kvgate_ratelimit_redis_errors_total; never a 5xx.
local keys = require "kvgate.keys"
local kredis = require "kvgate.redis"
local hash = require "kvgate.hash"
local log = require "kvgate.log"

local ngx = ngx
local floor = math.floor
local ceil = math.ceil
local min = math.min
local format = string.format
local tostring = tostring
local tonumber = tonumber
local type = type
local sub = string.sub
local find = string.find
local match = string.match
local concat = table.concat
local byte = string.byte
local gsub = string.gsub

local _M = {}

_M.WINDOW_MS = 60000
_M.FALLBACK_DICT = "kvgate_limits"
_M.LEASE_DICT = "kvgate_leases"
local RENEWER = "renewer" -- the dict's round lock (a slot key always holds a newline)

-- KEYS: the buckets. ARGV[1]: now (ms); then per bucket 4 values: kind ("b" bucket | "c"
-- concurrency), cap, window (ms; for "c" the slot's lifetime), cost (for "c" the request id).
-- -> {1, left_1, ..., left_n} | {0, i (the refusing bucket), retry_ms, left_i}
_M.ADMIT = [[
local now = tonumber(ARGV[1])
local n = #KEYS
local left = {}
local now_b = {}
for i = 1, n do
  local b = 1 + (i - 1) * 4
  local kind, cap, win = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  if kind == "b" then
    local h = redis.call("HMGET", KEYS[i], "t", "ts")
    local t, ts = tonumber(h[1]), tonumber(h[2])
    local rate = cap / win
    if not t then t = cap elseif now > ts then t = math.min(cap, t + (now - ts) * rate) end
    -- a gateway whose clock is behind must not move ts back (the next would refill the gap again)
    if ts and ts > now then now_b[i] = ts else now_b[i] = now end
    local cost = tonumber(ARGV[b + 4])
    if t < cost then
      local need = math.min(cost, cap) - t
      return {0, i, math.ceil(need / rate), math.floor(t)}
    end
    left[i] = t - cost
  else
    redis.call("ZREMRANGEBYSCORE", KEYS[i], "-inf", now)
    local used = redis.call("ZCARD", KEYS[i])
    if used >= cap then
      return {0, i, 1000, 0}
    end
    left[i] = cap - used - 1
  end
end
local out = {1}
for i = 1, n do
  local b = 1 + (i - 1) * 4
  local kind, cap, win = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  if kind == "b" then
    redis.call("HSET", KEYS[i], "t", tostring(left[i]), "ts", tostring(now_b[i] or now))
    redis.call("HINCRBY", KEYS[i], "n", 1)
    redis.call("PEXPIRE", KEYS[i], math.min(2 * win, math.max(1, math.ceil((cap - left[i]) * win / cap))))
  else
    redis.call("ZADD", KEYS[i], now + win, ARGV[b + 4])
    redis.call("PEXPIRE", KEYS[i], win)
  end
  out[i + 1] = math.floor(left[i])
end
return out
]]

-- KEYS[1]: a token bucket; ARGV: now (ms), cap, window (ms), delta (tokens given back; < 0
-- takes more). A bucket that expired meanwhile is full: nothing to give back, an excess is
-- taken from a full one. -> tokens left
_M.SETTLE = [[
local now, cap, win, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local h = redis.call("HMGET", KEYS[1], "t", "ts")
local t, ts = tonumber(h[1]), tonumber(h[2])
if not t then
  if delta >= 0 then return cap end
  t = cap
elseif now > ts then
  t = math.min(cap, t + (now - ts) * cap / win)
end
t = math.max(-cap, math.min(cap, t + delta))
if ts and ts > now then now = ts end
redis.call("HSET", KEYS[1], "t", tostring(t), "ts", tostring(now))
redis.call("PEXPIRE", KEYS[1], math.min(2 * win, math.max(1, math.ceil((cap - t) * win / cap))))
return math.floor(t)
]]

local sha = {}
local function sha_of(name)
    local s = sha[name]
    if not s then
        s = hash.to_hex(ngx.sha1_bin(_M[name]))
        sha[name] = s
    end
    return s
end

--- bucket_key(tenant, name[, sub]) -> "kvgate:rl:<tenant>:<name>" or "kvgate:rl:<tenant>:<sub>:<name>"
function _M.bucket_key(tenant, name, part)
    if part then
        return keys.RATELIMIT_PREFIX .. tenant .. ":" .. part .. ":" .. name
    end
    return keys.RATELIMIT_PREFIX .. tenant .. ":" .. name
end

--- duration(ms) -> OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s"
function _M.duration(ms)
    if ms < 1000 then
        return format("%dms", ms < 0 and 0 or ceil(ms))
    end
    local s = ms / 1000
    if s < 60 then
        if s == floor(s) then
            return format("%ds", s)
        end
        return format("%.1fs", s)
    end
    return format("%dm%ds", floor(s / 60), floor(s % 60))
end

--- plan(t_id, lim, kt, route, tokens, slot_ttl_ms, request_id, session_burst_s) -> buckets
-- buckets: list of {key, kind, cap, win, cost, name} for the limits that apply (lim: the
-- tenant's limits from kvgate.json; kt: kctx.tenant (key_id); route: kctx.route)
local tenant_keys = {} -- tenant id -> {rpm, tpm, concurrency} bucket keys (the tenants are the policy's)

-- add(b, n, key, kind, cap, win, cost, name, limit) -> n + 1 (limit: the policy's figure, per
-- minute or at once, for messages; cap: what the bucket holds)
local function add(b, n, key, kind, cap, win, cost, name, limit)
    n = n + 1
    b[n] = { key = key, kind = kind, cap = cap, win = win, cost = cost, name = name, limit = limit or cap }
    return n
end

function _M.plan(t_id, lim, kt, route, tokens, slot_ttl_ms, request_id, session_burst_s)
    local b, n = {}, 0
    local tk = tenant_keys[t_id]
    if not tk then
        tk = { rpm = _M.bucket_key(t_id, "rpm"), tpm = _M.bucket_key(t_id, "tpm"),
               concurrency = _M.bucket_key(t_id, "concurrency") }
        tenant_keys[t_id] = tk
    end
    if lim.rpm then
        n = add(b, n, tk.rpm, "b", lim.rpm, _M.WINDOW_MS, 1, "rpm")
    end
    if lim.tpm then
        n = add(b, n, tk.tpm, "b", lim.tpm, _M.WINDOW_MS, tokens, "tpm")
    end
    if lim.session_rpm and route.kind == "session" and route.key and route.key ~= "" then
        -- a session's bucket holds session_burst_s of its rate (at least one request), refilled
        -- at session_rpm a minute: cap / win = session_rpm / 60 s
        local cap = floor(lim.session_rpm * (session_burst_s or 2) / 60)
        if cap < 1 then
            cap = 1
        end
        n = add(b, n, _M.bucket_key(t_id, "rpm", "s:" .. sub(hash.sha256_hex(route.key), 1, 16)), "b", cap,
            floor(cap * _M.WINDOW_MS / lim.session_rpm), 1, "session_rpm", lim.session_rpm)
    end
    if kt.key_id then
        if lim.key_rpm then
            n = add(b, n, _M.bucket_key(t_id, "rpm", "k:" .. kt.key_id), "b", lim.key_rpm, _M.WINDOW_MS, 1, "key_rpm")
        end
        if lim.key_tpm then
            n = add(b, n, _M.bucket_key(t_id, "tpm", "k:" .. kt.key_id), "b", lim.key_tpm, _M.WINDOW_MS, tokens,
                "key_tpm")
        end
    end
    if lim.concurrency then
        n = add(b, n, tk.concurrency, "c", lim.concurrency, slot_ttl_ms, request_id, "concurrency")
    end
    return b
end

-- admit_args(buckets, now_ms) -> the EVALSHA command of one request's ADMIT
local function admit_args(buckets, now_ms)
    local n = #buckets
    local args = { "evalsha", sha_of("ADMIT"), n }
    for i = 1, n do
        args[3 + i] = buckets[i].key
    end
    local a = 3 + n
    args[a + 1] = format("%d", now_ms)
    for i = 1, n do
        local bk = buckets[i]
        local j = a + 1 + (i - 1) * 4
        args[j + 1] = bk.kind
        args[j + 2] = bk.cap
        args[j + 3] = bk.win
        args[j + 4] = bk.cost
    end
    return args
end

-- admit_reply(r, n) -> ok, detail | nil, err (ADMIT's reply for n buckets)
local function admit_reply(r, n)
    if type(r) ~= "table" or r[1] == false then
        return nil, "admit: " .. tostring(r and r[2])
    end
    if r[1] == 1 then
        local left = {}
        for i = 1, n do
            left[i] = r[i + 1]
        end
        return true, left
    end
    return false, { r[2], r[3], r[4] }
end

local function noscript(r)
    return type(r) == "table" and r[1] == false and find(tostring(r[2]), "NOSCRIPT", 1, true)
end

-- run(redis_cfg, cmds) -> replies | nil, err: one pipeline; EVALSHAs Redis no longer knows (a
-- restart, SCRIPT FLUSH) once more as EVAL
local function run(redis_cfg, cmds)
    local replies, err = kredis.pipeline(redis_cfg, cmds)
    if not replies then
        return nil, err
    end
    local again, idx = nil, nil
    for i = 1, #cmds do
        if noscript(replies[i]) then
            again, idx = again or {}, idx or {}
            local c = cmds[i]
            local e = { "eval", _M.ADMIT }
            for j = 3, #c do
                e[j] = c[j]
            end
            again[#again + 1] = e
            idx[#idx + 1] = i
        end
    end
    if again then
        local r2, err2 = kredis.pipeline(redis_cfg, again)
        if not r2 then
            return nil, err2
        end
        for k = 1, #idx do
            replies[idx[k]] = r2[k]
        end
    end
    return replies
end

--- admit_redis(redis_cfg, buckets, now_ms) -> ok, detail | nil, err (one request, its own
-- round trip: tests, and a worker whose batch sender is not running)
-- ok true: detail = left per bucket; ok false: detail = {index, retry_ms, left}
function _M.admit_redis(redis_cfg, buckets, now_ms)
    local replies, err = run(redis_cfg, { admit_args(buckets, now_ms) })
    if not replies then
        return nil, err
    end
    return admit_reply(replies[1], #buckets)
end

-- admit_batched(redis_cfg, buckets, now_ms) -> as admit_redis, through kvgate.redis's batches
local function admit_batched(redis_cfg, buckets, now_ms)
    local r, err = kredis.call(redis_cfg, admit_args(buckets, now_ms))
    if r == nil then
        return nil, err
    end
    if noscript(r) then
        return _M.admit_redis(redis_cfg, buckets, now_ms)
    end
    return admit_reply(r, #buckets)
end

-- the fallback: this gateway's fixed windows (the minute's index since the epoch) in their own
-- dict (kvgate_limits: a key per tenant, API key and session; kvgate_state's fixed-size state
-- must not be evicted by them)
local function admit_local(buckets, now_s, factor)
    local d = ngx.shared[_M.FALLBACK_DICT]
    local w = floor(now_s / 60)
    local taken = {}
    for i = 1, #buckets do
        local bk = buckets[i]
        local k, cost, cap
        if bk.kind == "b" then
            k = "rl:" .. bk.key .. ":" .. w
            cost = bk.cost
            cap = (bk.limit or bk.cap) * factor -- per minute (a session's cap is its burst)
        else
            k = "rl:" .. bk.key
            cost = 1
            cap = bk.cap * factor
        end
        local v = d:incr(k, cost, 0, bk.kind == "b" and 120 or 0)
        taken[i] = { k, cost }
        if not v or v > cap then
            for j = 1, i do
                d:incr(taken[j][1], -taken[j][2], 0)
            end
            local retry = bk.kind == "b" and (60 - now_s % 60) * 1000 or 1000
            return false, { i, retry, 0 }
        end
    end
    return true, nil, taken
end

--- release_local(taken): give back the concurrency counts of a fallback admission
function _M.release_local(buckets, taken)
    local d = ngx.shared[_M.FALLBACK_DICT]
    for i = 1, #buckets do
        if buckets[i].kind == "c" and taken[i] then
            d:incr(taken[i][1], -1, 0)
        end
    end
end

--- admit(cfg, buckets) -> true, left | false, {i, retry_ms, left} , how ("redis"|"local"|"deny")
local enqueue -- (the settlements' queue, below)

-- lease_key(bk) -> the kvgate_leases key of a concurrency bucket's slot: "<zset key>\n<member>"
local function lease_key(bk)
    return bk.key .. "\n" .. bk.cost
end

-- hold(buckets, ttl_s): this gateway's slots of an admitted request, to renew until it ends
local function hold(buckets, ttl_s)
    local d = ngx.shared[_M.LEASE_DICT]
    if not d then
        return
    end
    for i = 1, #buckets do
        local bk = buckets[i]
        if bk.kind == "c" then
            d:set(lease_key(bk), true, ttl_s)
        end
    end
end

function _M.admit(cfg, buckets)
    local now_s = ngx.now()
    if not kredis.down() then
        local ok, detail = admit_batched(cfg.redis, buckets, floor(now_s * 1000))
        if ok ~= nil then
            if ok then
                hold(buckets, cfg.limits.slot_ttl_s or 600)
            end
            return ok, detail, "redis"
        end
        kredis.trip()
        -- the ADMIT may still run in Redis after this gave up on it: free its concurrency slot
        for i = 1, #buckets do
            if buckets[i].kind == "c" then
                enqueue({ zrem = buckets[i].key, member = buckets[i].cost }, function() return cfg end)
            end
        end
        log.warn_every("limits-redis", 10, "kvgate limits: Redis unreachable (", detail, "): ",
            cfg.limits.on_redis_error == "deny" and "denying limited requests" or
            "each gateway counts its own fallback limits")
    end
    if cfg.limits.on_redis_error == "deny" then
        return false, { 0, 5000, 0 }, "deny"
    end
    local ok, detail, taken = admit_local(buckets, now_s, cfg.limits.fallback_factor or 1)
    return ok, ok and taken or detail, "local"
end

-- --------------------------------------------------------------------------- settling
local queue, nqueue = {}, 0
local flushing = false

local function flush(premature, cfg_of)
    flushing = false
    if nqueue == 0 then
        return
    end
    local cfg = cfg_of()
    local batch = queue
    queue, nqueue = {}, 0
    -- one command per key: the batch's releases of one concurrency set in one ZREM, its
    -- settlements of one token bucket summed into one SETTLE at the latest time among them
    -- (a tenant's tpm bucket is every request's: under load a round's many SETTLEs, ~9 us of
    -- Redis CPU each, become one)
    local cmds, n = {}, 0
    local settle_sha = sha_of("SETTLE")
    local by_key = {}
    for i = 1, #batch do
        local s = batch[i]
        local k = s.zrem or s.key
        local c = by_key[k]
        if s.zrem then
            if c then
                c[#c + 1] = s.member
            else
                n = n + 1
                c = { "zrem", s.zrem, s.member }
                cmds[n], by_key[k] = c, c
            end
        elseif c then
            c[8] = c[8] + s.delta
            if tonumber(s.now) > tonumber(c[5]) then
                c[5] = s.now
            end
        else
            n = n + 1
            c = { "evalsha", settle_sha, 1, s.key, s.now, s.cap, s.win, s.delta }
            cmds[n], by_key[k] = c, c
        end
    end
    local replies, err = kredis.pipeline(cfg.redis, cmds)
    if not replies then
        -- once more a few seconds later (a failover, a blip): a lost release keeps a
        -- concurrency slot taken until it expires
        local again = {}
        for i = 1, #batch do
            if not batch[i].retried then
                batch[i].retried = true
                again[#again + 1] = batch[i]
            end
        end
        if #again > 0 then
            ngx.timer.at(2, function(p)
                for i = 1, #again do
                    enqueue(again[i], cfg_of)
                end
            end)
        end
        log.warn_every("limits-settle", 10, "kvgate limits: ", n, " settlements failed (retried once): ", err)
        return
    end
    -- a Redis that lost its scripts (restart, SCRIPT FLUSH): once more with EVAL
    local again, m = {}, 0
    for i = 1, n do
        local r = replies[i]
        if type(r) == "table" and r[1] == false and find(tostring(r[2]), "NOSCRIPT", 1, true) then
            local c = cmds[i]
            m = m + 1
            again[m] = { "eval", _M.SETTLE, 1, c[4], c[5], c[6], c[7], c[8] }
        end
    end
    if m > 0 then
        kredis.pipeline(cfg.redis, again)
    end
end

enqueue = function(item, cfg_of)
    nqueue = nqueue + 1
    queue[nqueue] = item
    if not flushing then
        flushing = true
        local ok, err = ngx.timer.at(0, flush, cfg_of)
        if not ok then
            flushing = false
            log.warn_every("limits-timer", 10, "kvgate limits: no timer for settlements: ", err)
        end
    end
end

--- settle(l, used_tokens, cfg_of): the request is over (log phase): its concurrency slot
-- back, the difference between its reserved and used tokens back to its token buckets
-- (l: kctx.limit; used_tokens nil = unknown: the reservation stands)
function _M.settle(l, used_tokens, cfg_of)
    local buckets = l.buckets
    if not buckets or l.settled then
        return
    end
    l.settled = true
    if l.how == "local" then
        _M.release_local(buckets, l.taken)
        return
    end
    if l.how ~= "redis" then
        return
    end
    local now_ms = format("%d", floor(ngx.now() * 1000))
    local leases = ngx.shared[_M.LEASE_DICT]
    for i = 1, #buckets do
        local bk = buckets[i]
        if bk.kind == "c" then
            if leases then
                -- no more renewals; should the ZREM be lost (a Redis blip, an exiting worker
                -- that can no longer start timers) the lease ends the slot
                leases:delete(lease_key(bk))
            end
            enqueue({ zrem = bk.key, member = bk.cost }, cfg_of)
        elseif used_tokens and (bk.name == "tpm" or bk.name == "key_tpm") then
            local delta = bk.cost - used_tokens
            if delta ~= 0 then
                enqueue({ key = bk.key, now = now_ms, cap = bk.cap, win = bk.win, delta = delta }, cfg_of)
            end
        end
    end
end

-- --------------------------------------------------------------------------- leases
_M.RENEW_TICK_S = 1

--- renew(cfg): one round of lease renewals, by the first worker of the round (a dict lock
-- of a third of the lease): every slot in kvgate_leases gets `now + slot_lease_s` (ZADD XX: a
-- slot already released is not brought back) and its set the lease as TTL, in one pipeline.
-- -> the slots renewed (0 when another worker has the round or Redis is down)
function _M.renew(cfg)
    local d = ngx.shared[_M.LEASE_DICT]
    local lease_s = cfg.limits.slot_lease_s
    if not d or not lease_s or kredis.down() then
        return 0
    end
    if not d:add(RENEWER, true, lease_s / 3) then
        return 0
    end
    local ks = d:get_keys(0)
    local lease_ms = floor(lease_s * 1000)
    local score = format("%d", floor(ngx.now() * 1000) + lease_ms)
    local cmds, n, sets = {}, 0, {}
    for i = 1, #ks do
        local k = ks[i]
        local nl = find(k, "\n", 1, true)
        if nl then
            local zkey = sub(k, 1, nl - 1)
            n = n + 1
            cmds[n] = { "zadd", zkey, "XX", score, sub(k, nl + 1) }
            if not sets[zkey] then
                sets[zkey] = true
                n = n + 1
                cmds[n] = { "pexpire", zkey, lease_ms }
            end
        end
    end
    if n == 0 then
        return 0
    end
    local replies, err = kredis.pipeline(cfg.redis, cmds)
    if not replies then
        -- the next round (a third of the lease later) tries again; the slots keep a lease meanwhile
        d:delete(RENEWER)
        log.warn_every("limits-renew", 10, "kvgate limits: renewing ", n, " concurrency leases failed: ", err)
        return 0
    end
    return #ks - 1
end

--- start(cfg_of): init_worker: the lease-renewal tick (every RENEW_TICK_S; one worker a round
-- does the work)
function _M.start(cfg_of)
    local ok, err = ngx.timer.every(_M.RENEW_TICK_S, function(premature)
        if premature then
            return
        end
        _M.renew(cfg_of())
    end)
    if not ok then
        ngx.log(ngx.ERR, "kvgate limits: cannot start the lease-renewal timer: ", err)
    end
end

-- --------------------------------------------------------------------------- usage
_M.TAIL_BYTES = 2048

--- tail(prev, chunk) -> the last TAIL_BYTES of prev .. chunk (where `usage` sits: the end of
-- a JSON answer, the last data events of a stream)
function _M.tail(prev, chunk)
    if not chunk or chunk == "" then
        return prev
    end
    local s = prev and prev .. chunk or chunk
    if #s > _M.TAIL_BYTES then
        s = sub(s, -_M.TAIL_BYTES)
    end
    return s
end

--- used_tokens(tail) -> usage.total_tokens (or prompt + completion) of the answer's end, or nil
function _M.used_tokens(tail)
    if not tail then
        return nil
    end
    local at = nil
    local from = 1
    while true do
        local s = find(tail, '"usage"', from, true)
        if not s then
            break
        end
        at = s
        from = s + 7
    end
    if not at then
        return nil
    end
    local u = sub(tail, at)
    local total = match(u, '"total_tokens"%s*:%s*(%d+)')
    if total then
        return tonumber(total)
    end
    local p = match(u, '"prompt_tokens"%s*:%s*(%d+)')
    local c = match(u, '"completion_tokens"%s*:%s*(%d+)')
    if p and c then
        return tonumber(p) + tonumber(c)
    end
    return nil
end

-- --------------------------------------------------------------------------- streams
_M.STREAM_USAGE = ',"stream_options":{"include_usage":true}}'
_M.MAX_PENDING = 65536

--- ask_usage(body) -> the body with `"stream_options":{"include_usage":true}` as its last
-- member, or nil (not an object with members). Appended, not re-encoded: the engine gets the
-- client's bytes otherwise unchanged (a request that has stream_options already is left alone
-- by the caller: the last of two equal members would win).
function _M.ask_usage(body)
    local i = #body
    local b = byte(body, i)
    while i > 1 and (b == 32 or b == 10 or b == 13 or b == 9) do
        i = i - 1
        b = byte(body, i)
    end
    if b ~= 125 then -- }
        return nil
    end
    local j = i - 1
    local p = byte(body, j)
    while j > 1 and (p == 32 or p == 10 or p == 13 or p == 9) do
        j = j - 1
        p = byte(body, j)
    end
    if p == 123 then -- {}: no members
        return nil
    end
    return sub(body, 1, i - 1) .. _M.STREAM_USAGE .. sub(body, i + 1)
end

--- strip_usage(l, chunk, eof) -> what the client gets of this chunk
-- Undoes what include_usage adds to a stream: the last event (`"choices": []` with a usage
-- object) is dropped, and a `"usage": null` member at the end of every other event (OpenAI's
-- and the simulator's shape; vLLM leaves it out) is removed. Events are cut at their blank
-- line; the part of an event not yet complete waits in l.pending for the next chunk (at most
-- MAX_PENDING bytes: past that, or at the end, it goes on as it is).
function _M.strip_usage(l, chunk, eof)
    local s = chunk or ""
    if l.pending then
        s = l.pending .. s
        l.pending = nil
    end
    local out, n, pos = {}, 0, 1
    while true do
        local _, e = find(s, "\n\r?\n", pos)
        if not e then
            break
        end
        local ev = sub(s, pos, e)
        pos = e + 1
        if find(ev, '"usage"', 1, true) then
            if find(ev, '"choices"%s*:%s*%[%s*%]') and not find(ev, '"usage"%s*:%s*null') then
                ev = nil
            else
                ev = gsub(ev, ',%s*"usage"%s*:%s*null%s*(}%s*)$', "%1", 1)
            end
        end
        if ev then
            n = n + 1
            out[n] = ev
        end
    end
    if pos <= #s then
        local rest = sub(s, pos)
        if eof or #rest > _M.MAX_PENDING then
            n = n + 1
            out[n] = rest
        else
            l.pending = rest
        end
    end
    return concat(out, "", 1, n)
end

return _M
