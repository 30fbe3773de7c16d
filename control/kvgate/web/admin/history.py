"""Per-node time series for the admin page's charts and rate figures, kept in memory.

Two feeds, both pushed by the control plane:

- **agent reports** (:meth:`History.add_report`, one per node every ~2 s; shape:
  :mod:`kvgate.control.report`). From ``report["engine"]``: the gauges ``waiting`` and
  ``running`` (requests; vLLM ``vllm:num_requests_waiting`` / ``vllm:num_requests_running``),
  ``kv_cache_usage`` (0..1; ``vllm:kv_cache_usage_perc``) and the cumulative token counters
  ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens; vLLM's counters
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, exposed with a ``_total`` suffix,
  ``vllm:gpu_prefix_cache_*`` in older versions; SGLang has none: the ratio is then None),
  whose increases give the prefix-cache hit ratio of each interval between two reports. Where
  the agent reads each figure: :mod:`kvgate.agent.collect`. From ``report["gpu"]["devices"]``
  (NVML): mean utilisation (%) and the memory in use (fraction of the total, over all devices).
- **gateway snapshots** (:meth:`History.add_gateway`, one per reconciler tick; the dict of
  ``ControlPlane._fetch_gateway``): per node the cumulative answers (``kvgate_requests_total``)
  and 5xx answers among them, which give requests per second and the error rate.

Counters are turned into increases between consecutive samples. A counter that went down (an
engine restart, an nginx restart) started again from 0: its increase is its new value. An
engine whose ``start_time`` (``process_start_time_seconds``) changed restarted as well, even
if its counters already climbed past their old values. The first sample of a node has no
increase (nothing to compare with).

Everything is kept for ``window_s`` seconds (and at most ``maxlen`` samples a node and feed,
so memory stays bounded whatever the report rate); :meth:`History.forget` drops a node. Times
are Unix seconds (``time.time()``), as the control plane stamps a report when it receives it.
All methods are thread-safe (one lock; no I/O under it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

DEFAULT_WINDOW_S = 900.0
"""How much history is kept and charted: 15 minutes."""

DEFAULT_MAXLEN = 5000
"""Samples kept per node and feed at most: 15 minutes of reports every 0.18 s, far more than
agents (2 s) or the reconciler (1 s) send; a flood cannot grow memory past it."""

DEFAULT_GAP_S = 10.0
"""Two consecutive reports further apart than this have a gap between them in :meth:`History.series`
(no report came: the agent or the control plane was down)."""


def _num(value: Any) -> float | None:
    """A finite number, or None (missing, not a number, NaN, infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass
class _Report:
    ts: float
    waiting: float | None
    running: float | None
    kv_cache_usage: float | None
    gpu_util_pct: float | None
    gpu_mem_frac: float | None
    hits: float | None        # prefix-cache hit tokens since the previous report (None: unknown)
    queries: float | None     # prefix-cache query tokens since the previous report

    @property
    def hit_ratio(self) -> float | None:
        if self.hits is None or not self.queries:
            return None
        return min(1.0, self.hits / self.queries)


@dataclass
class _Answers:
    since: float              # the previous snapshot's time
    ts: float
    requests: float           # answers between the two snapshots
    errors: float             # 5xx answers among them


@dataclass
class _Node:
    reports: deque[_Report]
    answers: deque[_Answers]
    # the last cumulative values seen (kept while samples age out, so the next increase is right)
    queries: float | None = None
    hits: float | None = None
    start_time: float | None = None
    requests: float | None = None
    errors: float | None = None
    gateway_ts: float | None = None   # time of the snapshot `requests`/`errors` come from


class History:
    """Per-node samples of the last ``window_s`` seconds (see the module docstring).

    ``maxlen`` caps each node's samples per feed; ``gap_s`` is the distance between two reports
    above which :meth:`series` puts a gap (a row of None) between them.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, *, maxlen: int = DEFAULT_MAXLEN,
                 gap_s: float = DEFAULT_GAP_S):
        if window_s <= 0 or maxlen < 2 or gap_s <= 0:
            raise ValueError("window_s and gap_s must be > 0 and maxlen >= 2")
        self.window_s = float(window_s)
        self.maxlen = int(maxlen)
        self.gap_s = float(gap_s)
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        # per tenant: the last cumulative (answers, 429s) and the window's deltas (ts, answers, 429s)
        self._tenant_last: dict[str, tuple[float, float]] = {}
        self._tenants: dict[str, deque] = {}
        self._tenant_scraped = False

    # ------------------------------------------------------------------ feeds
    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(deque(maxlen=self.maxlen), deque(maxlen=self.maxlen))
        return node

    def _prune(self, samples: deque, now: float) -> None:
        # One sample older than the window is kept: it is the base of the window's first interval.
        cutoff = now - self.window_s
        while len(samples) > 1 and samples[1].ts <= cutoff:
            samples.popleft()

    def add_report(self, node_id: str, ts: float, report: dict[str, Any]) -> None:
        """One agent report of ``node_id`` received at ``ts`` (Unix seconds): the checked report
        (:func:`kvgate.control.report.check_report`), any part of which may be missing or None.

        A report older than the node's last one means the clock went back: the node's history
        starts again from it (its counters included)."""
        engine = report.get("engine") or {}
        gpu = report.get("gpu") or {}
        devices = [d for d in (gpu.get("devices") or []) if isinstance(d, dict)]
        utils = [u for u in (_num(d.get("utilization_pct")) for d in devices) if u is not None]
        memory = [(_num(d.get("memory_used_bytes")), _num(d.get("memory_total_bytes"))) for d in devices]
        mem_frac = None
        if memory and all(u is not None and t for u, t in memory):      # every device's figures
            mem_frac = sum(u for u, _ in memory) / sum(t for _, t in memory)
        queries, hits = _num(engine.get("prefix_cache_queries")), _num(engine.get("prefix_cache_hits"))
        start_time = _num(engine.get("start_time"))
        ts = float(ts)
        with self._lock:
            node = self._node(node_id)
            if node.reports and ts < node.reports[-1].ts:
                node.reports.clear()
                node.queries = node.hits = node.start_time = None
            d_queries = d_hits = None
            if queries is not None and hits is not None:
                restarted = (start_time is not None and node.start_time is not None
                             and start_time != node.start_time)
                if node.queries is not None and node.hits is not None:
                    if restarted or queries < node.queries or hits < node.hits:
                        d_queries, d_hits = queries, hits      # both counters started again from 0
                    else:
                        d_queries, d_hits = queries - node.queries, hits - node.hits
                node.queries, node.hits = queries, hits
                if start_time is not None:
                    node.start_time = start_time
            # (an engine that did not answer keeps the last counters: the next answer's increase
            # spans the silence)
            node.reports.append(_Report(
                ts=ts,
                waiting=_num(engine.get("waiting")),
                running=_num(engine.get("running")),
                kv_cache_usage=_num(engine.get("kv_cache_usage")),
                gpu_util_pct=sum(utils) / len(utils) if utils else None,
                gpu_mem_frac=mem_frac,
                hits=d_hits,
                queries=d_queries,
            ))
            self._prune(node.reports, ts)

    def add_gateway(self, ts: float, snap: dict[str, Any]) -> None:
        """One gateway snapshot taken at ``ts``: ``{"ok", "requests": {node: cumulative answers},
        "errors": {node: cumulative 5xx answers}, ...}``. Ignored unless ``snap["ok"]`` (the
        scrape failed: a gap). Nodes missing from ``requests`` get no sample."""
        if not snap.get("ok"):
            return
        ts = float(ts)
        errors = snap.get("errors") or {}
        with self._lock:
            self._add_tenants(ts, snap.get("tenant_requests") or {}, snap.get("ratelimited") or {})
            for node_id, value in (snap.get("requests") or {}).items():
                req = _num(value)
                if req is None:
                    continue
                err = _num(errors.get(node_id)) or 0.0
                node = self._node(str(node_id))
                if node.gateway_ts is not None and ts < node.gateway_ts:   # the clock went back
                    node.answers.clear()
                    node.requests = node.errors = node.gateway_ts = None
                if node.requests is not None and node.errors is not None and node.gateway_ts is not None:
                    if req < node.requests or err < node.errors:          # nginx restarted: from 0
                        d_req, d_err = req, err
                    else:
                        d_req, d_err = req - node.requests, err - node.errors
                    node.answers.append(_Answers(node.gateway_ts, ts, d_req, min(d_err, d_req)))
                    self._prune(node.answers, ts)
                node.requests, node.errors, node.gateway_ts = req, err, ts

    def _add_tenants(self, ts: float, requests: dict[str, Any], limited: dict[str, Any]) -> None:
        first = not self._tenant_scraped
        self._tenant_scraped = True
        for tenant in set(requests) | set(limited):
            req, lim = _num(requests.get(tenant)) or 0.0, _num(limited.get(tenant)) or 0.0
            last = self._tenant_last.get(tenant)
            self._tenant_last[tenant] = (req, lim)
            if last is None:
                if first:
                    continue  # counted before this control plane looked: not in the window
                last = (0.0, 0.0)  # a tenant's samples appear with its first request
            d_req, d_lim = (req, lim) if req < last[0] or lim < last[1] else (req - last[0], lim - last[1])
            q = self._tenants.setdefault(tenant, deque(maxlen=self.maxlen))
            q.append((ts, d_req, d_lim))
            while q and q[0][0] < ts - self.window_s:
                q.popleft()

    def tenant_totals(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """Per tenant over the window: ``{"requests", "ratelimited"}`` (answers and 429s counted by
        the gateway between the control plane's scrapes; the tenant ``none`` is gateway.auth off)."""
        now = time.time() if now is None else now
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for tenant, q in self._tenants.items():
                req = sum(d for ts, d, _ in q if ts >= now - self.window_s)
                lim = sum(d for ts, _, d in q if ts >= now - self.window_s)
                out[tenant] = {"requests": req, "ratelimited": lim}
        return out

    def forget(self, node_id: str) -> None:
        """Drop everything about ``node_id`` (it left the policy)."""
        with self._lock:
            self._nodes.pop(node_id, None)

    def nodes(self) -> list[str]:
        """The node ids with any history, sorted."""
        with self._lock:
            return sorted(self._nodes)

    # ------------------------------------------------------------------ reading
    def series(self, node_id: str, now: float | None = None) -> dict[str, list]:
        """The charts' data: the node's reports of the last ``window_s`` seconds before ``now``
        (default: the current time), oldest first, as aligned arrays (uPlot's data layout)::

            {"t": [Unix seconds],
             "prefix_hit_ratio": [0..1 | None],   # Δhits/Δqueries since the previous report
             "waiting": [requests | None], "running": [requests | None],
             "kv_cache_usage": [0..1 | None],
             "gpu_util_pct": [0..100 | None],     # mean over the node's GPUs
             "gpu_mem_frac": [0..1 | None]}       # memory used / total over its GPUs

        None is a gap: the figure was missing from that report, or (prefix_hit_ratio) no
        previous report or no query in the interval. Between two reports more than ``gap_s``
        apart a row of None is inserted (at the midpoint), so a line is not drawn across the
        silence. An unknown node gives empty arrays."""
        now = time.time() if now is None else float(now)
        cutoff = now - self.window_s
        out: dict[str, list] = {k: [] for k in ("t", "prefix_hit_ratio", "waiting", "running",
                                                "kv_cache_usage", "gpu_util_pct", "gpu_mem_frac")}
        with self._lock:
            node = self._nodes.get(node_id)
            samples = [s for s in node.reports if cutoff < s.ts <= now] if node else []
        prev_ts = None
        for s in samples:
            if prev_ts is not None and s.ts - prev_ts > self.gap_s:
                out["t"].append((prev_ts + s.ts) / 2)
                for k in out:
                    if k != "t":
                        out[k].append(None)
            prev_ts = s.ts
            out["t"].append(s.ts)
            out["prefix_hit_ratio"].append(s.hit_ratio)
            out["waiting"].append(s.waiting)
            out["running"].append(s.running)
            out["kv_cache_usage"].append(s.kv_cache_usage)
            out["gpu_util_pct"].append(s.gpu_util_pct)
            out["gpu_mem_frac"].append(s.gpu_mem_frac)
        return out

    def rates(self, node_id: str, now: float | None = None, over_s: float = 60.0) -> dict[str, Any]:
        """Figures over the last ``over_s`` seconds before ``now`` (at most ``window_s``)::

            {"req_s": answers per second | None,
             "error_rate": 5xx answers / answers (0..1) | None,
             "prefix_hit_ratio": Σ Δhits / Σ Δqueries (0..1) | None,
             "samples": agent reports received in those seconds}

        ``req_s`` is the answers counted between consecutive gateway snapshots, over the
        intervals that end in the span, divided by the time those intervals cover (the first
        one may begin before the span): None without two snapshots; ``error_rate`` is None when
        there was no answer; ``prefix_hit_ratio`` None when no report in the span had a counted
        query."""
        now = time.time() if now is None else float(now)
        cutoff = now - over_s
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return {"req_s": None, "error_rate": None, "prefix_hit_ratio": None, "samples": 0}
            answers = list(node.answers)
            reports = [s for s in node.reports if cutoff < s.ts <= now]
        req_s = error_rate = None
        # the intervals between snapshots that end in the span (the first may begin before it)
        recent = [a for a in answers if cutoff < a.ts <= now]
        if recent:
            n_req = sum(a.requests for a in recent)
            n_err = sum(a.errors for a in recent)
            span = recent[-1].ts - recent[0].since
            if span > 0:
                req_s = n_req / span
            if n_req > 0:
                error_rate = min(1.0, n_err / n_req)
        q = sum(s.queries for s in reports if s.queries is not None and s.hits is not None)
        h = sum(s.hits for s in reports if s.queries is not None and s.hits is not None)
        return {
            "req_s": req_s,
            "error_rate": error_rate,
            "prefix_hit_ratio": min(1.0, h / q) if q > 0 else None,
            "samples": len(reports),
        }
