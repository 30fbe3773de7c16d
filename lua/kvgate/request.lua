-- Request body checks before anything is routed, cached or forwarded: UTF-8, JSON object
-- (strict: no NaN/Infinity/hex numbers), model, `stream` / `stream_options` types, and the
-- prompt's shape (chat `messages` and their text/image_url parts, completions `prompt`).
-- PURE: a function of the body only (in nginx the UTF-8 check of a non-ASCII body runs in
-- PCRE2, elsewhere in Lua).
-- A body these checks refuse never reaches a node nor the response cache (issue 9 item 8).
-- Errors are values: nil, message, param (OpenAI's field path, "messages[0].content"), code.
-- Messages and codes follow OpenAI's (missing_required_parameter, invalid_type, empty_array,
-- invalid_value). Deliberately lenient where the engines are: vLLM accepts custom roles
-- (Llama 3.1's `ipython`) and plain strings as content parts, and `prompt_embeds` instead of a
-- `prompt`; those pass.
local cjson = require "cjson.safe"
local ffi = require "ffi"
local bit = require "bit"

local type = type
local next = next
local floor = math.floor
local find = string.find
local band = bit.band
local bor = bit.bor
local cast = ffi.cast
local null = cjson.null

-- a private instance: NaN, Infinity and hex numbers (cjson's default accepts them) are not
-- JSON, and an engine would take them as sampling values; the shared cjson.safe is untouched
local strict = cjson.new()
strict.decode_invalid_numbers(false)
local decode = strict.decode

local _M = {}

local U8P = ffi.typeof("const uint8_t *")
local U32P = ffi.typeof("const uint32_t *")

-- Hoehrmann's UTF-8 DFA (http://bjoern.hoehrmann.de/utf-8/decoder/dfa/): byte classes
-- (0-255), then transitions (state*12 + class); 0 accepts, 12 rejects. Strict RFC 3629: no
-- overlong forms, no surrogates, nothing above U+10FFFF.
local DFA = ffi.new("const uint8_t[364]", {
    0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
    0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
    0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
    0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
    1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,
    7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,
    8,8,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,
    10,3,3,3,3,3,3,3,3,3,3,3,3,4,3,3,11,6,6,6,5,8,8,8,8,8,8,8,8,8,8,8,
    0,12,24,36,60,96,84,12,12,12,48,72, 12,12,12,12,12,12,12,12,12,12,12,12,
    12,0,12,12,12,12,12,0,12,0,12,12, 12,24,12,12,12,12,12,24,12,24,12,12,
    12,12,12,12,12,12,12,24,12,12,12,12, 12,24,12,12,12,12,12,12,12,24,12,12,
    12,12,12,12,12,12,12,36,12,36,12,12, 12,36,12,12,12,12,12,36,12,36,12,12,
    12,36,12,12,12,12,12,12,12,12,12,12,
})

-- in nginx: PCRE2's own validator (C) for the non-ASCII rest; measured 24-45 µs per 40 KB
-- against ~80 µs for the DFA below (tests/lua run the DFA)
local re_find = ngx and ngx.re and ngx.re.find

--- ascii_prefix(s) -> number of leading ASCII bytes of s (8 at a time: two 32-bit loads,
-- so no 64-bit cdata is boxed)
function _M.ascii_prefix(s)
    local n = #s
    local p = cast(U8P, s)
    local i = 0
    while i + 8 <= n do
        local q = cast(U32P, p + i)
        if band(bor(q[0], q[1]), 0x80808080) ~= 0 then
            break
        end
        i = i + 8
    end
    while i < n and p[i] < 0x80 do
        i = i + 1
    end
    return i
end

--- utf8_dfa(s, from) -> true when s is valid UTF-8 from byte offset `from` (0-based) on
function _M.utf8_dfa(s, from)
    local p = cast(U8P, s)
    local state = 0
    for i = from or 0, #s - 1 do
        state = DFA[256 + state + DFA[p[i]]]
        if state == 12 then
            return false
        end
    end
    return state == 0
end

--- valid_utf8(s) -> true | false. ASCII (what most JSON encoders send) costs ~5 µs per
-- 40 KB; cjson itself accepts any byte inside a string.
function _M.valid_utf8(s)
    local i = _M.ascii_prefix(s)
    if i == #s then
        return true
    end
    if re_find then
        -- "^" matches any valid subject; PCRE2 checks the whole subject first in UTF mode
        return re_find(s, "^", "uo") ~= nil
    end
    return _M.utf8_dfa(s, i)
end

-- JSON type of a decoded value, in words; cjson decodes `{}` and `[]` to the same table
local function kind(v)
    local t = type(v)
    if t == "table" then
        if v[1] ~= nil then
            return "array"
        end
        return next(v) == nil and "empty" or "object"
    end
    if v == null then
        return "null"
    end
    if t == "number" then
        return v == floor(v) and "integer" or "number"
    end
    return t
end

local ARTICLE = {
    string = "a string", integer = "an integer", number = "a number", boolean = "a boolean",
    null = "null", array = "an array", object = "an object", empty = "an empty array or object",
}

local function missing(param)
    return nil, "Missing required parameter: '" .. param .. "'.", param, "missing_required_parameter"
end

local function bad_type(param, expected, v)
    return nil, "Invalid type for '" .. param .. "': expected " .. expected .. ", but got " ..
        (ARTICLE[kind(v)] or "a value") .. " instead.", param, "invalid_type"
end

local function empty(param)
    return nil, "Invalid '" .. param .. "': empty array. Expected an array with minimum length 1, " ..
        "but got an empty array instead.", param, "empty_array"
end

local CONTENT = "one of a string or array of content parts"

-- roles whose content may be null or absent, and the fields that then stand in for it
-- (OpenAI: an assistant turn that only calls tools; replayed answers carry `refusal`)
local NULL_CONTENT_IF = {
    assistant = { "tool_calls", "function_call", "refusal", "audio" },
}
-- legacy `function` results may be null; roles OpenAI does not know are the engine's business
local NULL_CONTENT_OK = { ["function"] = true }
local KNOWN_ROLE = {
    system = true, developer = true, user = true, assistant = true, tool = true, ["function"] = true,
}
local MAX_ROLE_BYTES = 64

-- field paths are built only for an answer: the loop over a long conversation allocates nothing
local function content_param(i)
    return "messages[" .. (i - 1) .. "].content"
end

local function part_param(i, j, field)
    return content_param(i) .. "[" .. (j - 1) .. "]." .. field
end

-- the two part types every engine reads: `text` needs a string; `image_url` an object with a
-- string `url` (OpenAI) or a URL string (vLLM's own form). Other types are the engine's.
local function check_part(part, i, j)
    local ptype = part.type
    if ptype == "text" then
        local text = part.text
        if type(text) ~= "string" then
            if text == nil or text == null then
                return missing(part_param(i, j, "text"))
            end
            return bad_type(part_param(i, j, "text"), "a string", text)
        end
    elseif ptype == "image_url" then
        local img = part.image_url
        local t = type(img)
        if t ~= "string" then
            if img == nil or img == null then
                return missing(part_param(i, j, "image_url"))
            end
            if t ~= "table" or img[1] ~= nil then
                return bad_type(part_param(i, j, "image_url"), "an object", img)
            end
            local url = img.url
            if type(url) ~= "string" then
                if url == nil or url == null then
                    return missing(part_param(i, j, "image_url.url"))
                end
                return bad_type(part_param(i, j, "image_url.url"), "a string", url)
            end
        end
    end
    return true
end

local function check_content(msg, role, i)
    local content = msg.content
    if content == nil or content == null then
        if NULL_CONTENT_OK[role] or not KNOWN_ROLE[role] then
            return true
        end
        local alts = NULL_CONTENT_IF[role]
        if alts then
            for k = 1, #alts do
                local v = msg[alts[k]]
                if v ~= nil and v ~= null then
                    return true
                end
            end
        end
        return missing(content_param(i))
    end
    local t = type(content)
    if t == "string" then
        return true
    end
    if t ~= "table" then
        return bad_type(content_param(i), CONTENT, content)
    end
    if content[1] == nil then
        if next(content) == nil then
            return empty(content_param(i))
        end
        return bad_type(content_param(i), CONTENT, content)
    end
    for j = 1, #content do
        local part = content[j]
        local pt = type(part)
        -- a part is an object ({"type": "text", ...}; vLLM also takes {"image_url": ...}) or,
        -- for vLLM, a plain string
        if pt ~= "string" then
            if not (pt == "table" and part[1] == nil and next(part) ~= nil) then
                return bad_type(content_param(i) .. "[" .. (j - 1) .. "]", "an object", part)
            end
            local ok, err, param, code = check_part(part, i, j)
            if not ok then
                return nil, err, param, code
            end
        end
    end
    return true
end

local function check_messages(req)
    local msgs = req.messages
    if msgs == nil then
        return missing("messages")
    end
    if type(msgs) ~= "table" or (msgs[1] == nil and next(msgs) ~= nil) then
        return bad_type("messages", "an array", msgs)
    end
    local n = #msgs
    if n == 0 then
        return empty("messages")
    end
    for i = 1, n do
        local msg = msgs[i]
        if type(msg) ~= "table" or msg[1] ~= nil or next(msg) == nil then
            return bad_type("messages[" .. (i - 1) .. "]", "an object", msg)
        end
        local role = msg.role
        if not KNOWN_ROLE[role] then
            local param = "messages[" .. (i - 1) .. "].role"
            if role == nil or role == null then
                return missing(param)
            end
            if type(role) ~= "string" then
                return bad_type(param, "a string", role)
            end
            if #role > MAX_ROLE_BYTES or not find(role, "^%a[%w_%-]*$") then
                return nil, "Invalid value for '" .. param .. "': expected one of 'system', 'developer', " ..
                    "'user', 'assistant', 'tool' (or an engine's own role name).", param, "invalid_value"
            end
        end
        local ok, err, param, code = check_content(msg, role, i)
        if not ok then
            return nil, err, param, code
        end
    end
    return true
end

-- a token id: an integer in [0, 2^31)
local function is_token(v)
    return type(v) == "number" and v >= 0 and v < 2147483648 and v == floor(v)
end

local PROMPT = "a string, an array of strings, an array of integers or an array of arrays of integers"

local function check_tokens(list, param)
    for k = 1, #list do
        if not is_token(list[k]) then
            return bad_type(param .. "[" .. (k - 1) .. "]", "a token id (an integer >= 0)", list[k])
        end
    end
    return true
end

local function check_prompt(req)
    local p = req.prompt
    if p == nil or p == null then
        -- vLLM takes `prompt_embeds` instead of a prompt
        local pe = req.prompt_embeds
        if pe ~= nil and pe ~= null then
            return true
        end
        return missing("prompt")
    end
    local t = type(p)
    if t == "string" then
        return true
    end
    if t ~= "table" then
        return bad_type("prompt", PROMPT, p)
    end
    local first = p[1]
    if first == nil then
        if next(p) == nil then
            return empty("prompt")
        end
        return bad_type("prompt", PROMPT, p)
    end
    local ft = type(first)
    if ft == "string" then
        for k = 2, #p do
            if type(p[k]) ~= "string" then
                return bad_type("prompt[" .. (k - 1) .. "]", "a string (like prompt[0])", p[k])
            end
        end
        return true
    end
    if ft == "number" then
        return check_tokens(p, "prompt")
    end
    if ft ~= "table" then
        return bad_type("prompt[0]", "a string, an integer or an array of integers", first)
    end
    for k = 1, #p do
        local list = p[k]
        local param = "prompt[" .. (k - 1) .. "]"
        if type(list) ~= "table" or (list[1] == nil and next(list) ~= nil) then
            return bad_type(param, "an array of integers (like prompt[0])", list)
        end
        if list[1] == nil then
            return empty(param)
        end
        local ok, err, eparam, code = check_tokens(list, param)
        if not ok then
            return nil, err, eparam, code
        end
    end
    return true
end

local INPUT = "a string, an array of strings, an array of integers or an array of arrays of integers"
local ENCODINGS = { float = true, base64 = true }

-- check_embeddings(req): OpenAI's /v1/embeddings body: `input` (string | [string] | [int] |
-- [[int]], non-empty), `encoding_format` ("float" | "base64"), `dimensions` (integer >= 1),
-- `user` (string); no `stream` (an embedding is one JSON answer). Other fields: the engine's.
local function check_embeddings(req)
    local input = req.input
    if input == nil or input == null then
        return missing("input")
    end
    local t = type(input)
    if t == "string" then
        if input == "" then
            return nil, "Invalid 'input': empty string. Expected a non-empty string.", "input", "invalid_value"
        end
    elseif t ~= "table" then
        return bad_type("input", INPUT, input)
    else
        local first = input[1]
        if first == nil then
            if next(input) == nil then
                return empty("input")
            end
            return bad_type("input", INPUT, input)
        end
        local ft = type(first)
        if ft == "string" then
            for k = 1, #input do
                if type(input[k]) ~= "string" then
                    return bad_type("input[" .. (k - 1) .. "]", "a string (like input[0])", input[k])
                end
            end
        elseif ft == "number" then
            local ok, err, param, code = check_tokens(input, "input")
            if not ok then
                return nil, err, param, code
            end
        elseif ft == "table" then
            for k = 1, #input do
                local list = input[k]
                local param = "input[" .. (k - 1) .. "]"
                if type(list) ~= "table" or (list[1] == nil and next(list) ~= nil) then
                    return bad_type(param, "an array of integers (like input[0])", list)
                end
                if list[1] == nil then
                    return empty(param)
                end
                local ok, err, eparam, code = check_tokens(list, param)
                if not ok then
                    return nil, err, eparam, code
                end
            end
        else
            return bad_type("input[0]", "a string, an integer or an array of integers", first)
        end
    end
    local ef = req.encoding_format
    if ef ~= nil and ef ~= null and not ENCODINGS[ef] then
        if type(ef) ~= "string" then
            return bad_type("encoding_format", "a string", ef)
        end
        return nil, "Invalid value for 'encoding_format': expected one of 'float', 'base64'.", "encoding_format",
            "invalid_value"
    end
    local dims = req.dimensions
    if dims ~= nil and dims ~= null and not (type(dims) == "number" and dims >= 1 and dims == floor(dims)) then
        if type(dims) ~= "number" then
            return bad_type("dimensions", "an integer", dims)
        end
        return nil, "Invalid value for 'dimensions': expected an integer >= 1.", "dimensions", "invalid_value"
    end
    local user = req.user
    if user ~= nil and user ~= null and type(user) ~= "string" then
        return bad_type("user", "a string", user)
    end
    if req.stream == true then
        return nil, "Embeddings are not streamed: 'stream' must be false or absent.", "stream", "invalid_value"
    end
    return true
end

--- validate(req, endpoint) -> true | nil, message, param, code
-- req: the decoded body (a table); endpoint: "chat" | "completions" | "embeddings".
function _M.validate(req, endpoint)
    local model = req.model
    if type(model) ~= "string" or model == "" then
        if model == nil or model == null or model == "" then
            return nil, "You must provide a model parameter", "model", "missing_model"
        end
        return bad_type("model", "a string", model)
    end
    -- the gateway reads these (a cache hit is replayed as SSE only for `stream == true`)
    local stream = req.stream
    if stream ~= nil and stream ~= null and type(stream) ~= "boolean" then
        return bad_type("stream", "a boolean", stream)
    end
    local so = req.stream_options
    if so ~= nil and so ~= null then
        if type(so) ~= "table" or so[1] ~= nil then
            return bad_type("stream_options", "an object", so)
        end
        local iu = so.include_usage
        if iu ~= nil and iu ~= null and type(iu) ~= "boolean" then
            return bad_type("stream_options.include_usage", "a boolean", iu)
        end
    end
    if endpoint == "chat" then
        return check_messages(req)
    end
    if endpoint == "embeddings" then
        return check_embeddings(req)
    end
    return check_prompt(req)
end

--- parse(body, endpoint) -> req | nil, message, param, code
-- The raw body → the decoded request, or why it is refused (each answer is a 400).
function _M.parse(body, endpoint)
    if not _M.valid_utf8(body) then
        return nil, "The request body is not valid UTF-8", nil, "invalid_encoding"
    end
    local req, derr = decode(body)
    -- cjson decodes [] and {} alike: the first byte tells an object from an array
    if type(req) ~= "table" or not find(body, "^%s*{") then
        return nil, "The request body is not a valid JSON object" .. (derr and (": " .. derr) or ""), nil,
            "invalid_json"
    end
    local ok, err, param, code = _M.validate(req, endpoint)
    if not ok then
        return nil, err, param, code
    end
    return req
end

return _M
