-- reqlog.flush(): a buffer larger than reqlog.CHUNK goes out in several pipelines, in order,
-- with the event loop let through (ngx.sleep(0)) between two; a pipeline that fails drops
-- the rest of the flush as one pipeline would have. Stand-ins for ngx, the config and Redis.
local H = dofile("tests/lua/helper.lua")

local function fake_dict()
    local store = {}
    return {
        store = store,
        incr = function(_, k, v, init)
            store[k] = (store[k] or init) + v
            return store[k], nil, false
        end,
        get = function(_, k) return store[k] end,
        rpop = function() return nil end,
    }
end

local metrics_dict = fake_dict()
local sleeps = 0
_G.ngx = { shared = { kvgate_metrics = metrics_dict, kvgate_reqlog = fake_dict() },
           log = function() end, WARN = 4, ERR = 3,
           worker = { exiting = function() return false end },
           sleep = function(s) sleeps = sleeps + 1; assert(s == 0) end }
local pipelines, fail_at = {}, nil
package.loaded["kvgate.config"] = { get = function() return { redis = {}, pools = {} } end }
package.loaded["kvgate.redis"] = {
    down = function() return false end,
    trip = function() end,
    pipeline = function(_, cmds)
        pipelines[#pipelines + 1] = cmds
        if fail_at and #pipelines == fail_at then
            return nil, "pipeline: closed"
        end
        local replies = {}
        for i = 1, #cmds do
            replies[i] = "1-0"
        end
        return replies
    end,
}
local reqlog = require "kvgate.reqlog"

local function entry(i)
    return { ts = 1764640000 + i / 1000, pool = "p1", node = "n1", status = 200, cache = "MISS",
             kind = "prefix", fp = string.rep("a", 64), key = "0123456789abcdef", ms = i % 7,
             point = 12345, tries = 1, home = "n1" }
end

local function metric(name, reason)
    local k = name .. (reason and ('{reason="' .. reason .. '"}') or "{}")
    return metrics_dict.store[k] or 0
end

local function reset()
    pipelines, sleeps, fail_at = {}, 0, nil
    for k in pairs(metrics_dict.store) do
        metrics_dict.store[k] = nil
    end
end

H.test("a buffer over CHUNK entries is sent in order, CHUNK at a time, yielding between", function()
    reset()
    local total = 2 * reqlog.CHUNK + 88
    for i = 1, total do
        reqlog.record(entry(i))
    end
    H.eq(reqlog.pending(), total)
    reqlog.flush(false)
    H.eq(reqlog.pending(), 0)
    H.eq(#pipelines, 3)
    H.eq(sleeps, 2)
    -- every entry's XADD once, in the order recorded (ms = i % 7 tells them apart)
    local seen = 0
    for _, cmds in ipairs(pipelines) do
        local xadds = 0
        for _, c in ipairs(cmds) do
            if type(c) == "string" and c:find("xadd", 1, true) then
                seen = seen + 1
                xadds = xadds + 1
                local ms = c:match("\r\n%$2\r\nms\r\n%$%d+\r\n(%d+)\r\n")
                H.eq(tonumber(ms), seen % 7, "entry " .. seen)
            end
        end
        H.truthy(xadds <= reqlog.CHUNK)
    end
    H.eq(seen, total)
    H.eq(metric("kvgate_request_log_written_total"), total)
    H.eq(metric("kvgate_request_log_dropped_total", "redis-error"), 0)
end)

H.test("a small buffer is still one pipeline, without a yield", function()
    reset()
    for i = 1, 5 do
        reqlog.record(entry(i))
    end
    reqlog.flush(false)
    H.eq(#pipelines, 1)
    H.eq(sleeps, 0)
    H.eq(metric("kvgate_request_log_written_total"), 5)
end)

H.test("a failed pipeline drops the rest of the flush as redis-error", function()
    reset()
    fail_at = 2
    local total = 3 * reqlog.CHUNK
    for i = 1, total do
        reqlog.record(entry(i))
    end
    reqlog.flush(false)
    H.eq(#pipelines, 2) -- nothing more is tried once Redis failed
    H.eq(metric("kvgate_request_log_written_total"), reqlog.CHUNK)
    H.eq(metric("kvgate_request_log_dropped_total", "redis-error"), total - reqlog.CHUNK)
end)

H.done()
