-- The semantic cache and static answers, gateway side (issue 15; the service: kvgate semantic,
-- docs/semantic-cache.md). Runs in the cache stage after an exact-cache MISS.
--
-- eligible(): the pool has semantic.enabled or static answers, the request is a chat completion
-- whose exact-cache key was worked out (deterministic, text only, no Cache-Control: no-store or
-- no-cache), temperature <= semantic.max_temperature, and its last message is the user's, as text,
-- of at most semantic.max_question_bytes (the embedding model reads 256 tokens: a longer message
-- would be refused by the service for its length, after an embedding paid for nothing).
-- scope(): what must match exactly before similarity is asked (the service compares only `text`,
-- the last user message):
--   sha256 of the digest form (kvgate.cache_key.digest_form) of
--   {kind = "semantic", tenant = the tenant's cache scope (or cfg.tenant), cred = the credential
--    digest the exact key has, endpoint, req = the request without `messages` and the transport
--    fields (model, tools, every sampling parameter), before = every message but the last,
--    ns = the cache namespace version in force, kv = the pool's knowledge_version in force,
--    embed = the embedding model}
-- static_scope(): sha256 of "static\n<pool>\n<knowledge_version>\n<embedding model>" (the
-- operator's answers, for every tenant of the pool), asked only for a single user turn
-- (optionally after system messages).
-- lookup(): POST /lookup to semantic_service.listen over a cosocket with the pool's hard
-- timeout_ms for the whole call (connect, send, read); any error or timeout is a MISS (counted,
-- never a 5xx). A semantic hit names the exact-cache entry of the cached question: it is read
-- from Redis and replayed like an exact hit (kvgate.cache.serve: SSE or JSON), with
-- X-Kvgate-Cache: SEMANTIC and X-Kvgate-Similarity; a static hit is built here in OpenAI's
-- chat.completion shape (X-Kvgate-Cache: STATIC).
-- insert(): after the exact entry of an eligible request was written (kvgate.cache's flush
-- timer), POST /insert {pool, scope, text, entry, ttl_s, tags}.
local cjson = require "cjson.safe"
local cache_key = require "kvgate.cache_key"
local hash = require "kvgate.hash"
local kredis = require "kvgate.redis"
local metrics = require "kvgate.metrics"
local config = require "kvgate.config"
local prompt = require "kvgate.prompt"
local klog = require "kvgate.log"
local keys = require "kvgate.keys"

local ngx = ngx
local type = type
local pairs = pairs
local tostring = tostring
local tonumber = tonumber
local now = ngx.now
local find = string.find
local sub = string.sub
local match = string.match
local lower = string.lower
local gmatch = string.gmatch
local format = string.format
local concat = table.concat
local max = math.max
local floor = math.floor

local _M = {}

_M.LOOKUPS = "kvgate_semantic_lookups_total"
_M.LATENCY = "kvgate_semantic_lookup_seconds"
_M.REJECTED = "kvgate_semantic_guard_rejections_total"
_M.INSERTS = "kvgate_semantic_inserts_total"
_M.TAG_PREFIX = keys.TAG_PREFIX     -- a set per tag of the exact-cache keys that carry it
_M.TAGS_HEADER = "x-kvgate-cache-tags"
_M.MAX_TAGS = 8
_M.MAX_TAG_BYTES = 64
_M.INSERT_TIMEOUT_MS = 1000
_M.MAX_RESPONSE_BYTES = 65536
_M.KEEPALIVE_S = 60
_M.POOL_SIZE = 32

metrics.FAMILIES[_M.LOOKUPS] = { "counter",
    "Semantic-cache lookups after an exact-cache miss, by pool and result: semantic (a paraphrase's answer "
    .. "served), static (an FAQ answer), miss, rejected (a candidate refused by a guard), stale (the named "
    .. "entry is gone), long (the last user message over max_question_bytes: not asked), timeout, error (the service unreachable or a bad answer: served as a miss)." }
metrics.FAMILIES[_M.REJECTED] = { "counter",
    "Semantic candidates above the threshold refused by a guard (number, date, identifier, negation ...), by pool." }
metrics.FAMILIES[_M.INSERTS] = { "counter",
    "Semantic entries sent to the service after their exact entry was stored, by pool and result (ok, error)." }
metrics.FAMILIES[_M.LATENCY] = { "histogram",
    "Time of one semantic lookup at the service as the gateway saw it (seconds), by pool." }

local WARN_INTERVAL_S = 10
local HIT_HEADERS = { semantic = "SEMANTIC", static = "STATIC" }

-- ---------------------------------------------------------------- eligibility and scopes (pure)

--- tags(headers) -> list of tags | nil: X-Kvgate-Cache-Tags, comma-separated (every header of
-- that name), each trimmed, 1-64 bytes of [%w_.:/-], at most MAX_TAGS; others are dropped
function _M.tags(headers)
    local v = headers[_M.TAGS_HEADER]
    if v == nil then
        return nil
    end
    if type(v) == "table" then
        v = concat(v, ",")
    end
    local out, seen = {}, {}
    for t in gmatch(v, "[^,]+") do
        t = match(t, "^%s*(.-)%s*$")
        if t ~= "" and #t <= _M.MAX_TAG_BYTES and not find(t, "[^%w_.:/%-]") and not seen[t] then
            seen[t] = true
            out[#out + 1] = t
            if #out >= _M.MAX_TAGS then
                break
            end
        end
    end
    return out[1] and out or nil
end

--- last_user_text(req) -> text of the last message when it is the user's and text only | nil
function _M.last_user_text(req)
    local msgs = req.messages
    if type(msgs) ~= "table" then
        return nil
    end
    local last = msgs[#msgs]
    if type(last) ~= "table" or last.role ~= "user" then
        return nil
    end
    if prompt.has_non_text(last.content) then
        return nil
    end
    local text = prompt.content_text(last.content)
    if type(text) ~= "string" or text == "" then
        return nil
    end
    return text
end

--- single_turn(req) -> true when the request is one user message, optionally after system (or
-- developer) messages: the only shape a static answer is given to (a follow-up never is)
function _M.single_turn(req)
    local msgs = req.messages
    for i = 1, #msgs - 1 do
        local m = msgs[i]
        local role = type(m) == "table" and m.role
        if role ~= "system" and role ~= "developer" then
            return false
        end
    end
    return true
end

--- static_applies(scfg, req, endpoint) -> true when a static answer could be given to the
-- request: the pool has static answers and the request is an eligible single-turn chat. Such a
-- request's engine answer is stored in the exact cache only after the static lookup ran and
-- missed (kctx.cache.static_unchecked; kvgate.cache), or the stored answer would shadow the
-- operator's static answer for cache.ttl_s whenever the lookup was skipped (Cache-Control:
-- no-cache, a single-flight wait that timed out) or failed (the service down or slow).
function _M.static_applies(scfg, req, endpoint)
    return scfg ~= nil and scfg.static == true and _M.eligible(scfg, req, endpoint) ~= nil
        and _M.single_turn(req)
end

--- eligible(scfg, req, endpoint) -> text | nil, reason: scfg the pool's semantic config
-- (kvgate.json pools[].semantic); the caller has an exact-cache MISS with its key
function _M.eligible(scfg, req, endpoint)
    if not scfg or not (scfg.enabled or scfg.static) then
        return nil, "off"
    end
    if endpoint ~= "chat" then
        return nil, "endpoint"
    end
    local t = req.temperature
    if t ~= nil and (type(t) ~= "number" or t > scfg.max_temperature) then
        return nil, "temperature"
    end
    local text = _M.last_user_text(req)
    if not text then
        return nil, "last-message"
    end
    if #text > (scfg.max_question_bytes or 2048) then
        return nil, "long"
    end
    return text
end

local TRANSPORT = { messages = true, stream = true, stream_options = true, user = true }

--- scope(req, endpoint, tenant, cred, ns, kv, embed) -> sha256 hex (see the header)
function _M.scope(req, endpoint, tenant, cred, ns, kv, embed)
    local rest = {}
    for k, v in pairs(req) do
        if not TRANSPORT[k] then
            rest[k] = v
        end
    end
    local before = {}
    local msgs = req.messages
    for i = 1, #msgs - 1 do
        before[i] = msgs[i]
    end
    local form = cache_key.digest_form({ kind = "semantic", tenant = tenant, cred = cred or cache_key.NO_CREDENTIAL,
        endpoint = endpoint, req = rest, before = before, n = #before, ns = ns, kv = kv, embed = embed })
    return hash.sha256_hex(form)
end

--- static_scope(pool, kv, embed) -> sha256 hex of "static\n<pool>\n<kv>\n<embed>"
function _M.static_scope(pool, kv, embed)
    return hash.sha256_hex("static\n" .. pool .. "\n" .. tostring(kv) .. "\n" .. embed)
end

--- knowledge_version(pool_name, scfg) -> the pool's knowledge_version in force: the runtime's
-- (pushed by `kvgate cache bump-knowledge`) when higher than kvgate.json's
function _M.knowledge_version(pool_name, scfg)
    local base = scfg and scfg.knowledge_version or 1
    local rt = config.runtime()
    local k = rt and rt.cache and rt.cache.knowledge
    local v = type(k) == "table" and tonumber(k[pool_name]) or nil
    if v and v > base then
        return v
    end
    return base
end

local function estimate_tokens(s)
    return max(1, floor(#s / 4 + 0.5))
end

--- static_completion(req, answer, prompt_text) -> chat.completion JSON text (OpenAI's shape;
-- usage estimated at 4 bytes a token, what the answer would have cost an engine)
function _M.static_completion(req, answer, prompt_text)
    local p = 0
    for _, m in pairs(req.messages) do
        if type(m) == "table" then
            local t = prompt.content_text(m.content)
            if type(t) == "string" then
                p = p + estimate_tokens(t) + 4
            end
        end
    end
    local c = estimate_tokens(answer)
    local obj = {
        id = "chatcmpl-kvgate-static-" .. sub(hash.sha256_hex(prompt_text .. "\n" .. now()), 1, 24),
        object = "chat.completion",
        created = floor(now()),
        model = req.model,
        choices = { { index = 0, message = { role = "assistant", content = answer }, finish_reason = "stop",
                      logprobs = cjson.null } },
    }
    -- usage last, as engines send it: the log phase reads a hit's usage from the entry's tail
    -- (kvgate.usage.read), whatever the answer's length
    local text = cjson.encode(obj)
    return sub(text, 1, -2) .. format(',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}',
        p, c, p + c)
end

-- ---------------------------------------------------------------- the service over a cosocket

--- parse_listen(listen) -> host, port | "unix:/path", nil
function _M.parse_listen(listen)
    if sub(listen, 1, 5) == "unix:" then
        return listen, nil
    end
    local host, port = match(listen, "^%[?([^%]]+)%]?:(%d+)$")
    return host, tonumber(port)
end

--- call(listen, path, body, timeout_ms) -> status, decoded body | nil, "timeout" | err
-- One HTTP/1.1 request on a pooled connection, the whole call within timeout_ms.
function _M.call(listen, path, body, timeout_ms)
    local host, port = _M.parse_listen(listen)
    if not host then
        return nil, "bad listen address " .. tostring(listen)
    end
    local deadline = now() + timeout_ms / 1000
    local sock = ngx.socket.tcp()
    local function left()
        return max(1, floor((deadline - now()) * 1000))
    end
    sock:settimeout(timeout_ms)
    local ok, err
    if port then
        ok, err = sock:connect(host, port, { pool = "kvgate_semantic:" .. listen })
    else
        ok, err = sock:connect(host, { pool = "kvgate_semantic:" .. listen })
    end
    if not ok then
        return nil, err
    end
    sock:settimeout(left())
    local req = "POST " .. path .. " HTTP/1.1\r\nHost: kvgate-semantic\r\nContent-Type: application/json\r\n"
        .. "Content-Length: " .. #body .. "\r\n\r\n" .. body
    ok, err = sock:send(req)
    if not ok then
        sock:close()
        return nil, err
    end
    sock:settimeout(left())
    local line
    line, err = sock:receive("*l")
    if not line then
        sock:close()
        return nil, err
    end
    local status = tonumber(match(line, "^HTTP/1%.%d (%d%d%d)"))
    if not status then
        sock:close()
        return nil, "bad status line"
    end
    local length, close
    while true do
        sock:settimeout(left())
        local h
        h, err = sock:receive("*l")
        if not h then
            sock:close()
            return nil, err
        end
        if h == "" then
            break
        end
        local name, value = match(h, "^([^:]+):%s*(.-)%s*$")
        if name then
            name = lower(name)
            if name == "content-length" then
                length = tonumber(value)
            elseif name == "connection" and lower(value) == "close" then
                close = true
            elseif name == "transfer-encoding" then
                sock:close()
                return nil, "chunked answers are not supported"
            end
        end
    end
    local data = ""
    if length and length > 0 then
        if length > _M.MAX_RESPONSE_BYTES then
            sock:close()
            return nil, "answer too large"
        end
        sock:settimeout(left())
        data, err = sock:receive(length)
        if not data then
            sock:close()
            return nil, err
        end
    elseif not length and status ~= 204 then
        close = true -- read to the end: HTTP/1.0 style
        sock:settimeout(left())
        data, err = sock:receive("*a")
        if not data then
            sock:close()
            return nil, err
        end
    end
    if close then
        sock:close()
    else
        sock:setkeepalive(_M.KEEPALIVE_S * 1000, _M.POOL_SIZE)
    end
    if data == "" then
        return status, nil
    end
    return status, cjson.decode(data)
end

local function listen_of(cfg)
    local s = cfg.semantic_service
    local l = s and s.listen
    if type(l) == "string" and l ~= "" then
        return l
    end
    -- kvgate.json rendered without it: the run dir is the nginx prefix's parent
    return "unix:" .. ngx.config.prefix() .. "../semantic.sock"
end
_M.listen_of = listen_of

-- the service's guard names (kvgate.semantic.guards.check, and "length"): the metric's `guard`
-- label is one of them or "other", so a service of another version cannot grow the label set
local GUARDS = { script = true, number = true, date = true, identifier = true, negation = true, antonym = true,
                 entity = true, substitution = true, order = true, length = true }
_M.GUARDS = GUARDS

local function count(pool, result)
    metrics.incr(_M.LOOKUPS, { pool = pool, result = result })
end

-- ---------------------------------------------------------------- the cache stage's hooks

--- lookup(kctx, cfg) -> entry JSON text of a hit (semantic or static) | nil
-- After an exact-cache MISS (kctx.cache.key, .cred set by kvgate.cache.lookup). On a hit sets
-- c.outcome = "HIT", c.label = "SEMANTIC" | "STATIC", c.similarity; on an eligible miss
-- c.sem = the insert's payload (sent once the exact entry is written). Never raises.
function _M.lookup(kctx, cfg)
    local c = kctx.cache
    local route = kctx.route
    local pool_cfg = route.pool_cfg
    local scfg = pool_cfg and pool_cfg.semantic
    if not scfg then
        return nil
    end
    local r = kctx.req
    local req = r.parsed
    local text, why = _M.eligible(scfg, req, r.endpoint)
    if not text then
        if why == "long" then
            count(route.pool, "long")
        end
        return nil
    end
    local pool = route.pool
    local kv = _M.knowledge_version(pool, scfg)
    local rt = config.runtime()
    local ns = rt and rt.cache.namespace_version or cfg.cache.namespace_version
    local scope = _M.scope(req, r.endpoint, kctx.tenant.scope or cfg.tenant, c.cred, ns, kv, scfg.model)
    local static = scfg.static and _M.single_turn(req) or false
    local semantic = scfg.enabled == true
    if static then
        -- cleared once the service has answered: its static lookup ran (kvgate.cache's store)
        c.static_unchecked = true
    end
    if semantic then
        c.sem = { pool = pool, scope = scope, text = text, ttl_s = tonumber(scfg.ttl_s) or cfg.cache.ttl_s,
                  tags = c.tags }
    end
    local body = cjson.encode({ pool = pool, scope = scope, text = text, threshold = scfg.similarity_min,
        static = static, semantic = semantic,
        static_scope = static and _M.static_scope(pool, kv, scfg.model) or nil })
    local t0 = now()
    local status, res = _M.call(listen_of(cfg), "/lookup", body, scfg.timeout_ms)
    ngx.update_time()
    metrics.observe(_M.LATENCY, { pool = pool }, now() - t0)
    if status ~= 200 or type(res) ~= "table" then
        local timeout = status == nil and res == "timeout"
        count(pool, timeout and "timeout" or "error")
        klog.warn_every("semantic:lookup", WARN_INTERVAL_S, "kvgate semantic lookup failed (served as a miss; ",
            "next warning in ", WARN_INTERVAL_S, "s): ", status or res)
        return nil
    end
    c.static_unchecked = nil
    local hit = res.hit
    if type(res.rejected) == "string" and res.rejected ~= "" then
        metrics.incr(_M.REJECTED, { pool = pool, guard = GUARDS[res.rejected] and res.rejected or "other" })
    end
    if hit == "static" and static and type(res.answer) == "string" then
        count(pool, "static")
        c.outcome = "HIT"
        c.label = "STATIC"
        c.reason = "static"
        c.sem = nil
        if type(res.similarity) == "number" then
            c.similarity = res.similarity
        end
        return _M.static_completion(req, res.answer, text)
    end
    if hit == "semantic" and semantic and type(res.entry) == "string"
        and sub(res.entry, 1, #"kvgate:resp:") == "kvgate:resp:" then
        local v = kredis.get_batched(cfg.redis, res.entry)
        if not v then
            count(pool, "stale")
            return nil
        end
        count(pool, "semantic")
        c.outcome = "HIT"
        c.label = "SEMANTIC"
        c.reason = "semantic"
        c.similarity = tonumber(res.similarity)
        c.sem = nil
        return v
    end
    count(pool, (type(res.rejected) == "string" and res.rejected ~= "") and "rejected" or "miss")
    return nil
end

--- header(c, h): the decision headers of a semantic or static hit (header filter)
function _M.header(c, h)
    if c.label then
        h["X-Kvgate-Cache"] = c.label
        if c.similarity then
            h["X-Kvgate-Similarity"] = format("%.3f", c.similarity)
        end
    end
end

--- insert(cfg, sem, entry_key): POST /insert of one stored entry (a timer: the cache's flush)
function _M.insert(cfg, sem, entry_key)
    local body = cjson.encode({ pool = sem.pool, scope = sem.scope, text = sem.text, entry = entry_key,
        ttl_s = sem.ttl_s, tags = sem.tags or cjson.empty_array })
    local status, err = _M.call(listen_of(cfg), "/insert", body, _M.INSERT_TIMEOUT_MS)
    local ok = status and status >= 200 and status < 300
    metrics.incr(_M.INSERTS, { pool = sem.pool, result = ok and "ok" or "error" })
    if not ok then
        klog.warn_every("semantic:insert", WARN_INTERVAL_S, "kvgate semantic insert failed (next warning in ",
            WARN_INTERVAL_S, "s): ", status or err)
    end
end

--- tag_commands(key, tags, ttl) -> the Redis commands that file an exact entry under its tags
-- (a set per tag, its TTL at least the entry's)
function _M.tag_commands(key, tags, ttl)
    local cmds = {}
    for i = 1, #tags do
        local k = _M.TAG_PREFIX .. tags[i]
        cmds[#cmds + 1] = { "sadd", k, key }
        cmds[#cmds + 1] = { "expire", k, ttl }
    end
    return cmds
end

return _M
