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

local QUOTE, BSLASH = 34, 92
local LBRACE, RBRACE, LBRACKET, RBRACKET = 123, 125, 91, 93

local function skip_ws(s, i)
    return find(s, "[^ \t\r\n]", i)
end

-- value_end(s, i) -> index of the last byte of the JSON value starting at s[i], or nil
local function value_end(s, i)
    local c = byte(s, i)
    if c == QUOTE then
        -- the closing quote: the next one not escaped (an odd run of backslashes before it);
        -- plain find is memchr, a character class walks a 40 KB prompt byte by byte (~0.4 ms)
        local j = i + 1
        while true do
            local q = find(s, '"', j, true)
            if not q then
                return nil
            end
            local k = q - 1
            while byte(s, k) == BSLASH do
                k = k - 1
            end
            if (q - 1 - k) % 2 == 0 then
                return q
            end
            j = q + 1
        end
    elseif c == LBRACE or c == LBRACKET then
        local depth, j = 0, i
        while true do
            local q = find(s, '[%[%]{}"]', j)
            if not q then
                return nil
            end
            local b = byte(s, q)
            if b == QUOTE then
                q = value_end(s, q)
                if not q then
                    return nil
                end
            elseif b == LBRACE or b == LBRACKET then
                depth = depth + 1
            else
                depth = depth - 1
                if depth == 0 then
                    return q
                end
            end
            j = q + 1
        end
    elseif c then
        -- number, true, false, null
        local q = find(s, "[,}%] \t\r\n]", i)
        return (q or #s + 1) - 1
    end
    return nil
end

-- members(s, i) -> {[key] = {first, last}} of the object starting at s[i] (last
-- duplicate wins, as in lua-cjson), or nil
local function members(s, i)
    if byte(s, i) ~= LBRACE then
        return nil
    end
    local out = {}
    local pos = skip_ws(s, i + 1)
    if pos and byte(s, pos) == RBRACE then
        return out
    end
    while pos do
        if byte(s, pos) ~= QUOTE then
            return nil
        end
        local kend = value_end(s, pos)
        if not kend then
            return nil
        end
        local key = cjson.decode(sub(s, pos, kend))
        pos = skip_ws(s, kend + 1)
        if not pos or sub(s, pos, pos) ~= ":" then
            return nil
        end
        local vstart = skip_ws(s, pos + 1)
        local vend = vstart and value_end(s, vstart)
        if not vend then
            return nil
        end
        if type(key) == "string" then
            out[key] = { vstart, vend }
        end
        pos = skip_ws(s, vend + 1)
        if not pos then
            return nil
        end
        local b = byte(s, pos)
        if b == RBRACE then
            return out
        elseif sub(s, pos, pos) ~= "," then
            return nil
        end
        pos = skip_ws(s, pos + 1)
    end
    return nil
end

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
