-- Route key: first present of the pool's affinity sources. PURE.
-- Input: decoded request table, the request headers (ngx.req.get_headers(): repeated
-- headers as a list; its metatable makes lookups case-insensitive), the pool's config.
-- Output: key, kind ("session"|"user"|"prefix"|"fallback") or nil, nil, err for a
-- bad session header (→ 400). Kinds are prefixed into the key ("s:", "u:", "p:")
-- so a user id can never collide with a session id.
local prompt = require "kvgate.prompt"
local hash = require "kvgate.hash"

local type = type
local find = string.find
local match = string.match
local lower = string.lower
local byte = string.byte
local sub = string.sub
local ipairs = ipairs
local pairs = pairs

local _M = {}

_M.MAX_SESSION_BYTES = 256

-- What clients send when they have no id: str(None) "None", String(undefined)
-- "undefined", String(null) / JSON "null", Ruby/Lua "nil", Go's "<nil>", String(NaN),
-- glibc printf("%s", NULL) "(null)", C++ "nullptr", String({}) "[object Object]", and a
-- JSON-encoded null/undefined sent as a string ("\"null\"").
-- Taken as ids they give every request one key, so one node (issue 9).
-- value (lowercased, trimmed) -> the metric's `value` label (bounded: a fixed word each)
local SENTINELS = {
    ["null"] = "null", ["undefined"] = "undefined", ["none"] = "none",
    ["nil"] = "nil", ["<nil>"] = "nil", ["nan"] = "nan",
    ["(null)"] = "null", ["nullptr"] = "null", ['"null"'] = "null", ['"undefined"'] = "undefined",
    ["[object object]"] = "object",
}
-- no sentinel word is longer; a longer value is a sentinel only if it is all blanks
local SENTINEL_MAX_BYTES = 16
-- first bytes a sentinel can start with (n N u U < ( " [ ...) and the blanks of %s (BLANK)
local BLANK = "blank"
local SENTINEL_FIRST = {}
local SENTINEL_LEN = {}
for w in pairs(SENTINELS) do
    SENTINEL_FIRST[byte(w)] = true
    SENTINEL_FIRST[byte(string.upper(w))] = true
    SENTINEL_LEN[#w] = true
end
for _, c in ipairs({ " ", "\t", "\n", "\v", "\f", "\r" }) do
    SENTINEL_FIRST[byte(c)] = BLANK
end

--- sentinel(v) -> label ("null", "undefined", "none", "nil", "nan", "object", "empty") when the
-- string v is a placeholder for "no id" (case-insensitive, blanks around ignored;
-- "" and whitespace-only are "empty"), else nil
function _M.sentinel(v)
    local n = #v
    if n == 0 then
        return "empty"
    end
    if not SENTINEL_FIRST[byte(v, 1)] then
        -- most ids: one byte read, nothing built
        return nil
    end
    if n > SENTINEL_MAX_BYTES then
        -- anchored: a real id fails at its first non-blank byte
        return find(v, "^%s+$") and "empty" or nil
    end
    local t = v
    if SENTINEL_FIRST[byte(v, 1)] == BLANK or SENTINEL_FIRST[byte(v, n)] == BLANK then
        t = match(v, "^%s*(.-)%s*$")
        if t == "" then
            return "empty"
        end
    end
    -- lengths of the sentinel words: most short ids stop here, nothing built
    if not SENTINEL_LEN[#t] then
        return nil
    end
    return SENTINELS[lower(t)]
end

--- trim_ows(v) -> v without leading/trailing spaces and tabs (RFC 9110 optional whitespace
-- around a field value; nginx strips the spaces but not the tabs). Reads two bytes of most
-- values; linear in the blanks otherwise.
function _M.trim_ows(v)
    local n = #v
    local i, j = 1, n
    local c = byte(v, 1)
    while c == 32 or c == 9 do
        i = i + 1
        c = byte(v, i)
    end
    if i > n then
        return ""
    end
    c = byte(v, j)
    while c == 32 or c == 9 do
        j = j - 1
        c = byte(v, j)
    end
    if i == 1 and j == n then
        return v
    end
    return sub(v, i, j)
end

--- check_session(v) -> true | false, reason (v already trimmed by trim_ows)
function _M.check_session(v)
    if #v > _M.MAX_SESSION_BYTES then
        return false, "longer than " .. _M.MAX_SESSION_BYTES .. " bytes"
    end
    if find(v, "[%z\1-\31\127]") then
        return false, "contains control characters"
    end
    return true
end

--- prefix_key(req, endpoint, prefix_chars) -> hex fingerprint or nil (no prompt), shared_only
-- shared_only is true when the window ends before any text of the first user
-- message: the key then covers only the system prompt/tools, which many
-- conversations share — a hot key (counted, see docs/gateway.md).
function _M.prefix_key(req, endpoint, prefix_chars)
    local p, first_user_end, first_user_start = prompt.canonical(req, endpoint, prefix_chars)
    local w = prompt.window(p, first_user_end, prefix_chars)
    if w == "" then
        return nil
    end
    local shared_only = first_user_start ~= nil and #w <= first_user_start and first_user_end > first_user_start
    return hash.sha256_hex(w), shared_only
end

-- has_prompt(req, endpoint) -> true when prefix_key() would find a prompt (same rules
-- as prompt.canonical: tools, any message object, a prompt string or a non-empty list)
local function has_prompt(req, endpoint)
    if endpoint == "chat" then
        if type(req.tools) == "table" then
            return true
        end
        local messages = req.messages
        if type(messages) == "table" then
            for i = 1, #messages do
                if type(messages[i]) == "table" then
                    return true
                end
            end
        end
        return false
    end
    local p = endpoint == "embeddings" and req.input or req.prompt
    return type(p) == "string" or (type(p) == "table" and #p > 0)
end

--- compute(req, endpoint, headers, pool, fallback, kind_only)
--   -> key, kind, nil, shared_only, session_sentinel, user_sentinel | nil, nil, err
-- headers: name -> string | list of strings (read only if the affinity has "session");
-- pool = {affinity=..., session_header=..., prefix_chars=...}. kind_only (for balancers
-- that do not read the key): the session header is still validated and the kind still
-- reported, but the prefix is not hashed — key is "" for kind "prefix".
-- A session header or `user` holding a placeholder (sentinel() above) counts as absent:
-- the next source applies, and its sentinel() label comes back (nil otherwise) so the
-- caller can count it.
function _M.compute(req, endpoint, headers, pool, fallback, kind_only)
    local affinity = pool.affinity
    local s_sentinel, u_sentinel
    for i = 1, #affinity do
        local src = affinity[i]
        if src == "session" then
            local v = headers[pool.session_header]
            if type(v) == "table" then
                -- repeated header: the first value routes, but every value is forwarded,
                -- so each must be valid
                for j = 2, #v do
                    local ok, why = _M.check_session(_M.trim_ows(v[j]))
                    if not ok then
                        return nil, nil, pool.session_header .. " header " .. why
                    end
                end
                v = v[1]
            end
            if type(v) == "string" then
                v = _M.trim_ows(v)
                local ok, why = _M.check_session(v)
                if not ok then
                    return nil, nil, pool.session_header .. " header " .. why
                end
                s_sentinel = _M.sentinel(v)
                if not s_sentinel then
                    return "s:" .. v, "session", nil, nil, nil, u_sentinel
                end
            end
        elseif src == "user" then
            local u = req.user
            if type(u) == "string" then
                u_sentinel = _M.sentinel(u)
                if not u_sentinel then
                    return "u:" .. u, "user", nil, nil, s_sentinel
                end
            end
        elseif src == "prefix" then
            if kind_only then
                if has_prompt(req, endpoint) then
                    return "", "prefix", nil, nil, s_sentinel, u_sentinel
                end
            else
                local k, shared_only = _M.prefix_key(req, endpoint, pool.prefix_chars)
                if k then
                    return "p:" .. k, "prefix", nil, shared_only, s_sentinel, u_sentinel
                end
            end
        end
    end
    return fallback, "fallback", nil, nil, s_sentinel, u_sentinel
end

return _M
