-- Logging helpers shared by the data path.
--
-- warn_every: a warning that every request could trigger (a misconfigured pool, Redis down)
-- is logged at most once per interval across all workers: the first worker to add the key
-- to the shared dict kvgate_state (with the interval as its expiry) logs, the others do not.
local ngx = ngx
local shared = ngx.shared
local log = ngx.log
local WARN = ngx.WARN

local _M = {}

local DICT = "kvgate_state"
local PREFIX = "warned:"

--- warn_every(key, interval_s, ...) -> true when this call logged the warning
-- key: what the warning is about ("cache:get", "sentinel:<pool>"); ...: the message parts
-- (ngx.log's). Without the shared dict (a stripped-down config) every call logs.
function _M.warn_every(key, interval_s, ...)
    local d = shared[DICT]
    if d then
        local ok = d:add(PREFIX .. key, true, interval_s)
        if not ok then
            return false
        end
    end
    log(WARN, ...)
    return true
end

return _M
