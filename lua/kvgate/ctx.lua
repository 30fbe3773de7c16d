-- The request context: one table, ngx.ctx.kvgate, with one sub-table per stage.
--
--   local kctx = require("kvgate.ctx").get()
--   kctx.tenant    auth stage: id, scope (the cache scope), models (allowed set | nil = all);
--                  empty with gateway.auth off
--   kctx.batch     auth stage: {id = batch id, line = line index} for a Batch API line (a
--                  verified X-Kvgate-Batch), nil otherwise
--   kctx.req       request stage: endpoint, the parsed request, rejected (status of a refusal)
--   kctx.limit     limit stage: the request's buckets, how they were checked, the answer's tail
--   kctx.admission admission stage: the pool whose slot the request holds, or waits for
--   kctx.route     route-key stage: key, kind, pool, fp (prefix fingerprint), endpoint, shared
--   kctx.cache     cache stage: outcome (HIT|MISS|BYPASS), reason, key, capture state
--   kctx.warm      warm-up sampling: the prefix document kept for the request log
--   kctx.balancer  the balancer's own state across the tries of one request (node = chosen
--                  node id, home = the key's home node id)
--   kctx.log       log stage: what only the log phase reads (in-flight key, stream guard)
--
-- No module reads or writes a bare ngx.ctx field but this one.
--
-- An internal redirect (error_page … = @kvgate_upstream_error, ngx.exec to /kvgate/errors/408)
-- gives the request a fresh ngx.ctx (lua-nginx-module: "internal redirects will destroy the
-- original request ngx.ctx data"); nginx variables survive it. So stash() keeps the context
-- in a per-worker table under a small integer (a request stays in its worker across a
-- redirect) and writes only that integer to $kvgate_ctx; restore() in the error location
-- takes it back. release() in the log phase (which runs once per request, also after a
-- redirect or a client abort) drops the reference, so the table holds only requests in
-- flight. The same shape as lua-resty-ctxdump (used by APISIX for the same purpose).
local ngx = ngx
local tonumber = tonumber
local pairs = pairs

local _M = {}

-- the nginx variable (`set $kvgate_ctx "";` in the client locations)
_M.VAR = "kvgate_ctx"

local held = {} -- per worker: ref -> context, from stash() to release()
local last_ref = 0
local MAX_REF = 2 ^ 30

local function new()
    return {
        tenant = {},
        req = {},
        limit = {},
        admission = {},
        route = {},
        cache = {},
        warm = {},
        balancer = {},
        log = {},
    }
end

--- get() -> the request's context (created on first use)
function _M.get()
    local c = ngx.ctx
    local k = c.kvgate
    if k == nil then
        k = new()
        c.kvgate = k
    end
    return k
end

--- peek() -> the request's context, or nil when no stage made one (no table is created)
function _M.peek()
    return ngx.ctx.kvgate
end

--- stash(kctx): keep the context across an internal redirect ($kvgate_ctx = its ref); once
-- per request, before anything can redirect (the access phase)
function _M.stash(kctx)
    if kctx.ref then
        return
    end
    local ref = last_ref + 1
    if ref > MAX_REF then
        ref = 1
    end
    last_ref = ref
    held[ref] = kctx
    kctx.ref = ref
    ngx.var[_M.VAR] = ref
end

--- restore() -> the context stashed before an internal redirect (now ngx.ctx.kvgate again),
-- or the current one, or nil when none was made or stashed
function _M.restore()
    local c = ngx.ctx
    local k = c.kvgate
    if k ~= nil then
        return k
    end
    local ref = tonumber(ngx.var[_M.VAR])
    k = ref and held[ref]
    if k then
        c.kvgate = k
        return k
    end
    return nil
end

--- release(kctx): the request is over (log phase): drop the stash reference
function _M.release(kctx)
    local ref = kctx and kctx.ref
    if ref then
        if held[ref] == kctx then
            held[ref] = nil
        end
        kctx.ref = nil
    end
end

--- held_count() -> contexts stashed and not released in this worker (tests, leak checks)
function _M.held_count()
    local n = 0
    for _ in pairs(held) do
        n = n + 1
    end
    return n
end

return _M
