-- A worker's graceful shutdown (reload or quit) and the streams it still carries.
--
-- nginx lets an old worker finish its requests for worker_shutdown_timeout, then closes
-- every connection it still has: a stream cut there loses its tail with no error event, no
-- [DONE] and an unterminated chunked body. kvgate never lets it come to that:
--
-- * the policy requires worker_shutdown_timeout_s > read_timeout_s (kvgate.policy.model);
-- * a stream that still sends data `cut_after_s` = grace - read timeout - 1 s after the
--   worker began shutting down is ended by the body filter with the same OpenAI error event
--   as a failed node (kvgate.sse_guard) and a proper end of body, and counted;
-- * a stream silent at that instant ends by the read timeout, with the guard's error event,
--   before the grace runs out (it was silent since before cut_after_s, and the read timeout
--   is shorter than what is left of the grace).
--
-- Shutdown is seen from a timer: ngx_lua runs every pending timer at once, with
-- premature = true, when the worker starts its graceful shutdown (the timers' watcher is an
-- idle connection, and nginx closes idle connections first). ngx.worker.exiting() is the
-- fallback should that timer not exist.
local ngx = ngx
local now = ngx.now
local exiting = ngx.worker.exiting

local _M = {}

-- long: the timer exists only to be fired prematurely when the worker starts exiting
local WATCH_INTERVAL_S = 3600

local since -- ngx.now() when this worker began shutting down; nil while it serves

local function watch(premature)
    if premature and not since then
        since = now()
    end
end

--- start(): init_worker; arms the shutdown watch of this worker
function _M.start()
    since = nil
    local ok, err = ngx.timer.every(WATCH_INTERVAL_S, watch)
    if not ok then
        ngx.log(ngx.ERR, "kvgate: cannot start the shutdown watch (streams are cut at the grace's end): ", err)
    end
end

--- since() -> seconds (ngx.now()) at which this worker began shutting down, or nil
function _M.since()
    if not since and exiting() then
        since = now()
    end
    return since
end

--- cut_due(cut_after_s) -> true when a stream of this worker must be ended now
-- cut_after_s: seconds after the start of the shutdown (kvgate.json shutdown.cut_streams_after_s)
function _M.cut_due(cut_after_s)
    local s = since
    if not s then
        -- cheap on every chunk: one FFI call while the worker serves
        if not exiting() then
            return false
        end
        s = _M.since()
    end
    return now() - s >= (cut_after_s or 0)
end

return _M
