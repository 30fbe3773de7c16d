-- Canonical JSON: object keys sorted (byte order), recursively, so two requests that
-- differ only in key order encode identically. PURE.
-- Limits (documented in docs/gateway.md): lua-cjson decodes `{}` and `[]` to the same
-- empty table; both encode as `{}` here. Numbers equal as doubles encode the same
-- (0 and 0.0 are one value), which matches how the engines read them.
local cjson = require "cjson.safe"

local type = type
local pairs = pairs
local sort = table.sort
local concat = table.concat
local format = string.format
local find = string.find
local match = string.match
local sub = string.sub
local byte = string.byte
local floor = math.floor
local huge = math.huge
local tostring = tostring
local tonumber = tonumber

local _M = {}

local encode_string = cjson.encode

local function is_array(t)
    local n = 0
    for k in pairs(t) do
        if type(k) ~= "number" then
            return false
        end
        n = n + 1
    end
    for i = 1, n do
        if t[i] == nil then
            return false
        end
    end
    return n > 0
end

local function number(v)
    if v ~= v or v == huge or v == -huge then
        return "null"
    end
    if floor(v) == v and v > -2^53 and v < 2^53 then
        return format("%d", v)
    end
    return format("%.17g", v)
end

local encode

encode = function(v, out)
    local t = type(v)
    if t == "string" then
        out[#out + 1] = encode_string(v)
    elseif t == "number" then
        out[#out + 1] = number(v)
    elseif t == "boolean" then
        out[#out + 1] = v and "true" or "false"
    elseif t == "table" then
        if is_array(v) then
            out[#out + 1] = "["
            for i = 1, #v do
                if i > 1 then
                    out[#out + 1] = ","
                end
                encode(v[i], out)
            end
            out[#out + 1] = "]"
        else
            local keys = {}
            for k in pairs(v) do
                keys[#keys + 1] = tostring(k)
            end
            sort(keys)
            out[#out + 1] = "{"
            for i = 1, #keys do
                local k = keys[i]
                if i > 1 then
                    out[#out + 1] = ","
                end
                out[#out + 1] = encode_string(k)
                out[#out + 1] = ":"
                local val = v[k]
                if val == nil then
                    val = v[tonumber(k)]
                end
                encode(val, out)
            end
            out[#out + 1] = "}"
        end
    else
        -- cjson.null is a lightuserdata; anything else non-JSON also becomes null
        out[#out + 1] = "null"
    end
end

--- canonical(v) -> string: JSON with sorted keys at every level
function _M.canonical(v)
    local out = {}
    encode(v, out)
    return concat(out)
end

-- Empty arrays. lua-cjson decodes `[]` to an empty table and encodes an empty table
-- as `{}`, so a response decoded and re-encoded turns `"top_logprobs":[]` into
-- `"top_logprobs":{}`, which OpenAI clients reject. Debian's lua-cjson 2.1.0 has no
-- decode_array_with_array_mt / empty_array (those are OpenResty's fork), so
-- decode_keep() replaces every empty array outside a string with the EMPTY_ARRAY
-- string before decoding, and encode_keep() writes that string back as `[]`. Only a
-- string value equal to EMPTY_ARRAY (NUL bytes included) could be mistaken for one.
local EMPTY_ARRAY = "\0kvgate-empty-array\0"
local EMPTY_JSON = encode_string(EMPTY_ARRAY)
_M.EMPTY_ARRAY = EMPTY_ARRAY

--- is_array(t) -> true when t is a non-empty sequence 1..n with no other keys (how canonical()
-- and the cache key's digest form tell a JSON array from an object)
_M.is_array = is_array

local function mark_empty_arrays(text)
    if not find(text, "%[%s*%]") then
        return text
    end
    local out, n = {}, 0
    local start, pos = 1, 1
    while true do
        local i = find(text, '["%[]', pos)
        if not i then
            break
        end
        if byte(text, i) == 34 then
            -- a string: skip to its closing quote (a `[]` inside it is text)
            local j = i + 1
            while true do
                local k = find(text, '["\\]', j)
                if not k then
                    return text -- unterminated: cjson reports the error
                end
                if byte(text, k) == 92 then
                    j = k + 2
                else
                    j = k + 1
                    break
                end
            end
            pos = j
        else
            local after = match(text, "^%[%s*%]()", i)
            if after then
                out[n + 1] = sub(text, start, i - 1)
                out[n + 2] = EMPTY_JSON
                n = n + 2
                start = after
                pos = after
            else
                pos = i + 1
            end
        end
    end
    out[n + 1] = sub(text, start)
    return concat(out)
end

--- decode_keep(text) -> value | nil, err: cjson.decode, empty arrays kept as EMPTY_ARRAY
function _M.decode_keep(text)
    return cjson.decode(mark_empty_arrays(text))
end

--- encode_keep(v) -> JSON string | nil, err: cjson.encode, EMPTY_ARRAY written as `[]`
function _M.encode_keep(v)
    local s, err = cjson.encode(v)
    if not s then
        return nil, err
    end
    if not find(s, EMPTY_JSON, 1, true) then
        return s
    end
    local out, n, pos = {}, 0, 1
    while true do
        local i, j = find(s, EMPTY_JSON, pos, true)
        if not i then
            break
        end
        out[n + 1] = sub(s, pos, i - 1)
        out[n + 2] = "[]"
        n = n + 2
        pos = j + 1
    end
    out[n + 1] = sub(s, pos)
    return concat(out)
end

return _M
