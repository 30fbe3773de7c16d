-- Content handler of the internal listener's /kvgate/config (nginx.conf's loopback-only
-- server): the control plane's runtime pushes (kvgate.config stores them).
--
--   POST /kvgate/config  body: {"pools": {...}, "cache": {...}} (kvgate.config.check_runtime)
--     200 {"version": N, "digest": "<sha256 hex of the stored body>"}
--     400 a bad document, OpenAI's error shape with `param` = the path of the bad field; the
--         runtime in force stays
--   GET /kvgate/config
--     200 {"version": N, "digest": "...", "runtime": {...}, "loads": <config loads>,
--          "worker": {"pid": P, "version": <the version this worker routes with>}}
-- Both need `Authorization: Bearer <secret>` whose sha256 hex is kvgate.json's
-- internal.push_secret_sha256 (401 otherwise; without that field every call is refused with
-- 403). The header is never logged. Counted in kvgate_config_pushes_total{result}.
local cjson = require "cjson.safe"
local config = require "kvgate.config"
local errors = require "kvgate.errors"
local hash = require "kvgate.hash"
local metrics = require "kvgate.metrics"
local peers = require "kvgate.balancer.peers"

local ngx = ngx
local var = ngx.var
local type = type
local pairs = pairs
local tonumber = tonumber
local tostring = tostring
local io_open = io.open
local byte = string.byte
local match = string.match
local bxor = require("bit").bxor
local bor = require("bit").bor

local _M = {}

-- the largest runtime body read (a pool of 1,000 nodes is ~60 KB)
_M.MAX_BODY = 4 * 1024 * 1024

local function count(result)
    metrics.incr("kvgate_config_pushes_total", { result = result })
end

-- equal(a, b): compare two hex digests without an early exit
local function equal(a, b)
    if #a ~= #b then
        return false
    end
    local diff = 0
    for i = 1, #a do
        diff = bor(diff, bxor(byte(a, i), byte(b, i)))
    end
    return diff == 0
end

--- authorized(cfg, header) -> true | nil, status, message, code
function _M.authorized(cfg, header)
    local want = type(cfg.internal) == "table" and cfg.internal.push_secret_sha256
    if type(want) ~= "string" or want == "" then
        return nil, 403, "Runtime pushes are refused: kvgate.json has no internal.push_secret_sha256 "
            .. "(the control plane renders it with the push secret in conf/push.secret)", "push_disabled"
    end
    local token = type(header) == "string" and match(header, "^[Bb]earer%s+(%S+)%s*$")
    if not token then
        return nil, 401, "Missing bearer token (Authorization: Bearer <conf/push.secret>)", "invalid_api_key"
    end
    local got = hash.sha256_hex(token)
    if not got or not equal(got, want) then
        return nil, 401, "Incorrect push secret", "invalid_api_key"
    end
    return true
end

local function send_json(status, t)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.print(cjson.encode(t))
    return ngx.exit(status)
end

local function read_body()
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if not body then
        local file = ngx.req.get_body_file()
        if file then
            local f = io_open(file, "rb")
            if f then
                body = f:read("*a")
                f:close()
            end
        end
    end
    return body
end

local function get()
    local s = config.stored()
    if not s then
        return errors.send(503, "No runtime stored yet", "not_ready", nil, "server_error")
    end
    local doc = cjson.decode(s.body)
    -- worker: the runtime version this worker routes with (it follows within config.SYNC_S)
    local rt = config.runtime()
    return send_json(200, { version = s.version, digest = s.digest, runtime = doc, loads = s.loads,
        worker = { pid = ngx.worker.pid(), version = rt and rt.version } })
end

-- came_back(old, new) -> {[pool] = {[id] = true}} of nodes whose weight went from 0 to > 0
local function came_back(old, new)
    local out
    for name, p in pairs(new.pools) do
        local op = old and old.pools and old.pools[name]
        for id, n in pairs(p.nodes) do
            local was = op and op.nodes and op.nodes[id]
            if n.weight > 0 and was and (tonumber(was.weight) or 0) <= 0 then
                out = out or {}
                out[name] = out[name] or {}
                out[name][id] = true
            end
        end
    end
    return out
end

local function post(cfg)
    local body = read_body()
    if not body or body == "" then
        count("invalid")
        return errors.send(400, "The body must be the runtime as a JSON object", "invalid_runtime")
    end
    if #body > _M.MAX_BODY then
        count("invalid")
        return errors.send(413, "The runtime is larger than " .. _M.MAX_BODY .. " bytes", "invalid_runtime")
    end
    local doc, derr = cjson.decode(body)
    if doc == nil then
        count("invalid")
        return errors.send(400, "The body is not JSON: " .. tostring(derr), "invalid_json")
    end
    local ok, msg, param = config.check_runtime(doc, cfg)
    if not ok then
        count("invalid")
        return errors.send(400, msg, "invalid_runtime", param)
    end
    local lok, lerr = config.lock()
    if not lok then
        count("error")
        return errors.send(503, "Cannot store the runtime: " .. lerr, "busy", nil, "server_error")
    end
    local before = config.stored()
    local old = before and cjson.decode(before.body)
    local version, digest = config.store(body)
    config.unlock()
    if not version then
        count("error")
        ngx.log(ngx.ERR, "kvgate config: ", digest)
        return errors.send(500, "Cannot store the runtime: " .. tostring(digest), "store_failed", nil, "server_error")
    end
    -- nodes back in service forget their failure marks (every worker at its next refresh)
    local back = came_back(old, doc)
    if back then
        local d = ngx.shared.kvgate_state
        for pool, ids in pairs(back) do
            for id in pairs(ids) do
                if d then
                    d:delete(peers.fail_key(pool, id))
                end
            end
        end
    end
    count("ok")
    -- this worker at once; the others within config.SYNC_S
    config.sync()
    return send_json(200, { version = version, digest = digest })
end

--- handle(): content_by_lua of location = /kvgate/config
function _M.handle()
    local cfg = config.get()
    local ok, status, msg, code = _M.authorized(cfg, var.http_authorization)
    if not ok then
        count(status == 403 and "forbidden" or "unauthorized")
        return errors.send(status, msg, code, nil, status == 403 and "permission_error" or "authentication_error")
    end
    local method = ngx.req.get_method()
    if method == "GET" or method == "HEAD" then
        return get()
    elseif method == "POST" then
        return post(cfg)
    end
    ngx.header["Allow"] = "GET, POST"
    return errors.send(405, "Use GET or POST for /kvgate/config", "method_not_allowed")
end

return _M
