-- The warm-up prefix document of a sampled request (kvgate.warm.sample; opt-in per pool:
-- warmup.capture_prefix_text). PURE.
--
-- build(body) builds the JSON the control plane's warm-up sends to a new node:
--   {"model": ..., "messages": [every message up to and including the first user
--    message], "tools": [...]}        ("tools" only when the request has a tools list)
-- from the raw request body, copying each value's bytes as the client sent them: key
-- order inside tool schemas and `[]` vs `{}` survive (a chat template renders tools as
-- JSON, so a re-encoded copy would tokenize differently and warm the wrong blocks).
-- The body must be valid JSON (the access phase decoded it already); the scanner only
-- finds where values start and end.
local cjson = require "cjson.safe"

local type = type
local find = string.find
local byte = string.byte
local sub = string.sub
local concat = table.concat

local _M = {}

local scan = require "kvgate.json_scan"
local skip_ws, value_end, members = scan.skip_ws, scan.value_end, scan.members
local LBRACKET, RBRACKET = 91, 93

-- each_element(s, i, fn): calls fn(first, last) for each element of the array at s[i]
-- until fn returns true; false if the array is malformed
local function each_element(s, i, fn)
    if byte(s, i) ~= LBRACKET then
        return false
    end
    local pos = skip_ws(s, i + 1)
    if pos and byte(s, pos) == RBRACKET then
        return true
    end
    while pos do
        local vend = value_end(s, pos)
        if not vend then
            return false
        end
        if fn(pos, vend) then
            return true
        end
        pos = skip_ws(s, vend + 1)
        if not pos then
            return false
        end
        if byte(s, pos) == RBRACKET then
            return true
        elseif sub(s, pos, pos) ~= "," then
            return false
        end
        pos = skip_ws(s, pos + 1)
    end
    return false
end

local function span(s, r)
    return sub(s, r[1], r[2])
end

--- build(body, max_bytes) -> JSON string | nil, reason
-- reason: "not-object" (body is not a JSON object), "no-messages" (no messages list, or
-- it is empty), "too-large" (the document would exceed max_bytes)
function _M.build(body, max_bytes)
    local start = skip_ws(body, 1)
    local top = start and members(body, start)
    if not top then
        return nil, "not-object"
    end
    local mr = top.messages
    if not mr or byte(body, mr[1]) ~= LBRACKET then
        return nil, "no-messages"
    end
    local head = '{"model":' .. (top.model and span(body, top.model) or "null") .. ',"messages":['
    local tools = top.tools and byte(body, top.tools[1]) == LBRACKET and span(body, top.tools) or nil
    local size = #head + 2 + (tools and #tools + 9 or 0)
    local parts = {}
    local too_large = false
    local ok = each_element(body, mr[1], function(first, last)
        size = size + (last - first + 1) + (#parts > 0 and 1 or 0)
        if size > max_bytes then
            too_large = true
            return true
        end
        parts[#parts + 1] = sub(body, first, last)
        local m = members(body, first)
        local role = m and m.role and cjson.decode(span(body, m.role))
        return role == "user"
    end)
    if too_large then
        return nil, "too-large"
    end
    if not ok or #parts == 0 then
        return nil, "no-messages"
    end
    local out = head .. concat(parts, ",") .. "]"
    if tools then
        out = out .. ',"tools":' .. tools
    end
    return out .. "}"
end

return _M
