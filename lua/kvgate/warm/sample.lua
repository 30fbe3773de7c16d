-- Stage "warm" (access, after "route"; log): warm-up sampling. Which prompt prefixes are
-- kept for the warm-up of a new node (opt-in per pool: warmup.capture_prefix_text): a
-- pool+fingerprint seen a second time in a worker, then not again for SEEN_TTL_S, so a
-- one-off prefix is never stored and a hot one is not rebuilt and re-sent on every request
-- (the request log's SET is NX anyway). The document itself: kvgate.warm.prefix_doc.
--   kctx.warm = {doc = prefix document, ttl = seconds, seen = the sighting key}
local prefix_doc = require "kvgate.warm.prefix_doc"
local metrics = require "kvgate.metrics"
local keys = require "kvgate.keys"
-- pureffi: the plain resty.lrucache rehashes its key table on inserts once full (~43 µs per new
-- key at 4096 items against 0.4 µs: luajit tests/lua/bench_lrucache.lua)
local lrucache = require "resty.lrucache.pureffi"

local SKIPPED = keys.METRICS.prefix_capture_skipped

local _M = {}

_M.SEEN_TTL_S = 60
_M.SEEN_ITEMS = 4096

local seen -- per worker (init_worker)

--- init_worker(): this worker's sighting cache
function _M.init_worker()
    seen = lrucache.new(_M.SEEN_ITEMS)
end

--- access(kctx, cfg): keep the request's prefix document when its pool samples and this is
-- the second sighting of its fingerprint
function _M.access(kctx)
    local route = kctx.route
    local cap = route.pool_cfg.capture
    local fp = route.fp
    if not (cap and cap.enabled and fp) then
        return
    end
    -- Only a prefix seen again is kept: a one-off conversation never puts its text in
    -- Redis (the second sighting in this worker within SEEN_TTL_S; later ones skip).
    local sk = route.pool .. ":" .. fp
    if seen then
        local n = seen:get(sk)
        if n == nil then
            seen:set(sk, 1, _M.SEEN_TTL_S)
            return
        elseif n == "done" then
            return
        end
        seen:set(sk, "done", _M.SEEN_TTL_S)
    end
    if route.endpoint ~= "chat" then
        metrics.incr(SKIPPED, { reason = "not-chat" })
        return
    end
    local doc, why = prefix_doc.build(kctx.req.body, cap.max_bytes)
    if not doc then
        metrics.incr(SKIPPED, { reason = why })
        return
    end
    local w = kctx.warm
    w.doc = doc
    w.ttl = cap.ttl_s
    w.seen = sk
end

--- log(kctx, entry, status): hand the document to the request log (entry.cap, entry.cap_ttl),
-- unless the node refused the prompt
function _M.log(kctx, entry, status)
    local w = kctx.warm
    if not w.doc then
        return
    end
    if status < 400 then
        entry.cap = w.doc
        entry.cap_ttl = w.ttl
        return
    end
    -- a prompt the node refused is no warm-up material; let the next one try
    metrics.incr(SKIPPED, { reason = "error-status" })
    if seen and w.seen then
        seen:delete(w.seen)
    end
end

return _M
