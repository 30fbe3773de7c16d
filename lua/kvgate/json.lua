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

return _M
