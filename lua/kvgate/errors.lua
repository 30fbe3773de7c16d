-- OpenAI-style error responses, sent from the access/content phases.
local cjson = require "cjson.safe"
local kvctx = require "kvgate.ctx"

local ngx = ngx
local say = ngx.print
local exit = ngx.exit

local _M = {}

--- body(message, code, param, typ) -> JSON string in OpenAI's error format
function _M.body(message, code, param, typ)
    return cjson.encode({
        error = {
            message = message,
            type = typ or "invalid_request_error",
            param = param or cjson.null,
            code = code or cjson.null,
        },
    })
end

--- send(status, message, code, param) -> does not return (ngx.exit)
-- Marks the request as rejected (kctx.req.rejected) so the log phase counts
-- kvgate_bad_requests_total.
function _M.send(status, message, code, param, typ)
    kvctx.get().req.rejected = status
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["Content-Length"] = nil
    say(_M.body(message, code, param, typ))
    if status == 408 then
        -- nginx finalizes a 408 by dropping the connection at once (it "terminates" the
        -- request), answer and all; the status is set, so finish as a sent response
        return exit(ngx.HTTP_OK)
    end
    return exit(status)
end

return _M
