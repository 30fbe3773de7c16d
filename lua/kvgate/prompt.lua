-- Canonical prompt of an OpenAI request, for the prefix fingerprint. PURE.
--
-- Layout: RS (0x1e) starts every message, US (0x1f) separates role from content:
--   chat:        ["T" US <canonical JSON of tools>] then per message RS <role> US <content>
--   completions: RS "P" US <prompt>   (per element when `prompt` is a list)
--   embeddings:  the same, of `input`
-- Roles and contents are escaped ("\\" -> "\\\\", RS -> "\\x1e", US -> "\\x1f"), so
-- request data cannot forge a boundary, and no length is written ahead of a text,
-- so two prompts whose texts share a prefix have canonical forms sharing a prefix
-- (a growing message keeps the fingerprint of its start, like the engine's prefix
-- cache). Content is the string, or the text parts of a content list concatenated
-- in order; non-text parts contribute nothing here (the response cache key hashes
-- the full messages instead). Lengths and windows are in bytes.
local json = require "kvgate.json"

local type = type
local concat = table.concat
local tostring = tostring
local gsub = string.gsub
local find = string.find
local sub = string.sub
local huge = math.huge

local _M = {}

local RS, US = "\30", "\31"
local ESC = { ["\\"] = "\\\\", [RS] = "\\x1e", [US] = "\\x1f" }
local SPECIAL = "[\\\30\31]"

local function esc(s)
    -- most texts hold none of the three: three plain finds instead of gsub's byte-by-byte
    -- class match
    if not (find(s, "\\", 1, true) or find(s, RS, 1, true) or find(s, US, 1, true)) then
        return s
    end
    return (gsub(s, SPECIAL, ESC))
end

-- occurrences of the byte c in s: plain find (memchr-fast in C), where a pattern's
-- character class walks the string byte by byte in Lua's matcher (~9 ns a byte: 360 µs
-- for a 40 KB message)
local function count(s, c)
    local n, pos = 0, 1
    while true do
        local i = find(s, c, pos, true)
        if not i then
            return n
        end
        n = n + 1
        pos = i + 1
    end
end

-- #esc(s) without building it: "\\" grows by 1 byte, RS and US by 3. Runs over the whole
-- text of a message that crosses the window (its end offset is exact, see canonical())
local function escaped_len(s)
    return #s + count(s, "\\") + 3 * (count(s, RS) + count(s, US))
end

-- esc(s) cut to `room` bytes, escaping at most `room` bytes of s: escaping only
-- expands and works byte by byte, so esc(s:sub(1, room)) starts with those bytes.
-- Prompts can be megabytes; the route key needs only prefix_chars of them.
local function esc_prefix(s, room)
    if room <= 0 then
        return ""
    end
    if #s > room then
        s = sub(s, 1, room)
    end
    local e = esc(s)
    if #e > room then
        e = sub(e, 1, room)
    end
    return e
end

local function is_text_part(part)
    return type(part) == "string" or (type(part) == "table" and part.type == "text" and type(part.text) == "string")
end

--- content_text(content) -> text, has_non_text
function _M.content_text(content)
    local t = type(content)
    if t == "string" then
        return content, false
    end
    if t ~= "table" then
        return "", false
    end
    local parts, non_text = {}, false
    for i = 1, #content do
        local part = content[i]
        if is_text_part(part) then
            parts[#parts + 1] = type(part) == "string" and part or part.text
        else
            non_text = true
        end
    end
    return concat(parts), non_text
end

--- has_non_text(content) -> true if a content list holds a part that is not text
-- (image, audio, ...); scans the part types only, builds no text
function _M.has_non_text(content)
    if type(content) ~= "table" then
        return false
    end
    for i = 1, #content do
        if not is_text_part(content[i]) then
            return true
        end
    end
    return false
end

--- canonical(req, endpoint, limit) -> prompt string, first_user_end, first_user_start
-- (byte offsets of the first user message's text in the full canonical prompt; nil if
-- there is none). endpoint: "chat", "completions" or "embeddings"; limit (optional, bytes): the
-- returned string is cut to `limit` bytes (texts past it are neither escaped nor
-- copied) and messages after the window are read only until the first user message's
-- offsets are known — the route key needs only its window, and conversations grow long.
function _M.canonical(req, endpoint, limit)
    limit = limit or huge
    local out = {}
    local len = 0 -- length of the full (uncut) canonical prompt so far
    local first_user_end, first_user_start
    if endpoint == "chat" then
        local tools = req.tools
        if type(tools) == "table" then
            local s = "T" .. US .. json.canonical(tools)
            out[#out + 1] = s
            len = len + #s
        end
        local messages = req.messages
        if type(messages) == "table" then
            for i = 1, #messages do
                local m = messages[i]
                if type(m) == "table" then
                    local role = type(m.role) == "string" and m.role or ""
                    local text = _M.content_text(m.content)
                    local head = RS .. esc(role) .. US
                    local room = limit - len - #head
                    local body_len
                    if room >= #text * 4 then
                        -- fits whatever the escaping (each byte expands to at most 4)
                        local e = esc(text)
                        out[#out + 1] = head .. e
                        body_len = #e
                    else
                        if len < limit then
                            out[#out + 1] = head .. esc_prefix(text, room)
                        end
                        body_len = escaped_len(text)
                    end
                    if role == "user" and not first_user_end then
                        first_user_start = len + #head
                        first_user_end = len + #head + body_len
                    end
                    len = len + #head + body_len
                    -- past the window, only the first user message's offsets are still needed
                    if len >= limit and first_user_end then
                        break
                    end
                end
            end
        end
    else
        local p = req.prompt
        if endpoint == "embeddings" then
            p = req.input
        end
        if type(p) == "string" then
            out[1] = RS .. "P" .. US .. esc_prefix(p, limit - 3)
        elseif type(p) == "table" then
            for i = 1, #p do
                local e = p[i]
                local room = limit - len - 3
                if type(e) == "table" then
                    -- token-id list: only as many ids as the window can show
                    local ids, n = {}, 0
                    for j = 1, #e do
                        ids[j] = tostring(e[j])
                        n = n + #ids[j] + 1
                        if n > room then
                            break
                        end
                    end
                    e = concat(ids, ",")
                else
                    e = tostring(e)
                end
                local s = RS .. "P" .. US .. esc_prefix(e, room)
                out[#out + 1] = s
                len = len + #s
                if len >= limit then
                    break
                end
            end
        end
    end
    local p = concat(out)
    if #p > limit then
        p = sub(p, 1, limit)
    end
    return p, first_user_end, first_user_start
end

--- window(prompt, first_user_end, prefix_chars) -> the fingerprinted prefix ("" if none)
function _M.window(prompt, first_user_end, prefix_chars)
    local n = prefix_chars
    if first_user_end and first_user_end < n then
        n = first_user_end
    end
    return prompt:sub(1, n)
end

return _M
