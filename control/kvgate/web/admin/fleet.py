"""The admin page's figures: Fleet table rows, pool lines, the request-log figures, formatting.

Functions of the services' views (``nodes_view``, ``pools_view``, ``history``) and of the
request log (:mod:`kvgate.web.admin.traffic`); no Flask request state.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any

import redis

from ... import redisconn

from ...control import states as st
from ...fleet.weights import WEIGHT_SCALE

log = logging.getLogger("kvgate.web.admin")

TRAFFIC_WINDOW_S = 900.0
"""The Pools and Cache pages (and the Fleet page's pool line) read the last 15 minutes of the request log."""
TRAFFIC_CACHE_S = 3.0
"""The request-log analysis is reused for this long (many open pages cost one analysis)."""
RATE_WINDOW_S = 60.0
"""Requests/s, error rate and the node's prefix-cache hit ratio on the Fleet page are over the last minute."""


def _pct(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}%"


def _num(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def _when(ts: float | None) -> str:
    if not ts:
        return "—"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _weight(w: int | None) -> str:
    """nginx weights are in units of 1/WEIGHT_SCALE of a policy weight (kvgate.fleet.weights)."""
    return "—" if w is None else f"{w / WEIGHT_SCALE:.2f}"


# ------------------------------------------------------------------ fleet data
def _gpu_cells(report: dict[str, Any] | None) -> tuple[str, str, str]:
    """(memory text, utilisation text, title) from an agent report's ``gpu`` part."""
    if not report:
        return "—", "—", "no agent report yet"
    gpu = report.get("gpu") or {}
    if gpu.get("status") != "ok":
        reason = gpu.get("reason") or "NVML unavailable"
        return "no GPU", "no GPU", f"no GPU figures: {reason}"
    devs = gpu.get("devices") or []
    if not devs:
        return "no GPU", "no GPU", "NVML found no device"
    used = sum(d.get("memory_used_bytes") or 0 for d in devs)
    total = sum(d.get("memory_total_bytes") or 0 for d in devs)
    utils = [d["utilization_pct"] for d in devs if d.get("utilization_pct") is not None]
    util = f"{sum(utils) / len(utils):.0f}%" if utils else "—"
    names = ", ".join(sorted({str(d.get("name") or "GPU") for d in devs}))
    return f"{_gib(used)} / {_gib(total)} GiB", util, f"{len(devs)} × {names}"


BREAKER_STATES = {0: "closed", 1: "open", 2: "half-open"}
"""``kvgate_upstream_breaker_state`` values (lua/kvgate/breaker.lua)."""


def _breaker_cell(gateway: Any, node_id: str) -> tuple[str, str, str]:
    """(text, CSS class, title) of a node's circuit breaker from the plane's last gateway scrape
    (``gateway["breaker"]``: node id → 0 closed / 1 open / 2 half-open, ``kvgate_upstream_breaker_state``)."""
    if not gateway or not gateway.get("ok"):
        return "—", "", "the gateway's /metrics could not be read"
    states = gateway.get("breaker")
    if states is None:
        return "—", "", "this control plane does not read the gateway's breaker states"
    v = states.get(node_id)
    if v is None:
        return "—", "", "the gateway reports no breaker for this node (yet)"
    text = BREAKER_STATES.get(int(v), "?")
    cls = "bad" if text == "open" else "warn" if text == "half-open" else ""
    title = {"closed": "the gateway sends it traffic",
             "open": "skipped by the gateway after failures in a row (pools[].failover.breaker_failures)",
             "half-open": "the gateway lets one trial request through: its answer closes the breaker"}.get(text, "")
    return text, cls, title


def _progress(plane: Any, n: dict[str, Any], now: float) -> tuple[str, bool]:
    """What the node is doing now, and whether an action is under way (the row shows progress)."""
    state = n["state"]
    warm = n.get("warmup") or {}
    policy = plane.policy
    if state == st.DRAINING and n.get("drain"):
        d = n["drain"]
        gw, en = d.get("inflight_gateway"), d.get("inflight_engine")
        left = max(0.0, d.get("deadline", now) - now)
        return (f"draining for {now - d.get('started', now):.0f} s: {_num(gw)} in flight at the gateway, "
                f"{_num(en)} at the engine (timeout in {left:.0f} s)"), True
    if warm.get("status") == "running":
        done, total = (warm.get("progress") or [0, 0])[:2]
        return f"warm-up running: {done}/{total or '?'} prompt(s) sent", True
    if state == st.WARMING:
        return "warming: waiting for the warm-up to start", True
    if state == st.RAMPING and policy is not None:
        ramp = n.get("ramp") or {}
        steps = policy.ramp.steps
        step = min(ramp.get("step", 0), len(steps) - 1)
        held = f"; held: {ramp['held']}" if ramp.get("held") else ""
        return f"ramping: step {step + 1}/{len(steps)} at {steps[step]:.0%} of its weight{held}", True
    if state == st.JOINING:
        return "joining: waiting for its first passing health check", True
    note = ""
    if warm.get("status") in ("ok", "partial", "failed") and warm.get("result"):
        r = warm["result"]
        ttft = ""
        if r.get("ttft_before_ms") is not None and r.get("ttft_after_ms") is not None:
            ttft = f", TTFT {r['ttft_before_ms']:.0f} → {r['ttft_after_ms']:.0f} ms"
        note = f"last warm-up {warm['status']}: {r.get('sent', 0)} sent{ttft}"
    if state == st.EJECTED:
        text = f"ejected: {(n.get('health') or {}).get('last_error') or n.get('reason') or ''}"
    elif state == st.DRAINED:
        d = n.get("drain") or {}
        text = "drained (timed out with requests in flight)" if d.get("timed_out") else "drained: safe to stop"
    else:
        text = ""
    return "; ".join(t for t in (text, note) if t), False


def gateway_rows(plane: Any) -> list[dict[str, Any]]:
    """The gateway members (docs/scale-out.md) as the Fleet page's table shows them: id, listen,
    version, in sync, last seen, lost; ``[]`` for a policy with one member (the page as before)."""
    views = plane.gateways.view()
    if len(views) < 2:
        return []
    rows = []
    for g in views:
        state = g["state"]
        rows.append({"id": g["id"], "listen": g["listen"], "local": g["local"],
                     "version": "—" if g["version"] is None else str(g["version"]), "state": state,
                     "class": "bad" if g["lost"] else ("" if g["in_sync"] else "warn"),
                     "seen": "now" if g["local"] and not g["lost"] else _ago(g["age_s"]),
                     "error": (g.get("error") or "").splitlines()[0][:200] if g.get("error") else ""})
    return rows


def fleet_rows(plane: Any, now: float | None = None) -> list[dict[str, Any]]:
    """One dict per node for the Fleet table: ``cells`` (display text by column), ``classes``
    (CSS class by column: ``bad``/``warn``/``cold``), ``title`` (tooltips), ``actions``
    (which of drain/undrain/warm the state allows) and the raw state/progress."""
    now = now or time.time()
    assert plane.policy is not None
    nodes = plane.nodes_view()
    redis_ok = plane.store.ping()
    policy = plane.policy
    stale_after = policy.health.missing_reports * policy.control.report_interval_s
    gateway = getattr(plane.snapshot, "gateway", None)
    rows = []
    for n in nodes:
        report = n.get("report")
        age = n.get("report_age_s")
        fresh = age is not None and age <= stale_after
        engine = (report or {}).get("engine") or {}
        down = n["state"] == st.EJECTED or not fresh or engine.get("healthy") is False
        rates = plane.history.rates(n["id"], now=now, over_s=RATE_WINDOW_S)
        mem, util, gpu_title = _gpu_cells(report)
        hit = rates.get("prefix_hit_ratio")
        hit_title = "prefix-cache hits ÷ lookups (tokens) on this engine over the last minute"
        if hit is None and engine.get("prefix_cache_queries"):
            hit = (engine.get("prefix_cache_hits") or 0) / engine["prefix_cache_queries"]
            hit_title = "no lookups in the last minute: since the engine started"
        if down:  # an unreachable engine's last figures would hide that it is down
            hit, engine = None, {}
            why = (((report or {}).get("engine") or {}).get("error")
                   or ("ejected" if n["state"] == st.EJECTED else "no fresh agent report"))
            hit_title = f"no figure: {why}"
        progress, busy = _progress(plane, n, now)
        err = rates.get("error_rate")
        running, waiting = engine.get("running"), engine.get("waiting")
        brk, brk_cls, brk_title = _breaker_cell(gateway, n["id"])
        cls = {
            "state": f"state-{n['state']}",
            "report_age": ("warn" if not redis_ok else
                           "bad" if age is None and n.get("has_agent") or (age is not None and age > stale_after) else ""),
            "errors": "bad" if err and err >= 0.05 else ("warn" if err and err > 0 else ""),
            "kv_cache": "warn" if (engine.get("kv_cache_usage") or 0) >= 0.9 else "",
            "queue": "warn" if (waiting or 0) > 0 else "",
            "breaker": brk_cls,
        }
        rows.append({
            "id": n["id"], "pool": n["pool"], "url": n["url"], "state": n["state"], "reason": n.get("reason") or "",
            "progress": progress, "busy": busy, "hit_ratio": hit,
            "warmup_status": (n.get("warmup") or {}).get("status"),
            "warmup_finished_at": ((n.get("warmup") or {}).get("result") or {}).get("finished_at"),
            "cells": {
                "state": n["state"],
                "weight": f"{_weight(n.get('target_weight'))} / "
                          f"{'down' if not n.get('weight') else _weight(n.get('weight'))}",
                "gpu_mem": mem, "gpu_util": util,
                "queue": f"{_num(running)} / {_num(waiting)}",
                "kv_cache": _pct(engine.get("kv_cache_usage")),
                "prefix_hit": _pct(hit, 1),
                "req_s": _num(rates.get("req_s"), 1),
                "errors": _pct(err, 1),
                "breaker": brk,
                "report_age": ("unknown (Redis down)" if not redis_ok else _ago(age) if age is not None
                               else ("none yet" if not n.get("has_agent") else "missing")),
                "progress": progress,
            },
            "classes": cls,
            "title": {"gpu_mem": gpu_title, "gpu_util": gpu_title, "prefix_hit": hit_title,
                      "state": f"since {_when(n.get('since'))}: {n.get('reason') or ''}",
                      "report_age": "age of the node agent's last report", "breaker": brk_title},
            "actions": {
                "drain": st.DRAINING in st.TRANSITIONS.get(n["state"], ()),
                "undrain": st.WARMING in st.TRANSITIONS.get(n["state"], ()) and n["state"] in (st.DRAINING, st.DRAINED),
                "warm": (n.get("warmup") or {}).get("status") != "running",
            },
        })
    # a node far colder than the rest of its pool is what an average would hide
    by_pool: dict[str, list[float]] = {}
    for r in rows:
        if r["hit_ratio"] is not None and r["state"] in st.SERVING:
            by_pool.setdefault(r["pool"], []).append(r["hit_ratio"])
    for r in rows:
        others = [h for h in by_pool.get(r["pool"], []) if h is not r["hit_ratio"]]
        best = max(others) if others else None
        if r["state"] in st.SERVING and best and best > 0.05 and (r["hit_ratio"] or 0) < best / 2:
            r["classes"]["prefix_hit"] = "cold"
            r["title"]["prefix_hit"] += f" — under half of the best node in pool {r['pool']} ({_pct(best, 1)})"
    return rows


class TrafficCache:
    """The request-log figures of the Pools/Cache pages and the Fleet page's pool line.

    A :class:`~kvgate.web.admin.traffic.TrafficTracker` reads the gateway's request log
    incrementally: the first refresh reads the last 15 minutes, later ones only what was
    logged since (a Fleet page polls every 2 s). The figures are reused for TRAFFIC_CACHE_S;
    the cache's entry count (a SCAN of Redis) only for the Cache page, for CACHE_STATS_S."""

    CACHE_STATS_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = 0.0
        self._key: Any = None
        self._value: Any = None
        self._clients: dict[str, redis.Redis] = {}
        self._tracker: Any = None
        self._tracker_url: str | None = None
        self._stats: tuple[float, Any, Any] = (0.0, None, None)

    def reset(self) -> None:
        """Refresh on the next call (after an action that changes the figures)."""
        self._key = None
        self._stats = (0.0, None, None)

    def redis_for(self, url: str) -> redis.Redis:
        client = self._clients.get(url)
        if client is None:
            client = redisconn.from_url(url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
            self._clients[url] = client
        return client

    def get(self, plane: Any, cache_stats: bool = False) -> dict[str, Any]:
        """``{"pools": {name: figures} | None, "cache": {...} | None, "error": str | None}``
        (``cache`` only with ``cache_stats``). Never raises for Redis: ``error`` says it."""
        from .traffic import TrafficTracker
        from .traffic import cache_stats as read_cache_stats

        policy = plane.policy
        assert policy is not None
        key = id(policy)  # the figures depend on the policy only (the homes are logged)
        with self._lock:
            if not (self._key == key and time.monotonic() - self._at < TRAFFIC_CACHE_S):
                r = self.redis_for(policy.redis.client_url)
                if self._tracker is None or self._tracker_url != policy.redis.client_url:
                    self._tracker = TrafficTracker(window_s=TRAFFIC_WINDOW_S)  # its first update backfills
                    self._tracker_url = policy.redis.client_url
                value: dict[str, Any] = {"pools": None, "cache": None, "error": None}
                try:
                    self._tracker.update(r, policy)
                    value["pools"] = {p["pool"]: p for p in self._tracker.view(policy)}
                except redis.RedisError as exc:
                    value["error"] = f"the gateway's Redis ({policy.redis.url}) cannot be read: {exc}"
                except Exception as exc:  # a page must degrade with a message, never fail on the figures
                    log.exception("reading the request log failed")
                    value["error"] = f"the request log could not be analysed: {type(exc).__name__}: {exc}"
                self._key, self._at, self._value = key, time.monotonic(), value
            value = dict(self._value)
            if cache_stats and not value["error"]:
                at, version, stats = self._stats
                ns = plane.namespace_in_force
                if version != ns or time.monotonic() - at >= self.CACHE_STATS_S:
                    try:
                        stats = read_cache_stats(self.redis_for(policy.redis.client_url), ns)
                        self._stats = (time.monotonic(), ns, stats)
                    except redis.RedisError as exc:
                        value["error"] = f"the gateway's Redis ({policy.redis.url}) cannot be read: {exc}"
                        stats = None
                value["cache"] = stats
            return value


def pool_lines(plane: Any, traffic: TrafficCache, states: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One dict per pool for the Fleet page's pool line and the Pools page: the plane's pool view
    plus the request-log figures (affinity ratio, cache ratios, failovers, error ratio, serving
    node count, requests neither routed by key nor answered from the cache). ``states``: node id
    → state, when the caller has the nodes' view already (else read from ``nodes_view()``)."""
    t = traffic.get(plane)
    if states is None:
        states = {n["id"]: n["state"] for n in plane.nodes_view()}
    out = []
    for p in plane.pools_view():
        tv = (t.get("pools") or {}).get(p["name"]) or {}
        serving = [i for i in p["nodes"] if states.get(i) in st.SERVING]
        requests_n = tv.get("requests") or 0
        out.append({**p, "affinity_ratio": tv.get("affinity_ratio"), "routed": tv.get("routed"),
                    "requests": tv.get("requests"), "cache_ratio": tv.get("cache_ratio") or {},
                    "failovers_window": tv.get("failovers"), "serving": len(serving),
                    "error_ratio": (tv.get("errors") or 0) / requests_n if requests_n else None,
                    "unjudged": max(0, requests_n - (tv.get("routed") or 0)
                                    - ((tv.get("cache") or {}).get("HIT") or 0))})
    return out
