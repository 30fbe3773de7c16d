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

local _M = {}

_M.MAX_SESSION_BYTES = 256

--- check_session(v) -> true | false, reason
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
    local p = req.prompt
    return type(p) == "string" or (type(p) == "table" and #p > 0)
end

--- compute(req, endpoint, headers, pool, fallback, kind_only) -> key, kind, nil, shared_only | nil, nil, err
-- headers: name -> string | list of strings (read only if the affinity has "session");
-- pool = {affinity=..., session_header=..., prefix_chars=...}. kind_only (for balancers
-- that do not read the key): the session header is still validated and the kind still
-- reported, but the prefix is not hashed — key is "" for kind "prefix".
function _M.compute(req, endpoint, headers, pool, fallback, kind_only)
    local affinity = pool.affinity
    for i = 1, #affinity do
        local src = affinity[i]
        if src == "session" then
            local v = headers[pool.session_header]
            if type(v) == "table" then
                -- repeated header: the first value routes, but every value is forwarded,
                -- so each must be valid
                for j = 2, #v do
                    local ok, why = _M.check_session(v[j])
                    if not ok then
                        return nil, nil, pool.session_header .. " header " .. why
                    end
                end
                v = v[1]
            end
            if type(v) == "string" and v ~= "" then
                local ok, why = _M.check_session(v)
                if not ok then
                    return nil, nil, pool.session_header .. " header " .. why
                end
                return "s:" .. v, "session"
            end
        elseif src == "user" then
            local u = req.user
            if type(u) == "string" and u ~= "" then
                return "u:" .. u, "user"
            end
        elseif src == "prefix" then
            if kind_only then
                if has_prompt(req, endpoint) then
                    return "", "prefix"
                end
            else
                local k, shared_only = _M.prefix_key(req, endpoint, pool.prefix_chars)
                if k then
                    return "p:" .. k, "prefix", nil, shared_only
                end
            end
        end
    end
    return fallback, "fallback"
end

return _M
