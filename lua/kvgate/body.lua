-- Reading the request body in the access phase, with an idle timeout and a total deadline.
--
-- nginx's own reader (ngx.req.read_body) has only client_body_timeout, between two reads: a
-- body that trickles in a byte every few seconds is never cut, and on a timeout nginx closes
-- the connection without an answer (a 408 finalizes as "terminate", error_page cannot
-- catch it). So a Content-Length body is read here from ngx.req.socket() (it hands out what
-- nginx already read with the headers first, and answers `Expect: 100-continue`) with
-- receiveany() under min(idle timeout, time left to the deadline), then given back to nginx
-- with ngx.req.set_body_data for proxy_pass. A timeout answers 408 through an internal
-- redirect to /kvgate/errors/408, whose location has keepalive off and lingering close on: the
-- rest of the body is never read as the next request, and the client gets the answer before
-- the close.
--
-- lua-nginx-module 0.10.23's request socket refuses chunked bodies ("chunked request bodies
-- not supported yet"): those still go through ngx.req.read_body() (nginx's idle timeout, no
-- deadline, dropped without an answer on a timeout; see docs/gateway.md).
local errors = require "kvgate.errors"
local kvctx = require "kvgate.ctx"

local ngx = ngx
local var = ngx.var
local now = ngx.now
local tonumber = tonumber
local concat = table.concat
local req_socket = ngx.req.socket
local read_body = ngx.req.read_body
local get_body_data = ngx.req.get_body_data
local get_body_file = ngx.req.get_body_file
local set_body_data = ngx.req.set_body_data
local start_time = ngx.req.start_time
local exec = ngx.exec
local exit = ngx.exit

local _M = {}

_M.TIMEOUT_URI = "/kvgate/errors/408"

local DEFAULT_TIMEOUT_MS = 30000
local DEFAULT_DEADLINE_MS = 120000
local EMPTY = "The request body is empty; expected a JSON object"

local function too_large(cfg)
    return nil, 413, "Request body is larger than " .. cfg.max_body_bytes .. " bytes", "request_too_large"
end

-- nginx reads the body (chunked bodies, or a request socket refused)
local function read_buffered(cfg)
    read_body()
    local body = get_body_data()
    if not body then
        if get_body_file() then
            -- bodies are kept in memory up to max_body_bytes; a file means it was larger
            return too_large(cfg)
        end
        return nil, 400, EMPTY, "invalid_json"
    end
    return body
end

--- read(cfg) -> body | nil, status, message, code
-- status 408 (message = "idle" | "deadline"), 499 (the client went away), 400 or 413.
-- Content-Length over client_max_body_size was answered 413 by nginx before this phase.
function _M.read(cfg)
    if var.http_transfer_encoding then
        return read_buffered(cfg)
    end
    local len = tonumber(var.http_content_length)
    if not len or len <= 0 then
        return nil, 400, EMPTY, "invalid_json"
    end
    local sock = req_socket()
    if not sock then
        return read_buffered(cfg)
    end
    local idle = cfg.client_body_timeout_ms or DEFAULT_TIMEOUT_MS
    local deadline = start_time() + (cfg.client_body_deadline_ms or DEFAULT_DEADLINE_MS) / 1000
    local first, parts, n, got = nil, nil, 0, 0
    while got < len do
        local left = (deadline - now()) * 1000
        if left < 1 then
            return nil, 408, "deadline"
        end
        sock:settimeout(left < idle and left or idle)
        local data, err = sock:receiveany(len - got)
        if not data then
            if err == "timeout" then
                return nil, 408, (deadline - now()) * 1000 < 1 and "deadline" or "idle"
            end
            return nil, 499, err
        end
        got = got + #data
        n = n + 1
        if n == 1 then
            first = data
        else
            if n == 2 then
                parts = { first }
            end
            parts[n] = data
        end
    end
    local body = n == 1 and first or concat(parts, "", 1, n)
    set_body_data(body)
    return body
end

--- reject(status, message, code) -> does not return: the answer for a failed read
function _M.reject(status, message, code)
    if status == 408 then
        -- not errors.send here: this connection must close (see the top of this file)
        return exec(_M.TIMEOUT_URI, message == "deadline" and "why=deadline" or "why=idle")
    end
    if status == 499 then
        -- nobody to answer; counted as a rejected request
        kvctx.get().req.rejected = 499
        return exit(499)
    end
    return errors.send(status, message, code)
end

--- timeout_message(cfg, why) -> the 408's message
function _M.timeout_message(cfg, why)
    if why == "deadline" then
        return "The request body did not arrive within " ..
            ((cfg.client_body_deadline_ms or DEFAULT_DEADLINE_MS) / 1000) .. " s"
    end
    return "The request body stopped arriving: nothing for " ..
        ((cfg.client_body_timeout_ms or DEFAULT_TIMEOUT_MS) / 1000) .. " s"
end

return _M
