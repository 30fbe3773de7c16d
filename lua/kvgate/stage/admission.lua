-- Stage "admission" (access, last: a cache hit never waits): the pool's admission queue
-- (kvgate.admission). A pool without `admission` costs one table lookup.
--   kctx.admission = {pool (a slot held), waiting (queued), interactive}
-- Priority: `X-Kvgate-Priority: interactive | batch` (default interactive); a tenant with
-- `priority: batch`, and a Batch API line (kctx.batch, the auth stage), are batch whatever they send. Refusals: 503 `overloaded` (type server_error,
-- Retry-After) when the queue is full or the wait passed queue_timeout_s; 400 for another
-- priority value.
local admission = require "kvgate.admission"
local errors = require "kvgate.errors"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"

local ngx = ngx
local var = ngx.var
local lower = string.lower
local type = type
local ceil = math.ceil
local tostring = tostring

local M = keys.METRICS

local _M = {}

local PRIORITIES = { interactive = "interactive", batch = "batch" }

--- access(kctx, cfg): holds a slot of the pool (kctx.admission), or answers 503 / 400
function _M.access(kctx, cfg)
    local route = kctx.route
    local adm = route.pool_cfg.admission
    if not adm then
        return
    end
    local prio = "interactive"
    local h = var.http_x_kvgate_priority
    if h then
        prio = type(h) == "string" and PRIORITIES[lower(h)]
        if not prio then
            return errors.send(400, "X-Kvgate-Priority must be interactive or batch", "invalid_priority")
        end
    end
    local t = kctx.tenant.id and cfg.tenants[kctx.tenant.id]
    if kctx.batch or (t and t.priority == "batch") then
        prio = "batch"
    end
    local ok, why = admission.enter(kctx.admission, route.pool, adm, prio)
    if ok then
        return
    end
    metrics.incr(M.admission_rejected, { pool = route.pool, reason = why, priority = prio })
    if why == "aborted" then
        -- nobody to answer: nginx's code for a client that closed its connection
        return ngx.exit(499)
    end
    ngx.header["Retry-After"] = tostring(ceil(why == "full" and 1 or adm.queue_timeout_s / 10))
    return errors.send(503, why == "full"
        and "The pool is overloaded and its admission queue is full; retry shortly."
        or "The pool stayed overloaded for " .. adm.queue_timeout_s .. " s while this request waited; retry later.",
        "overloaded", nil, "server_error")
end

return _M
