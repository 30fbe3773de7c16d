-- Tenants and their API keys in the data path (issue 12; docs/tenants.md).
--
-- A client sends `Authorization: Bearer <key>`. The key's SHA-256 hex names its record in Redis
-- (kvgate.keys.apikey: a hash {id, tenant, name, created, revoked, last_used} written by the
-- control plane, control/kvgate/control/apikeys.py); the secret itself is stored nowhere and
-- never logged. Each worker keeps what Redis said about a digest in an LRU for
-- cfg.auth.cache_ttl_s (default 5 s): a revocation or a new key takes effect within that time.
-- While Redis cannot be reached, a key the worker saw valid stays valid until cfg.auth.stale_s
-- after its last successful check; a key never seen answers 503 `auth_unavailable` (nothing
-- may use a GPU on an unverified key). "Seen" is the gateway's, not the worker's: each valid
-- answer from Redis is also written to lua_shared_dict kvgate_auth (digest -> "<checked at>
-- <tenant> <key id>", TTL stale_s), so a worker that never saw the key before the outage
-- accepts it too; an answer of revoked or unknown deletes it there. One lookup per digest at
-- a time per worker: the others use the stale answer meanwhile.
--
-- last_used: each resolved key is marked in a per-worker table; a timer writes the marks every
-- few seconds in one pipeline (a script that touches only an existing record).
local lrucache = require "resty.lrucache"
local hash = require "kvgate.hash"
local keys = require "kvgate.keys"
local kredis = require "kvgate.redis"
local log = require "kvgate.log"

local ngx = ngx
local now = ngx.now
local type = type
local match = string.match
local lower = string.lower
local find = string.find
local pairs = pairs
local tostring = tostring
local format = string.format
local tonumber = tonumber

local _M = {}

_M.MAX_TOKEN = 256         -- bytes of a Bearer token (kvgate's are 47): longer is malformed
_M.CACHE_ITEMS = 10000     -- digests each worker remembers
_M.USED_FLUSH_S = 5        -- how often last_used marks go to Redis

_M.DICT = "kvgate_auth"

local cache = lrucache.new(_M.CACHE_ITEMS)
local refreshing = {}      -- digest -> true while a coroutine of this worker asks Redis
local used = {}            -- digest -> last use (s) not yet written
local nused = 0

--- bearer(value) -> token | nil, why ("missing" | "malformed")
-- value: the Authorization header (nil, a string, or a table when repeated). RFC 6750 §2.1:
-- "Bearer" (any case), one or more spaces, a b64token; a repeated header is malformed.
function _M.bearer(value)
    if value == nil then
        return nil, "missing"
    end
    if type(value) ~= "string" or #value > _M.MAX_TOKEN + 16 then
        return nil, "malformed"
    end
    local scheme, token = match(value, "^%s*(%a+) +([%w%-%._~%+/]+=*)%s*$")
    if not scheme or lower(scheme) ~= "bearer" or #token > _M.MAX_TOKEN then
        return nil, "malformed"
    end
    return token
end

-- names of query parameters that carry a credential elsewhere (OpenAI SDKs send none)
local QUERY_KEY_NAMES = { "api_key", "api-key", "apikey", "key", "access_token", "token", "auth" }

--- key_in_query(args) -> true when the query string carries an API key (a kvg- value, or a
-- parameter named like one): refused, so a key never sits in a URL (logs, proxies, history)
function _M.key_in_query(args)
    if not args or args == "" then
        return false
    end
    local a = args
    if find(a, "%", 1, true) then
        -- percent-encoded anywhere ("k%76g-", "api%5Fkey="): compared decoded
        a = ngx.unescape_uri(a)
    end
    a = lower(a)
    if find(a, "kvg-", 1, true) then
        return true
    end
    for i = 1, #QUERY_KEY_NAMES do
        local n = QUERY_KEY_NAMES[i]
        local s = find(a, n .. "=", 1, true)
        while s do
            local before = s == 1 and "&" or a:sub(s - 1, s - 1)
            if before == "&" or before == ";" or before == "?" then
                return true
            end
            s = find(a, n .. "=", s + 1, true)
        end
    end
    return false
end

-- the record's answer: {tenant = id} | {revoked = true} | {unknown = true}; `at` = checked (s)
local function fetch(cfg, digest)
    if kredis.down() then
        return nil, "the Redis breaker is open"
    end
    local replies, err = kredis.pipeline(cfg.redis, { { "hmget", keys.apikey(digest), "tenant", "revoked", "id" } })
    if not replies then
        kredis.trip()
        return nil, err
    end
    local r = replies[1]
    if type(r) ~= "table" or r[1] == false then
        return nil, "hmget: " .. tostring(r and r[2])
    end
    local tenant, revoked, id = r[1], r[2], r[3]
    if tenant == ngx.null or tenant == nil then
        return { unknown = true }
    end
    if revoked == "1" then
        return { revoked = true }
    end
    return { tenant = tenant, key_id = id ~= ngx.null and id or nil }
end

-- the gateway-wide memory of valid keys (kvgate_auth), for a Redis outage; absent dict: none
local function remember(a, digest, got)
    local d = ngx.shared[_M.DICT]
    if not d or a.stale_s <= 0 then
        return
    end
    if got.tenant then
        d:set(digest, format("%.3f %s %s", got.at, got.tenant, got.key_id or ""), a.stale_s)
    else
        d:delete(digest)
    end
end

-- the last valid answer any worker of this gateway had for digest, or nil
local function recall(digest)
    local d = ngx.shared[_M.DICT]
    local v = d and d:get(digest)
    if not v then
        return nil
    end
    local at, tenant, id = match(v, "^(%S+) (%S+) ?(%S*)$")
    if not at then
        return nil
    end
    return { tenant = tenant, key_id = id ~= "" and id or nil, at = tonumber(at) }
end

--- resolve(cfg, token) -> tenant id, key id | nil, why ("unknown" | "revoked" | "unavailable")
-- One sha256 of the token per request (~1 µs); Redis only when this worker's answer for it is
-- older than cfg.auth.cache_ttl_s.
function _M.resolve(cfg, token)
    local a = cfg.auth
    local digest = hash.sha256_hex(token)
    local entry, stale = cache:get(digest)
    if not entry then
        if stale and refreshing[digest] then
            entry = stale -- another request of this worker is asking Redis right now
        else
            refreshing[digest] = true
            local got, err = fetch(cfg, digest)
            refreshing[digest] = nil
            if not got and not (stale and stale.tenant) then
                stale = recall(digest) -- another worker saw it valid
            end
            if got then
                got.at = now()
                entry = got
                cache:set(digest, got, a.cache_ttl_s)
                remember(a, digest, got)
            elseif stale and stale.tenant and now() - stale.at <= a.stale_s then
                log.warn_every("tenant-redis", 10, "kvgate auth: Redis unreachable (", err,
                    "): keys seen valid stay valid for ", a.stale_s, " s")
                entry = stale
                -- keep answering from it without asking Redis on every request
                cache:set(digest, stale, 1)
            else
                log.warn_every("tenant-redis", 10, "kvgate auth: Redis unreachable (", err,
                    "): a key not seen before cannot be checked")
                return nil, "unavailable"
            end
        end
    end
    if entry.unknown then
        return nil, "unknown"
    end
    if entry.revoked then
        return nil, "revoked"
    end
    local t = now()
    if not used[digest] then
        nused = nused + 1
    end
    used[digest] = t
    return entry.tenant, entry.key_id
end

local TOUCH = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'last_used', ARGV[1]) end"

local function flush(premature, cfg_of)
    if nused == 0 then
        return
    end
    local cfg = cfg_of()
    if not cfg or not cfg.redis then
        return
    end
    local cmds, n = {}, 0
    for digest, ts in pairs(used) do
        n = n + 1
        cmds[n] = { "eval", TOUCH, 1, keys.apikey(digest), format("%.3f", ts) }
    end
    used, nused = {}, 0
    local ok, err = kredis.pipeline(cfg.redis, cmds)
    if not ok then
        log.warn_every("tenant-used", 30, "kvgate auth: last_used not written: ", err)
    end
end

--- init_worker(cfg_of): the last_used writer (cfg_of() -> the config in force)
function _M.init_worker(cfg_of)
    ngx.timer.every(_M.USED_FLUSH_S, flush, cfg_of)
end

--- forget(): drop this worker's answers (tests)
function _M.forget()
    cache:flush_all()
end

return _M
