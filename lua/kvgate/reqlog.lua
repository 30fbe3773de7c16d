-- The request log in Redis, read by the control plane (warm-up, admin page).
--
-- The request path never talks to Redis for it: the log phase appends an entry to a
-- per-worker Lua table, and a ngx.timer.every(INTERVAL_S) started in init_worker sends
-- the buffer in pipelines of at most CHUNK entries (ngx.sleep(0) between two, so a large
-- buffer never holds the worker's event loop for long):
--   XADD kvgate:log MAXLEN ~ 100000 * ts .. pool .. node .. status .. cache .. kind .. fp .. key .. ms
--        .. point .. tries .. home .. spill .. tenant  (the fields of keys.LOG_FIELDS, in that order)
--     point: ngx.crc32_long(route key), the key's place on the chash ring, as a decimal
--            integer ("" without a key); home (below) is the key's node on the home ring
--     tries: nodes tried ($upstream_addr entries; > 1 = failover, 0 = no upstream/cache hit;
--            "" for an entry handed over by a worker that predates the field)
--     home:  the route key's home node as the pool's balancer saw it (kctx.balancer.home;
--            "" for a cache hit or a request that was never balanced)
--     spill: "bound" | "queue" when a bounded balancer sent the key past its home (kctx.balancer.spill), else ""
--     .. key_id .. model .. prompt .. cached .. completion .. ttft .. batch .. blocks .. cost .. saved_cache
--        .. saved_prefix .. saved_batch: the usage record (kvgate.usage; integers, n$ for money, "" unknown)
--   ZINCRBY kvgate:hot:<pool>:<minute> <n> <fp>     (per fingerprint; minute = floor(ts / 60))
--   EXPIRE  kvgate:hot:<pool>:<minute> <hot_window_s + 120>
--   SET     kvgate:prefix:<pool>:<fp> <json> EX <ttl_s> NX   (opt-in warm-up sample, kvgate.warm.sample)
-- Redis down (the breaker in kvgate.redis is open, or the pipeline fails): the batch
-- is dropped and counted; the buffer is capped at MAX_BUFFER entries (more are dropped
-- and counted). A worker that is exiting (reload, stop) can no longer start timers: its
-- buffer and the entries of the streams it is still finishing go to a list in the
-- shared dict kvgate_reqlog, which the live workers' flushes drain.
local cjson = require "cjson.safe"
local config = require "kvgate.config"
local kredis = require "kvgate.redis"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"
local klog = require "kvgate.log"

local ngx = ngx
local type = type
local format = string.format
local floor = math.floor
local tostring = tostring
local pcall = pcall
local ipairs = ipairs
local tonumber = tonumber
local concat = table.concat
local sleep = ngx.sleep

local _M = {}

_M.INTERVAL_S = 0.5
_M.MAX_BUFFER = 10000
-- entries per pipeline of a flush. One pipeline for a whole buffer (7,000 entries after
-- 0.5 s at 14k requests/s in a worker) built its commands for 10-25 ms without yielding: the
-- worker's requests waited that long every 0.5 s (the p99 of kvgate bench gateway)
_M.CHUNK = 256
_M.STREAM = keys.LOG_STREAM
_M.MAXLEN = tostring(keys.LOG_MAXLEN)
_M.HOT_SLACK_S = 120
_M.DEFAULT_HOT_WINDOW_S = 3600

local DICT = "kvgate_reqlog"
local SPILL = "spill"
local WARN_INTERVAL_S = 10

local buf, n = {}, 0
local flushing = false

--- hot_key(pool, ts) -> "kvgate:hot:<pool>:<minute>" (keys.hot)
_M.hot_key = keys.hot

--- prefix_key(pool, fp) -> "kvgate:prefix:<pool>:<fp>" (keys.prefix_text)
_M.prefix_key = keys.prefix_text

-- RESP framing of one bulk string: "$<len>\r\n<s>\r\n"
local function bulk(s)
    return "$" .. #s .. "\r\n" .. s .. "\r\n"
end

--- resp(cmd) -> the command {name, arg, ...} in Redis's wire format (RESP array of bulk strings)
function _M.resp(cmd)
    local parts = { "*" .. #cmd .. "\r\n" }
    for i = 1, #cmd do
        parts[i + 1] = bulk(cmd[i])
    end
    return concat(parts)
end

local XADD_HEAD -- "*<n>\r\n" and the fixed arguments up to "*", built at first use

-- int(v) -> v as a decimal integer, "" for nil (unknown)
local function int(v)
    return v and format("%d", v) or ""
end
local FIELD = {} -- field name -> its bulk string
for _, f in ipairs(keys.LOG_FIELDS) do
    FIELD[f] = bulk(f)
end

-- xadd(e) -> the entry's XADD already in wire format: what a command table of commands()
-- costs per entry (~30 strings, then the client's own framing of each) in one concatenation
local function xadd(e, fp)
    if not XADD_HEAD then
        XADD_HEAD = "*" .. (6 + 2 * #keys.LOG_FIELDS) .. "\r\n" .. bulk("xadd") .. bulk(_M.STREAM) ..
            bulk("MAXLEN") .. bulk("~") .. bulk(_M.MAXLEN) .. bulk("*")
    end
    local ts = format("%.3f", e.ts)
    local pool, node, status, cache = e.pool, e.node or "", tostring(e.status), e.cache or ""
    local kind, key, ms = e.kind or "", e.key or "", tostring(e.ms)
    local point = e.point and format("%d", e.point) or ""
    local tries = e.tries and format("%d", e.tries) or ""
    local home = e.home or ""
    local spill = e.spill or ""
    local tenant = e.tenant or ""
    local key_id, model, batch, blocks = e.key_id or "", e.model or "", e.batch or "", e.blocks or ""
    local prompt, cached, completion, ttft = int(e.prompt), int(e.cached), int(e.completion), int(e.ttft)
    local cost, s_cache, s_prefix, s_batch = int(e.cost), int(e.saved_cache), int(e.saved_prefix),
        int(e.saved_batch)
    return concat({ XADD_HEAD,
        FIELD.ts, "$", #ts, "\r\n", ts, "\r\n", FIELD.pool, "$", #pool, "\r\n", pool, "\r\n",
        FIELD.node, "$", #node, "\r\n", node, "\r\n", FIELD.status, "$", #status, "\r\n", status, "\r\n",
        FIELD.cache, "$", #cache, "\r\n", cache, "\r\n", FIELD.kind, "$", #kind, "\r\n", kind, "\r\n",
        FIELD.fp, "$", #fp, "\r\n", fp, "\r\n", FIELD.key, "$", #key, "\r\n", key, "\r\n",
        FIELD.ms, "$", #ms, "\r\n", ms, "\r\n", FIELD.point, "$", #point, "\r\n", point, "\r\n",
        FIELD.tries, "$", #tries, "\r\n", tries, "\r\n", FIELD.home, "$", #home, "\r\n", home, "\r\n",
        FIELD.spill, "$", #spill, "\r\n", spill, "\r\n", FIELD.tenant, "$", #tenant, "\r\n", tenant, "\r\n",
        FIELD.key_id, "$", #key_id, "\r\n", key_id, "\r\n", FIELD.model, "$", #model, "\r\n", model, "\r\n",
        FIELD.prompt, "$", #prompt, "\r\n", prompt, "\r\n", FIELD.cached, "$", #cached, "\r\n", cached, "\r\n",
        FIELD.completion, "$", #completion, "\r\n", completion, "\r\n", FIELD.ttft, "$", #ttft, "\r\n", ttft,
        "\r\n", FIELD.batch, "$", #batch, "\r\n", batch, "\r\n", FIELD.blocks, "$", #blocks, "\r\n", blocks,
        "\r\n", FIELD.cost, "$", #cost, "\r\n", cost, "\r\n", FIELD.saved_cache, "$", #s_cache, "\r\n", s_cache,
        "\r\n", FIELD.saved_prefix, "$", #s_prefix, "\r\n", s_prefix, "\r\n", FIELD.saved_batch, "$", #s_batch,
        "\r\n", s_batch, "\r\n" })
end

--- commands(batch, count, cfg, wire) -> cmds, xadd_positions, set_positions  (PURE)
-- wire: the XADDs come as strings in Redis's wire format (resp() of the same command; what
-- the flush sends), else as command tables
-- batch[1..count]: entries {ts, pool, node, status, cache, kind, fp, key, ms, point?, tries?, home?, spill?,
-- tenant?, the usage record's fields?, cap?, cap_ttl?}
-- cfg: the data config (per pool hot_window_s); the hot-set counts of a batch are summed
-- per (pool, minute, fp), and each hot key gets one EXPIRE per batch.
function _M.commands(batch, count, cfg, wire)
    local cmds, xadds, sets = {}, {}, {}
    local hot, hot_order = {}, {}
    for i = 1, count do
        local e = batch[i]
        local fp = e.fp or ""
        cmds[#cmds + 1] = wire and xadd(e, fp) or { "xadd", _M.STREAM, "MAXLEN", "~", _M.MAXLEN, "*",
            "ts", format("%.3f", e.ts), "pool", e.pool, "node", e.node or "", "status", tostring(e.status),
            "cache", e.cache or "", "kind", e.kind or "", "fp", fp, "key", e.key or "",
            "ms", tostring(e.ms),
            "point", e.point and format("%d", e.point) or "", "tries", e.tries and format("%d", e.tries) or "",
            "home", e.home or "", "spill", e.spill or "", "tenant", e.tenant or "",
            "key_id", e.key_id or "", "model", e.model or "", "prompt", int(e.prompt), "cached", int(e.cached),
            "completion", int(e.completion), "ttft", int(e.ttft), "batch", e.batch or "", "blocks", e.blocks or "",
            "cost", int(e.cost), "saved_cache", int(e.saved_cache), "saved_prefix", int(e.saved_prefix),
            "saved_batch", int(e.saved_batch) }
        xadds[#xadds + 1] = #cmds
        if fp ~= "" then
            local hk = _M.hot_key(e.pool, e.ts)
            local h = hot[hk]
            if not h then
                h = { pool = e.pool, counts = {}, order = {} }
                hot[hk] = h
                hot_order[#hot_order + 1] = hk
            end
            local c = h.counts[fp]
            if not c then
                h.order[#h.order + 1] = fp
                c = 0
            end
            h.counts[fp] = c + 1
            if e.cap then
                cmds[#cmds + 1] = { "set", _M.prefix_key(e.pool, fp), e.cap, "EX", tostring(e.cap_ttl), "NX" }
                sets[#sets + 1] = #cmds
            end
        end
    end
    local pools = cfg and cfg.pools or {}
    for _, hk in ipairs(hot_order) do
        local h = hot[hk]
        for _, fp in ipairs(h.order) do
            cmds[#cmds + 1] = { "zincrby", hk, tostring(h.counts[fp]), fp }
        end
        local pool = pools[h.pool]
        local window = type(pool) == "table" and tonumber(pool.hot_window_s) or _M.DEFAULT_HOT_WINDOW_S
        cmds[#cmds + 1] = { "expire", hk, tostring(floor(window) + _M.HOT_SLACK_S) }
    end
    return cmds, xadds, sets
end

local function dropped(reason, k)
    metrics.incr(keys.METRICS.request_log_dropped, { reason = reason }, k or 1)
end

local function warn(what, err)
    klog.warn_every("reqlog:" .. what, WARN_INTERVAL_S, "kvgate request log ", what,
        " (entries dropped; next warning in ", WARN_INTERVAL_S, "s): ", err)
end

local function spill(e)
    local d = ngx.shared[DICT]
    if not d then
        dropped("spill-full")
        return
    end
    local len = d:llen(SPILL)
    if type(len) == "number" and len >= _M.MAX_BUFFER then
        dropped("spill-full")
        return
    end
    local v = cjson.encode(e)
    local ok, err = v and d:lpush(SPILL, v)
    if not ok then
        dropped("spill-full")
        warn("spill", err or "encode failed")
    end
end

--- record(e): log phase; never blocks, never talks to Redis
function _M.record(e)
    if ngx.worker.exiting() then
        -- no timer of this worker runs any more: the live workers flush it
        return spill(e)
    end
    if n >= _M.MAX_BUFFER then
        return dropped("buffer-full")
    end
    n = n + 1
    buf[n] = e
end

-- send(batch, count) -> true, or the reason the entries were dropped ("redis-down",
-- "redis-error": Redis is unusable, so the rest of the flush goes the same way)
local function send(batch, count)
    local cfg = config.get()
    if kredis.down() then
        dropped("redis-down", count)
        return "redis-down"
    end
    local cmds, xadds, sets = _M.commands(batch, count, cfg, true)
    local ok, replies, err = pcall(kredis.pipeline, cfg.redis, cmds)
    if not ok then
        replies, err = nil, replies
    end
    if not replies then
        kredis.trip()
        warn("flush failed", err)
        dropped("redis-error", count)
        return "redis-error"
    end
    local written, sampled = 0, 0
    for i = 1, #xadds do
        local r = replies[xadds[i]]
        if r ~= nil and not (type(r) == "table" and r[1] == false) then
            written = written + 1
        end
    end
    for i = 1, #sets do
        local r = replies[sets[i]]
        if r ~= nil and not (type(r) == "table" and r[1] == false) then
            sampled = sampled + 1
        end
    end
    if written > 0 then
        metrics.incr(keys.METRICS.request_log_written, {}, written)
    end
    if sampled > 0 then
        metrics.incr(keys.METRICS.prefix_captures, {}, sampled)
    end
    if written < count then
        dropped("redis-error", count - written)
        warn("write failed", "an XADD was refused")
    end
    return true
end

--- flush(premature): the timer; this worker's buffer plus what exiting workers left in the
-- shared list, in pipelines of CHUNK entries with the event loop let through between two
function _M.flush(premature)
    if premature then
        -- this worker is exiting (reload/stop): hand the buffer to the live workers
        local batch, count = buf, n
        buf, n = {}, 0
        for i = 1, count do
            spill(batch[i])
        end
        return
    end
    if flushing then
        return
    end
    local batch, count = buf, n
    buf, n = {}, 0
    local d = ngx.shared[DICT]
    if d then
        while count < _M.MAX_BUFFER do
            local v = d:rpop(SPILL)
            if not v then
                break
            end
            local e = cjson.decode(v)
            if type(e) == "table" then
                count = count + 1
                batch[count] = e
            end
        end
    end
    if count == 0 then
        return
    end
    flushing = true
    local from = 1
    while from <= count do
        local to = from + _M.CHUNK - 1
        if to > count then
            to = count
        end
        local chunk, k = batch, count
        if from > 1 or to < count then
            chunk, k = {}, to - from + 1
            for i = 1, k do
                chunk[i] = batch[from + i - 1]
            end
        end
        local ok, res = pcall(send, chunk, k)
        if not ok then
            dropped("redis-error", count - from + 1)
            warn("flush failed", res)
            break
        end
        if res ~= true then
            -- Redis is down or failed: the rest of this flush is dropped alike, as one
            -- pipeline for the whole buffer would have been
            if to < count then
                dropped(res, count - to)
            end
            break
        end
        from = to + 1
        if from <= count then
            -- the worker serves its requests before the next chunk is built
            sleep(0)
        end
    end
    flushing = false
end

--- start(): init_worker; one flush timer per worker
function _M.start()
    local ok, err = ngx.timer.every(_M.INTERVAL_S, _M.flush)
    if not ok then
        ngx.log(ngx.ERR, "kvgate request log: cannot start the flush timer: ", err)
    end
end

--- pending() -> entries buffered in this worker (tests, debugging)
function _M.pending()
    return n
end

return _M
