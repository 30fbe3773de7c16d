-- Shared-prefix hot key on /v1/completions: a prefix fingerprint that many different
-- prompts share (a few-shot template or preamble longer than prefix_chars), told apart
-- from one conversation's turns, which share it by design.
--
-- A chat request shows the structure (the window ends inside the system prompt: see
-- route_key.prefix_key); a completions prompt has none. What differs is the shape of the
-- prompts behind one fingerprint: a conversation is a CHAIN (each turn's prompt extends
-- the previous one), a shared template is a TREE (prompts branch after the shared part).
-- Per worker and fingerprint the detector keeps up to MAX_TIPS chain tips, each the
-- length of the latest prompt of a chain and its last TAIL bytes (TAIL token ids for a
-- token-id prompt). A prompt extends a tip when it is at least as long and holds the
-- tip's tail at the tip's offset; it then becomes the tip. A prompt that extends no tip
-- starts a chain. NEW_CHAINS chains started within WINDOW_S flag the fingerprint as
-- shared for HOLD_S (renewed by each later new chain); every request on a flagged
-- fingerprint is flagged.
--
-- Cost: nothing for a prompt that cannot fill the window (distinct prompts can share a
-- fingerprint only past it); otherwise one lrucache lookup and, per tip (at most
-- MAX_TIPS), one TAIL-byte substring and a compare — constant in the prompt's length.
-- Memory: ITEMS fingerprints per worker, each under MAX_TIPS * (TAIL + ~100) bytes.
-- Not examined: batches of several prompts (only the first is looked at).
-- pureffi: the plain resty.lrucache rehashes its key table on every insert once full
-- (~30 us per new fingerprint at 2048 items, measured); pureffi stays ~0.15 us
local lrucache = require "resty.lrucache.pureffi"

local type = type
local sub = string.sub
local concat = table.concat

local _M = {}

_M.MAX_TIPS = 4
_M.NEW_CHAINS = 4 -- chains started within WINDOW_S that make a fingerprint shared
_M.WINDOW_S = 60
_M.HOLD_S = 60
_M.TAIL = 64 -- bytes of a text prompt compared at a tip
_M.TAIL_IDS = 16 -- token ids of a token-id prompt compared at a tip
_M.ITEMS = 2048 -- fingerprints remembered per worker

--- new(items) -> detector (per worker: create it in init_worker)
function _M.new(items)
    return { lru = lrucache.new(items or _M.ITEMS) }
end

-- seq(prompt, window) -> the prompt as a string or a token-id list, its length, and
-- whether it is one; nil when it cannot fill the `window` bytes of canonical prompt
-- (RS "P" US, then the text escaped, which only grows it; a token id is at least
-- 1 digit and a separator), or has a shape not examined
local function seq(p, window)
    local t = type(p)
    if t == "table" then
        local first = p[1]
        local ft = type(first)
        if ft == "string" then
            -- a list of prompts: the first one
            p, t = first, ft
        elseif ft == "table" then
            -- a list of token-id lists: the first one
            p = first
            if type(p[1]) ~= "number" then
                return nil
            end
        elseif ft ~= "number" then
            return nil
        end
    elseif t ~= "string" then
        return nil
    end
    if t == "string" then
        local n = #p
        if n + 3 < window then
            return nil
        end
        return p, n, true
    end
    local n = #p
    if n * 2 + 3 < window then
        return nil
    end
    return p, n, false
end

-- tail(s, is_str, last) -> the TAIL bytes (or TAIL_IDS ids, joined) that end at `last`,
-- or nil if a token id is not a number
local function tail(s, is_str, last)
    if is_str then
        local first = last - _M.TAIL + 1
        return sub(s, first < 1 and 1 or first, last)
    end
    local first = last - _M.TAIL_IDS + 1
    if first < 1 then
        first = 1
    end
    for i = first, last do
        if type(s[i]) ~= "number" then
            return nil
        end
    end
    return concat(s, ",", first, last)
end

--- observe(det, key, prompt, window, now) -> true when the fingerprint `key` (scope it
-- by pool) is shared by many different prompts (see the top of this file).
-- prompt: the request's `prompt` field; window: the pool's prefix_chars; now: seconds.
function _M.observe(det, key, p, window, now)
    local s, n, is_str = seq(p, window)
    if not s then
        return false
    end
    local lru = det.lru
    local st = lru:get(key)
    if not st then
        st = { tips = {}, since = now, chains = 0, hold = 0 }
        lru:set(key, st)
    end
    local tips = st.tips
    local oldest
    for i = 1, #tips do
        local tip = tips[i]
        local len = tip.len
        if len <= n and tail(s, is_str, len) == tip.tail then
            -- this prompt extends the chain (or repeats its latest prompt)
            if len < n then
                local tl = tail(s, is_str, n)
                if tl then
                    tip.len, tip.tail = n, tl
                end
            end
            tip.at = now
            return now < st.hold
        end
        if not oldest or tip.at < tips[oldest].at then
            oldest = i
        end
    end
    local tl = tail(s, is_str, n)
    if not tl then
        return now < st.hold
    end
    local tip = { len = n, tail = tl, at = now }
    if #tips < _M.MAX_TIPS then
        tips[#tips + 1] = tip
    else
        tips[oldest] = tip
    end
    if now - st.since > _M.WINDOW_S then
        st.since, st.chains = now, 0
    end
    st.chains = st.chains + 1
    if st.chains >= _M.NEW_CHAINS then
        st.hold = now + _M.HOLD_S
    end
    return now < st.hold
end

return _M
