-- Mid-stream node failure → an SSE error event, never a silent truncation. PURE.
--
-- When a node dies or times out after the headers of a streamed response were sent,
-- nginx 1.22 (ngx_http_upstream_finalize_request with a status >= 300 and
-- header_sent) can only close the connection; before that it sends a FLUSH special
-- buffer, which the body filter sees as ngx.arg[1] == "" with ngx.arg[2] == false.
-- Ordinary streams see such empty non-eof calls too (the non-buffered proxy flushes
-- with nothing new), so the caller tells them apart by the upstream state: only at
-- finalization is $upstream_response_time filled in for the last node (it reads "-"
-- while the node is still sending). See docs/gateway.md, Streaming errors.
--
-- The filter passes only whole SSE events (up to a blank line) and holds back a trailing
-- partial event until the rest arrives (at most MAX_HOLD bytes; past that, data passes
-- as it comes), so the error event never lands inside a half-sent event. A node writes
-- one event at a time, so almost every chunk ends on an event boundary and passes
-- untouched.
local cjson = require "cjson.safe"

local find = string.find
local sub = string.sub

local _M = {}

_M.MAX_HOLD = 1024 * 1024

--- new() -> per-response state
function _M.new()
    return { done = false, tail = nil, mid = false }
end

--- error_event(node[, message, code]) -> the SSE event sent in place of the missing rest of
-- the stream (OpenAI's streaming error shape: the openai client raises APIError on it).
-- message, code: default to a failed node's ("node N failed mid-stream; …", "upstream_failed").
function _M.error_event(node, message, code)
    return "data: " .. cjson.encode({
        error = {
            message = message or ("node " .. tostring(node) .. " failed mid-stream; the response is incomplete"),
            type = "server_error",
            param = cjson.null,
            code = code or "upstream_failed",
        },
    }) .. "\n\n"
end

_M.SHUTDOWN_MESSAGE = "the gateway is reloading and this stream outlived its grace " ..
    "(gateway.worker_shutdown_timeout_s); the response is incomplete"

--- cut(st, sent) -> the data to send in place of the chunk: the stream's last
-- sent: what goes out for this chunk after step() (its out, or the chunk when out is nil).
-- The partial event held back is dropped and the error event ends the stream; the caller
-- sets eof. Nil when the stream already ended ([DONE] seen or an error event sent).
function _M.cut(st, sent)
    if st.done or st.failed then
        return nil
    end
    st.failed = true
    st.tail = nil
    return (sent or "") .. (st.mid and "\n\n" or "") .. _M.error_event(nil, _M.SHUTDOWN_MESSAGE, "gateway_shutdown")
end

local function ends_event(s)
    return sub(s, -2) == "\n\n" or sub(s, -4) == "\r\n\r\n"
end

-- last_boundary(s) -> index of the last byte of the last blank line in s, or nil
local function last_boundary(s)
    local last, pos = nil, 1
    while true do
        local i = find(s, "\n\n", pos, true)
        if not i then
            break
        end
        last, pos = i + 1, i + 1
    end
    pos = last or 1
    while true do
        local i = find(s, "\r\n\r\n", pos, true)
        if not i then
            break
        end
        if not last or i + 3 > last then
            last = i + 3
        end
        pos = i + 1
    end
    return last
end

local function saw_done(s)
    -- at the start of a line only: inside a JSON string a newline is escaped
    return find(s, "^data: ?%[DONE%]") ~= nil or find(s, "\ndata: ?%[DONE%]") ~= nil
end

--- step(st, chunk, eof, upstream_finished, node) -> out, failed
-- out: the data to send instead of chunk (nil: send chunk unchanged);
-- failed: true when the error event was emitted (count it).
-- upstream_finished: the node's response is over (read only for an empty non-eof call).
function _M.step(st, chunk, eof, upstream_finished, node)
    if chunk == "" and not eof then
        if upstream_finished and not st.done and not st.failed then
            -- the node failed: drop the partial event held back, say what happened
            st.failed = true
            st.tail = nil
            return (st.mid and "\n\n" or "") .. _M.error_event(node), true
        end
        return nil, false
    end
    local s = chunk
    if st.tail then
        s = st.tail .. chunk
        st.tail = nil
    end
    if not st.done and saw_done(s) then
        st.done = true
    end
    if eof or ends_event(s) then
        st.mid = false
        if s == chunk then
            return nil, false
        end
        return s, false
    end
    local b = last_boundary(s)
    if not b then
        if #s > _M.MAX_HOLD then
            -- a single event this large: pass it on as it comes
            st.mid = true
            return s, false
        end
        st.tail = s
        return "", false
    end
    st.tail = sub(s, b + 1)
    st.mid = false
    return sub(s, 1, b), false
end

return _M
