-- kvgate.ctx: one context per request, stashed across an internal redirect by a reference
local H = dofile("tests/lua/helper.lua")

local vars = {}
_G.ngx = { ctx = {}, var = vars }
local ctx = require "kvgate.ctx"

local function new_request()
    ngx.ctx = {}
end

H.test("get creates one context with a sub-table per stage", function()
    new_request()
    local k = ctx.get()
    for _, stage in ipairs({ "req", "route", "cache", "warm", "balancer", "log" }) do
        H.eq(type(k[stage]), "table", stage)
    end
    H.eq(ctx.get(), k, "same table on the second call")
    H.eq(ngx.ctx.kvgate, k)
end)

H.test("peek does not create a context", function()
    new_request()
    H.eq(ctx.peek(), nil)
    H.eq(ngx.ctx.kvgate, nil)
end)

H.test("stash and restore across a fresh ngx.ctx (internal redirect)", function()
    new_request()
    local k = ctx.get()
    k.route.pool = "p1"
    ctx.stash(k)
    local ref = vars[ctx.VAR]
    H.truthy(ref, "the reference is in the variable")
    ctx.stash(k)
    H.eq(vars[ctx.VAR], ref, "stash is once per request")
    ngx.ctx = {} -- what the redirect does
    local r = ctx.restore()
    H.eq(r, k)
    H.eq(r.route.pool, "p1")
    H.eq(ngx.ctx.kvgate, k, "restored into ngx.ctx")
    ctx.release(r)
    H.eq(ctx.held_count(), 0, "released")
    ngx.ctx = {}
    H.eq(ctx.restore(), nil, "nothing after release")
    vars[ctx.VAR] = nil
end)

H.test("restore without a stash is nil; release of an unstashed context is a no-op", function()
    new_request()
    vars[ctx.VAR] = nil
    H.eq(ctx.restore(), nil)
    ctx.release(ctx.get())
    ctx.release(nil)
    H.eq(ctx.held_count(), 0)
end)

H.test("many requests in flight keep their own contexts", function()
    local ks = {}
    for i = 1, 100 do
        new_request()
        local k = ctx.get()
        k.route.key = "k" .. i
        ctx.stash(k)
        ks[i] = { k, vars[ctx.VAR] }
    end
    H.eq(ctx.held_count(), 100)
    for i = 100, 1, -1 do
        ngx.ctx = {}
        vars[ctx.VAR] = ks[i][2]
        local k = ctx.restore()
        H.eq(k.route.key, "k" .. i)
        ctx.release(k)
    end
    H.eq(ctx.held_count(), 0)
end)

H.done()
