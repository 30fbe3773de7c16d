-- Conversions between a streamed (SSE) response and the final completion object,
-- so a cached answer can be replayed in either form. PURE.
-- JSON goes through json.decode_keep/encode_keep so empty arrays (`"top_logprobs":[]`,
-- `"choices":[]`) stay arrays: a decoded `[]` is the string json.EMPTY_ARRAY here.
local cjson = require "cjson.safe"
local json = require "kvgate.json"

local type = type
local pairs = pairs
local ipairs = ipairs
local concat = table.concat
local gmatch = string.gmatch
local next = next
local null = cjson.null

local EMPTY_ARRAY = json.EMPTY_ARRAY

local _M = {}

-- Text fields of a chat delta/message besides `content` that are concatenated over the
-- chunks and replayed like it: the reasoning of reasoning models (vLLM and SGLang send
-- `reasoning_content`; newer vLLM sends `reasoning`, some servers both).
_M.TEXT_FIELDS = { "reasoning_content", "reasoning" }
local TEXT_FIELDS = _M.TEXT_FIELDS

-- finish_reason values that do not end a complete answer: vLLM's engine ends a request
-- it aborted (client gone, preemption) or failed with these.
local NOT_FINISHED = { abort = true, error = true }

local function events(body)
    -- SSE events are separated by a blank line; the payload is the "data:" lines
    local out = {}
    for block in gmatch(body:gsub("\r\n", "\n") .. "\n\n", "(.-)\n\n") do
        local data = {}
        for line in gmatch(block .. "\n", "(.-)\n") do
            local d = line:match("^data: ?(.*)$")
            if d then
                data[#data + 1] = d
            end
        end
        if #data > 0 then
            out[#out + 1] = concat(data, "\n")
        end
    end
    return out
end

local function merge_tool_calls(acc, deltas)
    for _, d in ipairs(deltas) do
        if type(d) ~= "table" then
            return false
        end
        local idx = type(d.index) == "number" and d.index or #acc
        local tc = acc[idx + 1]
        if not tc then
            tc = { type = "function", ["function"] = { name = "", arguments = "" } }
            acc[idx + 1] = tc
        end
        if d.id then tc.id = d.id end
        if d.type then tc.type = d.type end
        local f = d["function"]
        if type(f) == "table" then
            if type(f.name) == "string" then tc["function"].name = tc["function"].name .. f.name end
            if type(f.arguments) == "string" then
                tc["function"].arguments = tc["function"].arguments .. f.arguments
            end
        end
    end
    return true
end

-- logprobs of one choice arrive split over the chunks, each chunk holding the
-- entries of its own tokens: chat `{content = [...], refusal = [...]}`, completions
-- `{tokens, token_logprobs, top_logprobs, text_offset}` (all lists). Lists are appended
-- in order; null is kept only while nothing else came; anything else (a scalar or an
-- object) cannot be merged, and the stream is then not rebuilt (not cached).
local function merge_logprobs(acc, lp)
    for k, v in pairs(lp) do
        local have = acc[k]
        if v == EMPTY_ARRAY then
            if have == nil or have == null then
                acc[k] = {}
            end
        elseif type(v) == "table" and v[1] ~= nil then
            if have == nil or have == null then
                have = {}
                acc[k] = have
            elseif type(have) ~= "table" then
                return false
            end
            for i = 1, #v do
                have[#have + 1] = v[i]
            end
        elseif v == null then
            if have == nil then
                acc[k] = null
            end
        else
            return false
        end
    end
    return true
end

local function finish_logprobs(lp)
    if lp == nil then
        return null
    end
    for k, v in pairs(lp) do
        if type(v) == "table" and v[1] == nil then
            lp[k] = EMPTY_ARRAY
        end
    end
    return lp
end

--- to_completion(body, endpoint) -> completion table | nil, err
-- Rebuilds the non-streamed response from the chunks ("chat" or "completions"): content
-- and text concatenated, tool calls and logprobs merged, usage from the usage chunk.
-- Encode the result with json.encode_keep (it holds json.EMPTY_ARRAY for `[]`).
function _M.to_completion(body, endpoint)
    local ev = events(body)
    if ev[#ev] ~= "[DONE]" then
        return nil, "stream not complete"
    end
    local first, usage
    local choices = {}
    for i = 1, #ev - 1 do
        local chunk = json.decode_keep(ev[i])
        if type(chunk) ~= "table" then
            return nil, "bad chunk"
        end
        if chunk.error then
            return nil, "error in stream"
        end
        first = first or chunk
        if type(chunk.usage) == "table" then
            usage = chunk.usage
        end
        if type(chunk.choices) == "table" then
            for _, c in ipairs(chunk.choices) do
                if type(c) ~= "table" then
                    return nil, "bad choice"
                end
                local idx = type(c.index) == "number" and c.index or 0
                local acc = choices[idx + 1]
                if not acc then
                    acc = { index = idx, parts = {}, tool_calls = {}, texts = {} }
                    choices[idx + 1] = acc
                end
                if endpoint == "chat" then
                    local d = type(c.delta) == "table" and c.delta or {}
                    if type(d.role) == "string" then acc.role = d.role end
                    if type(d.content) == "string" then acc.parts[#acc.parts + 1] = d.content end
                    for _, f in ipairs(TEXT_FIELDS) do
                        local v = d[f]
                        if type(v) == "string" then
                            local t = acc.texts[f]
                            if not t then
                                t = {}
                                acc.texts[f] = t
                            end
                            t[#t + 1] = v
                        end
                    end
                    if type(d.tool_calls) == "table" and not merge_tool_calls(acc.tool_calls, d.tool_calls) then
                        return nil, "bad tool call"
                    end
                elseif type(c.text) == "string" then
                    acc.parts[#acc.parts + 1] = c.text
                end
                if c.finish_reason ~= nil and c.finish_reason ~= null then
                    acc.finish_reason = c.finish_reason
                end
                local lp = c.logprobs
                if type(lp) == "table" then
                    acc.logprobs = acc.logprobs or {}
                    if not merge_logprobs(acc.logprobs, lp) then
                        return nil, "logprobs cannot be merged"
                    end
                elseif lp ~= nil and lp ~= null then
                    return nil, "logprobs cannot be merged"
                end
            end
        end
    end
    if not first then
        return nil, "empty stream"
    end
    local out_choices = {}
    for i = 1, #choices do
        local acc = choices[i]
        if not acc then
            return nil, "missing choice"
        end
        local c = { index = acc.index, finish_reason = acc.finish_reason or null,
                    logprobs = finish_logprobs(acc.logprobs) }
        if endpoint == "chat" then
            local msg = { role = acc.role or "assistant" }
            msg.content = (#acc.parts > 0 or #acc.tool_calls == 0) and concat(acc.parts) or null
            for _, f in ipairs(TEXT_FIELDS) do
                if acc.texts[f] then msg[f] = concat(acc.texts[f]) end
            end
            if #acc.tool_calls > 0 then msg.tool_calls = acc.tool_calls end
            c.message = msg
        else
            c.text = concat(acc.parts)
        end
        out_choices[i] = c
    end
    return {
        id = first.id,
        object = endpoint == "chat" and "chat.completion" or "text_completion",
        created = first.created,
        model = first.model,
        system_fingerprint = first.system_fingerprint,
        choices = out_choices,
        usage = usage,
    }
end

--- finished(obj) -> true | false, reason
-- Whether a completion (JSON, or rebuilt from a stream) is a whole answer worth storing:
-- at least one choice ("no-choices"), and every choice ended by the engine with a
-- finish_reason ("unfinished": null or missing, as in a stream that reached [DONE]
-- without one; "aborted": vLLM's `abort`/`error`).
function _M.finished(obj)
    local choices = type(obj) == "table" and obj.choices
    if type(choices) ~= "table" or choices[1] == nil then
        return false, "no-choices"
    end
    for i = 1, #choices do
        local c = choices[i]
        local fr = type(c) == "table" and c.finish_reason
        if type(fr) ~= "string" or fr == "" then
            return false, "unfinished"
        end
        if NOT_FINISHED[fr] then
            return false, "aborted"
        end
    end
    return true
end

local function data(t)
    return "data: " .. (json.encode_keep(t) or "{}") .. "\n\n"
end

--- from_completion(obj, endpoint, include_usage) -> SSE body ending in "data: [DONE]"
-- obj: the completion decoded with json.decode_keep (so `[]` fields stay arrays).
function _M.from_completion(obj, endpoint, include_usage)
    local out = {}
    local base = function(choices)
        return { id = obj.id, object = endpoint == "chat" and "chat.completion.chunk" or "text_completion",
                 created = obj.created, model = obj.model, system_fingerprint = obj.system_fingerprint,
                 choices = choices }
    end
    local choices = type(obj.choices) == "table" and obj.choices or {}
    for _, c in ipairs(choices) do
        if endpoint == "chat" then
            local m = type(c.message) == "table" and c.message or {}
            out[#out + 1] = data(base({ { index = c.index, delta = { role = m.role or "assistant", content = "" },
                                          finish_reason = null } }))
            -- the reasoning first, in a chunk of its own, as an engine streams it
            local thought = {}
            for _, f in ipairs(TEXT_FIELDS) do
                if type(m[f]) == "string" and m[f] ~= "" then thought[f] = m[f] end
            end
            if next(thought) then
                out[#out + 1] = data(base({ { index = c.index, delta = thought, finish_reason = null } }))
            end
            local delta = {}
            if type(m.content) == "string" and m.content ~= "" then delta.content = m.content end
            -- an empty list decodes to EMPTY_ARRAY (a string): no tool_calls key then
            if type(m.tool_calls) == "table" and #m.tool_calls > 0 then
                local tcs = {}
                for i, tc in ipairs(m.tool_calls) do
                    tcs[i] = { index = i - 1, id = tc.id, type = tc.type, ["function"] = tc["function"] }
                end
                delta.tool_calls = tcs
            end
            if next(delta) then
                out[#out + 1] = data(base({ { index = c.index, delta = delta, logprobs = c.logprobs,
                                              finish_reason = null } }))
            end
            out[#out + 1] = data(base({ { index = c.index, delta = {},
                                          finish_reason = c.finish_reason } }))
        else
            out[#out + 1] = data(base({ { index = c.index, text = c.text or "", logprobs = c.logprobs,
                                          finish_reason = c.finish_reason } }))
        end
    end
    if include_usage and type(obj.usage) == "table" then
        local last = base(EMPTY_ARRAY)
        last.usage = obj.usage
        out[#out + 1] = data(last)
    end
    out[#out + 1] = "data: [DONE]\n\n"
    return concat(out)
end

return _M
