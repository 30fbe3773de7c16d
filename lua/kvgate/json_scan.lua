-- Where the values of a JSON text start and end, without decoding it (PURE): for code that
-- must copy or replace a part of a request body byte for byte (kvgate.warm.prefix_doc's
-- warm-up documents, kvgate.usage's stream_options rewrite). The text must be valid JSON (the
-- access phase decoded it already); nothing here validates it.
local cjson = require "cjson.safe"

local type = type
local find = string.find
local byte = string.byte
local sub = string.sub

local _M = {}

local QUOTE, BSLASH = 34, 92
local LBRACE, RBRACE, LBRACKET, RBRACKET = 123, 125, 91, 93

function _M.skip_ws(s, i)
    return find(s, "[^ \t\r\n]", i)
end

--- value_end(s, i) -> index of the last byte of the JSON value starting at s[i], or nil
function _M.value_end(s, i)
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
                q = _M.value_end(s, q)
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

--- members(s, i) -> {[key] = {first, last}} of the object starting at s[i] (last
-- duplicate wins, as in lua-cjson), or nil
function _M.members(s, i)
    if byte(s, i) ~= LBRACE then
        return nil
    end
    local out = {}
    local pos = _M.skip_ws(s, i + 1)
    if pos and byte(s, pos) == RBRACE then
        return out
    end
    while pos do
        if byte(s, pos) ~= QUOTE then
            return nil
        end
        local kend = _M.value_end(s, pos)
        if not kend then
            return nil
        end
        local key = cjson.decode(sub(s, pos, kend))
        pos = _M.skip_ws(s, kend + 1)
        if not pos or sub(s, pos, pos) ~= ":" then
            return nil
        end
        local vstart = _M.skip_ws(s, pos + 1)
        local vend = vstart and _M.value_end(s, vstart)
        if not vend then
            return nil
        end
        if type(key) == "string" then
            out[key] = { vstart, vend }
        end
        pos = _M.skip_ws(s, vend + 1)
        if not pos then
            return nil
        end
        local b = byte(s, pos)
        if b == RBRACE then
            return out
        elseif sub(s, pos, pos) ~= "," then
            return nil
        end
        pos = _M.skip_ws(s, pos + 1)
    end
    return nil
end

return _M
