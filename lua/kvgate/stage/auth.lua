-- Stage "auth" (access, first: before the body is read, so an unauthenticated client costs
-- no body read nor JSON decode): the request's tenant from its API key (kvgate.tenant).
--   gateway.auth off       nothing (kctx.tenant stays empty: the anonymous cache scope)
--   gateway.auth optional  no Authorization header -> the tenant `default`; a key must be valid
--   gateway.auth required  a valid key, always
-- Refusals, in OpenAI's format: 401 `invalid_api_key` (missing, malformed, unknown or revoked
-- key, a key of a tenant the policy no longer has, a key in the query string), 503
-- `auth_unavailable` (Redis unreachable and the key never seen valid by this worker). The
-- key is never echoed nor logged. The Authorization header is removed before the request goes
-- on: engines never see tenants' keys.
--   kctx.tenant = {id = tenant id, scope = cache scope ("t.<id>" | "g.<group>"),
--                  models = set of allowed models | nil (all), key_id = the API key's id | nil}
--
-- The batch principal (kvgate.batch_principal): a request carrying `X-Kvgate-Batch` (the
-- Batch API's worker, in every auth mode) is authenticated by that header alone: a valid one
-- makes it a request of the header's tenant (key_id nil; "" = the anonymous tenant with
-- gateway.auth off), of batch priority, with kctx.batch = {id = batch id, line = line index};
-- anything else about it (malformed, a mac not made with kvgate.json's batch_secret, expired,
-- a tenant the policy does not have, no secret rendered) is 401 invalid_api_key. The header,
-- and any key sent beside it, are removed before the upstream. A request without the header
-- pays one header read for this.
local errors = require "kvgate.errors"
local tenant = require "kvgate.tenant"
local principal = require "kvgate.batch_principal"

local ngx = ngx
local var = ngx.var
local clear_header = ngx.req.clear_header

local _M = {}

local MISSING = "You didn't provide an API key. You need to provide your API key in an Authorization " ..
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
local INCORRECT = "Incorrect API key provided. Create keys with `kvgate keys create` or on the admin page."
local MALFORMED = "The Authorization header is malformed: expected `Authorization: Bearer YOUR_KEY`."
local REVOKED = "The API key provided has been revoked."
local IN_QUERY = "API keys are not accepted in the query string (URLs end up in logs): send " ..
    "`Authorization: Bearer YOUR_KEY` instead, and revoke the key you sent."
local UNAVAILABLE = "The API key cannot be checked right now; retry in a few seconds."

local BATCH_BAD = "The X-Kvgate-Batch header is not valid (malformed, not signed by this gateway's control " ..
    "plane, expired, or for an unknown tenant)."

local function refuse(message)
    ngx.header["WWW-Authenticate"] = 'Bearer realm="kvgate"'
    return errors.send(401, message, "invalid_api_key")
end

-- batch(kctx, cfg, value): the batch principal, or 401 (the reason is not told: it would help a
-- forger; the header is never logged)
local function batch(kctx, cfg, value)
    clear_header(principal.HEADER)
    clear_header("Authorization")
    clear_header("api-key")
    clear_header("x-api-key")
    local p = principal.verify(value, cfg.batch_secret, ngx.time(), ngx.hmac_sha1)
    if not p then
        return refuse(BATCH_BAD)
    end
    local a = cfg.auth
    local kt = kctx.tenant
    if a and a.mode ~= "off" then
        local t = cfg.tenants[p.tenant]
        if not t then
            return refuse(BATCH_BAD)
        end
        kt.id = p.tenant
        kt.scope = t.scope
        kt.models = t.models
    elseif p.tenant ~= "" then
        -- gateway.auth off: only the anonymous tenant exists
        return refuse(BATCH_BAD)
    end
    kt.key_id = nil
    kctx.batch = { id = p.id, line = p.line }
end

--- access(kctx, cfg): sets kctx.tenant, or answers 401/503 and ends the request
function _M.access(kctx, cfg)
    local bh = var.http_x_kvgate_batch
    if bh ~= nil then
        return batch(kctx, cfg, bh)
    end
    local a = cfg.auth
    if not a or a.mode == "off" then
        return
    end
    if tenant.key_in_query(var.args) then
        return refuse(IN_QUERY)
    end
    -- $http_authorization: nginx itself refuses a repeated Authorization header (400)
    local token, why = tenant.bearer(var.http_authorization)
    local id, key_id
    if token then
        local found, second = tenant.resolve(cfg, token)
        if found then
            id, key_id = found, second
        else
            local terr = second
            if terr == "unavailable" then
                ngx.header["Retry-After"] = "5"
                return errors.send(503, UNAVAILABLE, "auth_unavailable", nil, "server_error")
            end
            return refuse(terr == "revoked" and REVOKED or INCORRECT)
        end
        clear_header("Authorization")
    elseif why == "missing" and a.mode == "optional" then
        id = a.default_tenant
    else
        return refuse(why == "missing" and MISSING or MALFORMED)
    end
    -- the other spellings of a client key (Azure's api-key, x-api-key) stop here too
    clear_header("api-key")
    clear_header("x-api-key")
    local t = cfg.tenants[id]
    if not t then
        -- a key whose tenant the policy no longer has
        return refuse(INCORRECT)
    end
    local kt = kctx.tenant
    kt.id = id
    kt.scope = t.scope
    kt.models = t.models
    kt.key_id = key_id
end

return _M
