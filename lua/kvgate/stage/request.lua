-- Stage "request" (access, first): method, Content-Type, the body (read under an idle timeout
-- and a deadline), its JSON and shape (kvgate.request), the model's pool. A request this
-- stage refuses is answered here (OpenAI's error format) and reaches no other stage.
--   kctx.req   = {endpoint = "chat"|"completions"|"embeddings", body = raw body, parsed = decoded table}
--   kctx.route = {pool = pool name, pool_cfg = the pool of kvgate.json, endpoint}
local errors = require "kvgate.errors"
local body_reader = require "kvgate.body"
local request = require "kvgate.request"

local ngx = ngx
local var = ngx.var
local get_method = ngx.req.get_method
local type = type
local lower = string.lower
local match = string.match

local _M = {}

_M.ENDPOINTS = {
    ["/v1/chat/completions"] = "chat",
    ["/v1/completions"] = "completions",
    ["/v1/embeddings"] = "embeddings",
}
local ENDPOINTS = _M.ENDPOINTS

local function is_json(ct)
    if type(ct) ~= "string" then
        return false
    end
    -- the common spelling without lower() or a pattern
    if ct == "application/json" then
        return true
    end
    ct = lower(ct)
    return match(ct, "^%s*application/json%s*$") ~= nil or match(ct, "^%s*application/json%s*;") ~= nil
end

--- access(kctx, cfg): validate; answers (and ends the request) when the request is refused
function _M.access(kctx, cfg)
    local uri = var.uri
    -- the location regex admits only these URIs
    local endpoint = ENDPOINTS[uri]
    if get_method() ~= "POST" then
        ngx.header["Allow"] = "POST"
        return errors.send(405, "Use POST for " .. uri, "method_not_allowed")
    end
    if not is_json(var.content_type) then
        return errors.send(400, "Content-Type must be application/json", "invalid_content_type")
    end
    -- under an idle timeout and a total deadline (408); then UTF-8, JSON, model and prompt
    -- shape (400): a refused body reaches neither a node nor the cache
    local body, status, berr, bcode = body_reader.read(cfg)
    if not body then
        return body_reader.reject(status, berr, bcode)
    end
    local req, verr, vparam, vcode = request.parse(body, endpoint)
    if not req then
        return errors.send(400, verr, vcode, vparam)
    end
    local model = req.model
    local pool_name = cfg.models[model]
    local allowed = kctx.tenant.models
    if allowed and not allowed[model] then
        -- the tenant may not use it: answered as an unknown model (other tenants' models stay unseen)
        pool_name = nil
    end
    if not pool_name then
        return errors.send(404, "The model `" .. model .. "` does not exist", "model_not_found", "model")
    end
    local r = kctx.req
    r.endpoint = endpoint
    r.body = body
    r.parsed = req
    local route = kctx.route
    route.pool = pool_name
    route.pool_cfg = cfg.pools[pool_name]
    route.endpoint = endpoint
end

return _M
