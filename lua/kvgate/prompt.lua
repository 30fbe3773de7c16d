-- Canonical prompt of an OpenAI request, for the prefix fingerprint. PURE.
--
-- Layout: RS (0x1e) starts every message, US (0x1f) separates role from content:
--   chat:        ["T" US <canonical JSON of tools>] then per message RS <role> US <content>
--   completions: RS "P" US <prompt>   (per element when `prompt` is a list)
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

local _M = {}

local RS, US = "\30", "\31"
local ESC = { ["\\"] = "\\\\", [RS] = "\\x1e", [US] = "\\x1f" }

local function esc(s)
    return (gsub(s, "[\\\30\31]", ESC))
end
_M.escape = esc

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
        if type(part) == "table" and part.type == "text" and type(part.text) == "string" then
            parts[#parts + 1] = part.text
        elseif type(part) == "string" then
            parts[#parts + 1] = part
        else
            non_text = true
        end
    end
    return concat(parts), non_text
end

--- canonical(req, endpoint, limit) -> prompt string, first_user_end, first_user_start
-- (byte offsets of the first user message's text; nil if there is none)
-- endpoint: "chat" or "completions"; limit (optional, bytes): stop once the prompt is at
-- least this long and the first user message was seen — the route key needs only its
-- window, and conversations grow long.
function _M.canonical(req, endpoint, limit)
    limit = limit or math.huge
    local out = {}
    local len = 0
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
                    local s = head .. esc(text)
                    if role == "user" and not first_user_end then
                        first_user_start = len + #head
                        first_user_end = len + #s
                    end
                    out[#out + 1] = s
                    len = len + #s
                    -- past the window, only the first user message's offsets are still needed
                    if len >= limit and first_user_end then
                        break
                    end
                end
            end
        end
    else
        local p = req.prompt
        if type(p) == "string" then
            out[1] = RS .. "P" .. US .. esc(p)
        elseif type(p) == "table" then
            for i = 1, #p do
                local e = p[i]
                if type(e) == "table" then
                    -- token-id list
                    local ids = {}
                    for j = 1, #e do
                        ids[j] = tostring(e[j])
                    end
                    e = concat(ids, ",")
                else
                    e = tostring(e)
                end
                out[#out + 1] = RS .. "P" .. US .. esc(e)
                len = len + #out[#out]
                if len >= limit then
                    break
                end
            end
        end
    end
    return concat(out), first_user_end, first_user_start
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
