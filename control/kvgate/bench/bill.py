"""``kvgate bench bill``: the bill of one mixed workload, plain baseline against kvgate (issue 16).

On the running stack (``kvgate up policies/demo.yaml``; ``make demo`` runs this), the mixed
workload of :mod:`kvgate.bench.mix` (its shares and sizes in ``bench/mix.yaml``) is sent twice
through the same gateway and engines:

* **baseline** — every pool on ``round_robin``, the response cache off (``cache.enabled: false``)
  and the semantic cache and static answers off, the offline job posted line by line as live
  requests: what a fleet behind a plain load balancer pays;
* **kvgate** — the running policy as it is (its balancer, the exact, semantic and static caches),
  the offline job through the Batch API.

Both policies are applied through the control plane (a policy version each; the running one is
restored at the end, also on error). Before each run the engines' prefix caches are reset, the
response cache is retired (``kvgate invalidate``: a new namespace, so no answer of an earlier run
is served) and the engines are idle. Each run is measured three ways, side by side:

1. **the engines' own counters** (deltas of ``vllm:prompt_tokens_total``,
   ``vllm:prefix_cache_hits_total``, ``vllm:generation_tokens_total`` and the simulator's
   ``kvgate_sim_busy_seconds_total``): prefill tokens computed = prompt − hits;
2. **the usage rollups** (what ``kvgate costs`` and ``GET /api/v1/costs`` show): the run's
   buckets are the difference of every bucket of ``kvgate:usage:hours`` after and before it, so
   ``cost_usd`` is exactly what ``kvgate costs`` adds for the run, at the policy's prices;
3. **the answers at the client**: TTFT per request, ``X-Kvgate-Cache`` and each answer's usage.

**Levers** (the saving split by what caused it, in $): the two runs send the same items, paired
by id. An item kvgate answered without an engine (``HIT``, ``SEMANTIC``, ``STATIC``) saves its
whole baseline cost, credited to the response cache's exact, semantic or static path; a live item
the engines computed in both runs saves baseline − kvgate cost, credited to prefix affinity (the
same request, routed to the node that holds its prefix); the offline job saves its baseline
cost (live, line by line, round robin) − its Batch API cost, split into the batch discount
(its cost at full price − the discounted cost) and prefix-grouped scheduling (the rest). Per
item cost = uncached prompt × input + cached × cached-input + completion × output price (the
gateway's rule, ``lua/kvgate/usage.lua``), so the levers add up to the client-side total
exactly; the report also checks them against the rollups' totals (``levers_vs_rollups``: the
relative difference, required ≤ 1 %).

Nothing else may use the engines meanwhile. Exit 1 when a request failed or the levers do not add
up to the rollups' saving within 1 %; the issue's targets (cost ≤ 0.5×, multi-turn TTFT p50 ≤ 0.6×)
are printed ✓/✗ beside them (see :func:`check_bill`).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import redisconn
from ..policy.pricing import NANO_PER_USD, TokenPrices
from .replay import ReplayError, _percentile, reset_prefix_caches, scrape_engine, wait_engines_idle

PROMPT = "vllm:prompt_tokens_total"
HITS = "vllm:prefix_cache_hits_total"
OUTPUT = "vllm:generation_tokens_total"
BUSY = "kvgate_sim_busy_seconds_total"
ENGINE_COUNTERS = (PROMPT, HITS, OUTPUT, BUSY)
NO_ENGINE = {"HIT": "exact", "SEMANTIC": "semantic", "STATIC": "static"}
"""``X-Kvgate-Cache`` values of an answer no engine computed, by the response cache's path."""
LEVERS = ("prefix_affinity", "cache_exact", "cache_semantic", "cache_static", "batch_discount", "batch_grouping")
LEVER_NAMES = {
    "prefix_affinity": "prefix affinity (same request, cache-warm node)",
    "cache_exact": "response cache: exact repeats",
    "cache_semantic": "semantic cache: paraphrases",
    "cache_static": "static FAQ answers",
    "batch_discount": "Batch API: batch price",
    "batch_grouping": "Batch API: prefix-grouped schedule",
}
MAX_LEVER_MISMATCH = 0.01
REQLOG_FLUSH_S = 0.5
"""How often each gateway worker sends its request log to Redis (lua/kvgate/reqlog.lua INTERVAL_S)."""


# ------------------------------------------------------------------ pricing
def item_cost_nusd(prices: TokenPrices, prompt: int, cached: int, completion: int,
                   batch_discount: float | None = None) -> int:
    """One answer's cost in n$ by the gateway's rule (``lua/kvgate/usage.lua``): uncached prompt
    tokens at the input price, cached ones at the cached-input price, completion tokens at the
    output price; a batch line pays ``floor(full × (1 − batch_discount))``."""
    cached = max(0, min(cached, prompt))
    full = (prompt - cached) * prices.input + cached * prices.cached_input + completion * prices.output
    if batch_discount:
        return math.floor(full * (1 - batch_discount))
    return full


def _usd(nusd: float) -> float:
    return nusd / NANO_PER_USD


# ------------------------------------------------------------- measurements
def engine_snapshot(nodes) -> dict[str, float]:
    """Σ over ``nodes`` of :data:`ENGINE_COUNTERS` (0 for a counter an engine lacks, e.g. the
    simulator's busy seconds on a real vLLM). Raises ReplayError."""
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for n in nodes:
        snap = _scrape_all(n)
        for k in ENGINE_COUNTERS:
            out[k] += snap.get(k, 0.0)
    return out


def _scrape_all(node) -> dict[str, float]:
    # scrape_engine keeps only the replay's names; read the busy counter and output tokens too
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    snap = scrape_engine(node)
    try:
        text = requests.get(f"{node.url}/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in (OUTPUT, BUSY):
                    snap[s.name] = snap.get(s.name, 0.0) + s.value
    except (requests.RequestException, ValueError) as exc:
        raise ReplayError(f"node {node.id}: cannot read {node.url}/metrics: {exc}") from None
    return snap


def bucket_snapshot(r: redis.Redis) -> dict[str, dict[str, int]]:
    """Every usage rollup bucket (``kvgate:usage:hours``), as ``kvgate costs`` reads them."""
    from ..costs.report import read_buckets

    return read_buckets(r, 0, int(time.time()) + 3600)


def bucket_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``after − before`` per bucket and field: the rollups of what happened in between."""
    out: dict[str, dict[str, int]] = {}
    for key, fields in after.items():
        prev = before.get(key, {})
        d = {f: v - prev.get(f, 0) for f, v in fields.items()}
        if any(d.values()):
            out[key] = d
    return out


def _requests(delta: dict[str, dict[str, int]]) -> int:
    return sum(fields.get("requests", 0) for fields in delta.values())


def rollup_report(delta: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The ``kvgate costs --by tenant`` report object of a run's buckets (:func:`bucket_delta`)."""
    from ..costs.report import summarize

    return summarize(delta, "tenant", 0, int(time.time()) + 3600)


@dataclass
class RunBill:
    """One run's figures; ``as_json`` is the documented ``bill.baseline`` / ``bill.kvgate`` shape."""

    name: str
    engines: dict[str, float]
    rollups: dict[str, Any]
    live: list[Any]
    batch: dict[str, Any]
    wall_s: float
    item_costs: dict[str, int] = field(default_factory=dict)      # live item id → n$
    batch_cost_nusd: int = 0
    batch_full_nusd: int = 0

    def ttft(self, kinds: tuple[str, ...] | None = None) -> tuple[float, float]:
        vals = [o.ttft_s for o in self.live if o.ok and o.ttft_s is not None and (kinds is None or o.kind in kinds)
                and o.kind != "batch_live"]
        if not vals:
            return float("nan"), float("nan")
        return _percentile(vals, 50), _percentile(vals, 99)

    def as_json(self) -> dict[str, Any]:
        e, tot = self.engines, self.rollups["total"]
        live = [o for o in self.live if o.kind != "batch_live"]
        ok = sum(o.ok for o in self.live) + self.batch.get("ok", 0)
        failed = sum(not o.ok for o in self.live) + self.batch.get("failed", 0)
        p50, p99 = self.ttft()
        mt50, mt99 = self.ttft(("multi_turn",))
        without = {path: sum(1 for o in live if o.ok and NO_ENGINE.get(o.cache or "") == path)
                   for path in NO_ENGINE.values()}
        kinds: dict[str, dict[str, Any]] = {}
        for o in self.live:
            k = kinds.setdefault(o.kind, {"requests": 0, "failed": 0})
            k["requests"] += 1
            k["failed"] += not o.ok
        for kind, k in kinds.items():
            k["ttft_p50_s"], k["ttft_p99_s"] = (round(v, 4) for v in self.ttft((kind,)))
        return {
            "cost_usd": round(tot["cost_usd"], 6),
            "cost_per_ok_usd": round(tot["cost_usd"] / ok, 9) if ok else None,
            "engine_prompt_tokens": int(e[PROMPT]),
            "engine_cached_tokens": int(e[HITS]),
            "engine_prefill_tokens": int(e[PROMPT] - e[HITS]),
            "engine_output_tokens": int(e[OUTPUT]),
            "engine_busy_s": round(e[BUSY], 1),
            "requests": ok + failed,
            "requests_ok": ok,
            "requests_failed": failed,
            "answered_without_engine": without,
            "live_ttft_p50_s": round(p50, 4),
            "live_ttft_p99_s": round(p99, 4),
            "multi_turn_ttft_p50_s": round(mt50, 4),
            "multi_turn_ttft_p99_s": round(mt99, 4),
            "by_kind": kinds,
            "batch": self.batch,
            "rollups": {"prompt": tot["prompt"], "cached": tot["cached"], "completion": tot["completion"],
                        "hits": tot["hits"], "saved_usd": tot["saved_usd"],
                        "by_tenant": {row["key"]: round(row["cost_usd"], 6) for row in self.rollups["rows"]}},
            "wall_s": round(self.wall_s, 1),
        }


def live_item_costs(live, prices: TokenPrices) -> dict[str, int]:
    """Cost in n$ of every live outcome by item id: 0 for one no engine computed (a cache answer
    records no cost), the gateway's rule otherwise; a failed item costs what its usage says (0 when
    it has none)."""
    out: dict[str, int] = {}
    for o in live:
        if NO_ENGINE.get(o.cache or ""):
            out[o.id] = 0
            continue
        out[o.id] = item_cost_nusd(prices, o.prompt_tokens or 0, o.cached_tokens or 0, o.completion_tokens or 0)
    return out


def levers(base: RunBill, kv: RunBill) -> dict[str, int]:
    """The saving baseline − kvgate split by lever, n$ (see the module). The levers add up to
    (Σ baseline item costs) − (Σ kvgate live item costs + the kvgate batch's cost), exactly.

    Raises:
        ValueError: a live item of one run is missing from the other (the runs did not send the
            same workload).
    """
    out = dict.fromkeys(LEVERS, 0)
    kv_live = {o.id: o for o in kv.live}
    base_live = {o.id for o in base.live if o.kind != "batch_live"}
    if base_live != set(kv_live):
        missing = sorted(base_live ^ set(kv_live))[:5]
        raise ValueError(f"the two runs sent different live items (e.g. {', '.join(missing)})")
    base_batch = 0
    for o in base.live:
        cost = base.item_costs[o.id]
        if o.kind == "batch_live":
            base_batch += cost
            continue
        k = kv_live[o.id]
        path = NO_ENGINE.get(k.cache or "")
        if path:
            out["cache_" + path] += cost
        else:
            out["prefix_affinity"] += cost - kv.item_costs[o.id]
    out["batch_discount"] = kv.batch_full_nusd - kv.batch_cost_nusd
    out["batch_grouping"] = base_batch - kv.batch_full_nusd
    return out


# --------------------------------------------------------------- the runs
def baseline_policy(policy):
    """The plain baseline of ``policy``: every pool on round robin, the exact response cache off,
    the semantic cache and static answers off. Everything else (nodes, prices, tenants, limits) as is."""
    pools = [p.model_copy(update={"balancer": "round_robin",
                                  "semantic": p.semantic.model_copy(update={"enabled": False,
                                                                            "static_answers": None})})
             for p in policy.pools]
    return policy.model_copy(update={"pools": pools, "cache": policy.cache.model_copy(update={"enabled": False})})


def batch_costs(outputs: dict[str, dict[str, Any]], prices: TokenPrices, discount: float) -> tuple[int, int]:
    """``(cost, cost at full price)`` in n$ of the Batch API's lines from their output usage
    (``{custom_id: usage}``), each line priced by :func:`item_cost_nusd`."""
    cost = full = 0
    for usage in outputs.values():
        p = int(usage.get("prompt_tokens") or 0)
        c = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or usage.get("cached_tokens") or 0)
        o = int(usage.get("completion_tokens") or 0)
        full += item_cost_nusd(prices, p, c, o)
        cost += item_cost_nusd(prices, p, c, o, discount)
    return cost, full


def run_once(name: str, mode: str, *, mix, gateway: str, keys: dict[str, str], nodes, r: redis.Redis,
             prices: TokenPrices, discount: float, speedup: float, concurrency: int, console: Console) -> RunBill:
    """One run of the mix (``mode`` "baseline" or "kvgate") on an applied policy: prefix caches
    reset, engines idle, counters and rollups snapshotted around it. Raises ReplayError."""
    from .costs import _wait, consumer_caught_up
    from .mix import run_mix

    wait_engines_idle(nodes, timeout=120)
    reset_prefix_caches(nodes)
    _wait(lambda: consumer_caught_up(r), 60, "the usage consumer to catch up before the run")
    e0, b0 = engine_snapshot(nodes), bucket_snapshot(r)
    t0 = time.monotonic()
    with Progress(TextColumn(f"{name:>9} {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        res = asyncio.run(run_mix(mix, gateway=gateway, keys=keys, mode=mode, speedup=speedup,
                                  concurrency=concurrency, progress=progress))
    wall = time.monotonic() - t0
    wait_engines_idle(nodes, timeout=180)
    # Every request of the run in the rollups: the gateway sends its request log every
    # REQLOG_FLUSH_S (lua/kvgate/reqlog.lua INTERVAL_S, 0.5 s), so a stream the consumer caught up
    # with can still lack the run's last answers; and the rollups must count at least the
    # requests the run sent (the Batch API's own calls count too, hence >=).
    sent = len(res.live) + (res.batch_ok or 0) + (res.batch_failed or 0)
    time.sleep(2 * REQLOG_FLUSH_S)
    _wait(lambda: consumer_caught_up(r) and _requests(bucket_delta(b0, bucket_snapshot(r))) >= sent, 120,
          f"the usage consumer to roll the run's {sent:,} requests up")
    e1, b1 = engine_snapshot(nodes), bucket_snapshot(r)
    engines = {k: e1[k] - e0[k] for k in ENGINE_COUNTERS}
    bill = RunBill(name=name, engines=engines, rollups=rollup_report(bucket_delta(b0, b1)), live=res.live,
                   batch={"id": res.batch_id, "status": res.batch_status, "ok": res.batch_ok,
                          "failed": res.batch_failed},
                   wall_s=wall)
    bill.item_costs = live_item_costs(res.live, prices)
    bill.batch_cost_nusd, bill.batch_full_nusd = batch_costs(res.batch_output or {}, prices, discount)
    return bill


def build_bill(base: RunBill, kv: RunBill, params: dict[str, Any]) -> dict[str, Any]:
    """The ``bill`` object of ``demo-report.json`` (documented in docs/benchmarks.md, "The bill")."""
    lv = levers(base, kv)
    client_base = sum(base.item_costs.values())
    client_kv = sum(kv.item_costs.values()) + kv.batch_cost_nusd
    saving_client = client_base - client_kv
    b, k = base.as_json(), kv.as_json()
    saving = b["cost_usd"] - k["cost_usd"]
    sum_levers = _usd(sum(lv.values()))
    mismatch = abs(sum_levers - saving) / abs(saving) if saving else float("nan")
    ratio = lambda a, c: round(a / c, 3) if c else None  # noqa: E731
    return {
        "baseline": b,
        "kvgate": k,
        "levers": {name: round(_usd(v), 6) for name, v in lv.items()},
        "saving_usd": round(saving, 6),
        "saving_usd_client": round(_usd(saving_client), 6),
        "sum_of_levers_usd": round(sum_levers, 6),
        "levers_vs_rollups": round(mismatch, 5),
        "cost_ratio": ratio(k["cost_usd"], b["cost_usd"]),
        "prefill_ratio": ratio(k["engine_prefill_tokens"], b["engine_prefill_tokens"]),
        "multi_turn_ttft_p50_ratio": ratio(k["multi_turn_ttft_p50_s"], b["multi_turn_ttft_p50_s"]),
        "by_part": by_part(b, k, params, client_part_costs(base), client_part_costs(kv)),
        "mix": params,
    }


PARTS = (("trace", "live chat (the trace)"), ("multi_turn", "multi-turn chat"),
         ("faq", "FAQ"), ("batch", "offline job"))
"""The mix's parts (mix.yaml's kinds) in the table's order, with their row labels."""


def client_part_costs(run: RunBill) -> dict[str, int]:
    """n$ per part of the mix by the answers' usage at the client (the levers' side of the bill):
    live items by their kind (the baseline's job lines are ``batch_live``), the Batch API's lines
    as ``batch``."""
    out = dict.fromkeys((p for p, _ in PARTS), 0)
    for o in run.live:
        out["batch" if o.kind == "batch_live" else o.kind] += run.item_costs.get(o.id, 0)
    out["batch"] += run.batch_cost_nusd
    return out


def by_part(b: dict[str, Any], k: dict[str, Any], params: dict[str, Any],
            b_client: dict[str, int] | None = None, k_client: dict[str, int] | None = None) -> dict[str, Any]:
    """Each part of the mix's cost in both runs, from the rollups' per-tenant sums (every part
    has its own tenants, mix.yaml): ``{part: {tenants, baseline_usd, kvgate_usd, ratio}}``, plus
    ``baseline_client_usd``/``kvgate_client_usd`` (the same by the answers' usage, n$ maps of
    :func:`client_part_costs`) when given. It shows where the bill is, which part a lever can
    move, and where the two sides of the bill differ (docs/benchmarks.md, "The bill")."""
    tenants = {"trace": list(params["trace"]["tenants"]), "multi_turn": [params["multi_turn"]["tenant"]],
               "faq": [params["faq"]["tenant"]], "batch": [params["batch"]["tenant"]]}
    out = {}
    for part, _label in PARTS:
        bu = sum(b["rollups"]["by_tenant"].get(t, 0.0) for t in tenants[part])
        ku = sum(k["rollups"]["by_tenant"].get(t, 0.0) for t in tenants[part])
        out[part] = {"tenants": tenants[part], "baseline_usd": round(bu, 6), "kvgate_usd": round(ku, 6),
                     "ratio": round(ku / bu, 3) if bu else None}
        if b_client is not None and k_client is not None:
            out[part]["baseline_client_usd"] = round(_usd(b_client[part]), 6)
            out[part]["kvgate_client_usd"] = round(_usd(k_client[part]), 6)
    return out


def _money(v: float) -> str:
    return f"${v:,.4f}"


def render_bill(bill: dict[str, Any]) -> Table:
    """The table ``make demo`` prints: one row per figure, baseline beside kvgate."""
    b, k = bill["baseline"], bill["kvgate"]
    t = Table(title="kvgate bench bill: one mixed workload, plain baseline against kvgate", title_justify="left")
    t.add_column("figure")
    t.add_column("baseline", justify="right")
    t.add_column("kvgate", justify="right")
    t.add_column("kvgate ÷ baseline", justify="right")

    def row(label: str, key: str, fmt) -> None:
        bv, kv = b[key], k[key]
        r = f"{kv / bv:.3f}" if isinstance(bv, (int, float)) and bv and isinstance(kv, (int, float)) else "—"
        t.add_row(label, fmt(bv), fmt(kv), r)

    tok = lambda v: f"{v:,}"  # noqa: E731
    row("cost at the policy's prices (kvgate costs)", "cost_usd", _money)
    row("cost per successful request", "cost_per_ok_usd", lambda v: "—" if v is None else f"${v * 1e3:.4f}/1k")
    row("prefill tokens computed (engines)", "engine_prefill_tokens", tok)
    row("prefix-cache hit tokens (engines)", "engine_cached_tokens", tok)
    row("output tokens generated (engines)", "engine_output_tokens", tok)
    row("engine busy time, modelled s (Σ engines)", "engine_busy_s", lambda v: f"{v:,.1f}")
    row("requests ok", "requests_ok", tok)
    row("requests failed", "requests_failed", tok)
    row("live TTFT p50 at the client", "live_ttft_p50_s", lambda v: f"{v * 1000:.0f} ms")
    row("live TTFT p99 at the client", "live_ttft_p99_s", lambda v: f"{v * 1000:.0f} ms")
    row("multi-turn TTFT p50 at the client", "multi_turn_ttft_p50_s", lambda v: f"{v * 1000:.0f} ms")
    row("multi-turn TTFT p99 at the client", "multi_turn_ttft_p99_s", lambda v: f"{v * 1000:.0f} ms")
    for path in ("exact", "semantic", "static"):
        t.add_row(f"answered without an engine: {path}", str(b["answered_without_engine"][path]),
                  str(k["answered_without_engine"][path]), "")
    t.add_section()
    base_total = b["cost_usd"] or 0.0
    for part, label in PARTS:
        x = bill["by_part"][part]
        share = f" ({x['baseline_usd'] / base_total:.0%} of baseline)" if base_total else ""
        t.add_row(f"cost: {label}{share}", _money(x["baseline_usd"]), _money(x["kvgate_usd"]),
                  "—" if x["ratio"] is None else f"{x['ratio']:.3f}")
    t.add_section()
    for name, v in bill["levers"].items():
        t.add_row(f"saved by {LEVER_NAMES[name]}", "", _money(v), "")
    t.add_row("Σ levers (client usage)", "", _money(bill["sum_of_levers_usd"]), "")
    t.add_row("saving (kvgate costs)", "", _money(bill["saving_usd"]),
              f"levers within {bill['levers_vs_rollups']:.2%}")
    return t


CHART_LABELS = {
    "prefix_affinity": "prefix affinity\n(cache-warm node)",
    "cache_exact": "response cache:\nexact repeats",
    "cache_semantic": "semantic cache:\nparaphrases",
    "cache_static": "static FAQ\nanswers",
    "batch_discount": "Batch API:\nbatch price",
    "batch_grouping": "Batch API:\nprefix-grouped",
}
PART_COLORS = {"trace": "#457b9d", "multi_turn": "#e9c46a", "faq": "#2a9d8f", "batch": "#f4a261"}


def write_chart(bill: dict[str, Any], path: Path) -> None:
    """The bill as a PNG (matplotlib, Agg): left, a waterfall from the baseline's cost through
    each lever's saving to kvgate's cost; right, each run's cost split by part of the mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, kv = bill["baseline"]["cost_usd"], bill["kvgate"]["cost_usd"]
    names = ["baseline"] + [CHART_LABELS.get(n, n) for n in bill["levers"]] + ["kvgate"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), dpi=110, gridspec_kw={"width_ratios": [3.2, 1]})
    level = base
    ax.bar(0, base, color="#888888")
    ax.text(0, base, _money(base), ha="center", va="bottom", fontsize=8)
    for i, v in enumerate(bill["levers"].values(), start=1):
        ax.bar(i, v, bottom=level - v, color="#2a9d8f" if v >= 0 else "#e76f51")
        ax.text(i, level, f"−{_money(v)}" if v >= 0 else f"+{_money(-v)}", ha="center", va="bottom", fontsize=8)
        level -= v
    ax.bar(len(names) - 1, kv, color="#264653")
    ax.text(len(names) - 1, kv, f"{_money(kv)}\n({kv / base:.0%} of baseline)" if base else _money(kv),
            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("cost of the run, $ (the policy's prices)")
    ax.set_title("What each lever saved", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    parts = bill.get("by_part") or {}
    if parts:
        for x, key in enumerate(("baseline_usd", "kvgate_usd")):
            bottom = 0.0
            for part, label in PARTS:
                v = parts[part][key]
                ax2.bar(x, v, bottom=bottom, color=PART_COLORS[part], label=label if x == 0 else None, width=0.6)
                if v > 0.04 * max(base, kv, 1e-12):
                    ratio = parts[part]["ratio"]
                    ax2.text(x, bottom + v / 2, f"{_money(v)}" + (f"\n×{ratio:.2f}" if x and ratio else ""),
                             ha="center", va="center", fontsize=7)
                bottom += v
        ax2.set_xticks([0, 1], ["baseline", "kvgate"], fontsize=8)
        ax2.set_ylabel("cost of the run, $", fontsize=8)
        ax2.set_title("Cost by part of the mix", fontsize=10)
        ax2.legend(fontsize=7, loc="upper right", frameon=False)
        ax2.set_ylim(0, max(base, kv) * 1.35)
        ax2.spines[["top", "right"]].set_visible(False)
    else:
        ax2.set_visible(False)
    fig.suptitle("The bill of one mixed workload, plain baseline against kvgate (kvgate bench bill)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


@click.command("bill")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="The conversation trace (default: the mix file's trace, relative to the repo).")
@click.option("--mix", "mix_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The mix's parameters (default: kvgate/bench/mix.yaml).")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Multiply the mix's window and every count by this (same rates and shares).")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Divide arrival times by this (1 / simulator.time_scale).")
@click.option("--concurrency", type=click.IntRange(min=1), default=256, show_default=True,
              help="Live requests in flight at most (the client's connection pool).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write {\"bill\": ...} here (make demo: demo-report.json).")
@click.option("--chart", "chart_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the waterfall chart (PNG) here.")
@click.pass_context
def bill_command(ctx: click.Context, trace_path: Path | None, mix_path: Path | None, scale: float, speedup: float,
                 concurrency: int, json_path: Path | None, chart_path: Path | None) -> None:
    """Send the mixed workload through the running stack twice — plain baseline, then kvgate —
    and print the bill: cost, tokens, TTFT, answers without an engine, the saving per lever."""
    from ..control.client import ControlClient, ControlError
    from ..control.token import read_token
    from ..policy import dump_policy
    from .batch import _tenant_key
    from .costs import running_stack
    from .mix import load_mix

    console = Console(stderr=True)
    stack, policy = running_stack(ctx)
    pool = policy.pools[0]
    nodes = [n for p in policy.pools for n in p.nodes]
    gateway = f"http://{policy.gateway.listen}"
    prices = pool.prices.nano_usd_per_token() if pool.prices else None
    if prices is None:
        raise click.UsageError(f"pool {pool.name} has no prices: the bill needs them (docs/costs.md)")
    discount = pool.prices.batch_discount or 0.0
    try:
        mix = load_mix(mix_path, trace_path=trace_path, model=pool.models[0], scale=scale)
    except (OSError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    r = redisconn.from_url(policy.redis.client_url, socket_timeout=10)
    client = ControlClient(stack.control_url(policy), read_token(stack.token_file), timeout=120)
    original = client.policy().get("yaml")
    keys: dict[str, str] = {}
    revokes = []
    try:
        for tenant in sorted(mix.tenants):
            keys[tenant], revoke = _tenant_key(stack, policy, tenant)
            revokes.append(revoke)
        console.print(f"mixed workload: {mix.describe()} through {gateway} "
                      f"({len(nodes)} engines, pool {pool.name}, balancer {pool.balancer})")
        client.apply(dump_policy(baseline_policy(policy)), source="kvgate bench bill (baseline)")
        console.print("[bold]baseline[/]: round robin, response/semantic cache off, the job line by line")
        base = run_once("baseline", "baseline", mix=mix, gateway=gateway, keys=keys, nodes=nodes, r=r,
                        prices=prices, discount=discount, speedup=speedup, concurrency=concurrency, console=console)
        client.apply(original, source="kvgate bench bill (kvgate)")
        inv = client.invalidate_cache(source="kvgate bench bill")
        console.print(f"[bold]kvgate[/]: {pool.balancer}, caches on (response cache namespace "
                      f"v{inv['old']} -> v{inv['new']}: empty), the job through the Batch API")
        kv = run_once("kvgate", "kvgate", mix=mix, gateway=gateway, keys=keys, nodes=nodes, r=r,
                      prices=prices, discount=discount, speedup=speedup, concurrency=concurrency, console=console)
    except (ReplayError, ControlError, redis.RedisError) as exc:
        click.echo(f"error: {exc}", err=True)
        try:
            client.apply(original, source="kvgate bench bill (restore)")
        except ControlError as exc2:
            click.echo(f"warning: could not restore the running policy: {exc2}", err=True)
        sys.exit(1)
    finally:
        for revoke in revokes:
            try:
                revoke()
            except Exception as exc:  # noqa: BLE001 - a leftover bench key is reported, not fatal
                console.print(f"[yellow]could not revoke a bench API key: {exc}[/]")

    bill = build_bill(base, kv, mix.params)
    Console(width=None if sys.stdout.isatty() else 130).print(render_bill(bill))
    checks, sound = check_bill(bill)
    for line in checks:
        console.print(line)
    if json_path:
        prev = {}
        if json_path.exists():
            try:
                prev = json.loads(json_path.read_text())
            except ValueError:
                prev = {}
        json_path.write_text(json.dumps({**prev, "bill": _no_nan(bill)}, indent=2, allow_nan=False) + "\n")
        click.echo(f"bill written to {json_path}")
    if chart_path:
        write_chart(bill, chart_path)
        click.echo(f"chart written to {chart_path}")
    if not sound:
        sys.exit(1)


def _no_nan(v: Any) -> Any:
    """``v`` with every NaN float as None: strict JSON (jq, browsers) has no NaN (a figure with no
    sample, e.g. the TTFT of the baseline's batch lines, which are not streamed)."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: _no_nan(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_no_nan(x) for x in v]
    return v


def check_bill(bill: dict[str, Any]) -> tuple[list[str], bool]:
    """The issue's acceptance, one ✓/✗ line each, and whether the **measurement** holds.

    Measurement (a ✗ here makes the command exit 1): no failed request in either run, and Σ
    levers within 1 % of the saving the rollups show (the bill adds up). Targets (issue 16, from
    the design notes' reported savings; printed, not an error: they are the workload's result, not the tool's): kvgate's
    cost ≤ 0.5 × the baseline's, multi-turn TTFT p50 ≤ 0.6 × the baseline's.
    """
    b, k = bill["baseline"], bill["kvgate"]
    out = []
    sound = True

    def check(ok: bool, text: str, measurement: bool) -> None:
        nonlocal sound
        out.append(("✓ " if ok else "✗ ") + text)
        sound = sound and (ok or not measurement)

    check(b["requests_failed"] == 0 and k["requests_failed"] == 0,
          f"failed requests: baseline {b['requests_failed']}, kvgate {k['requests_failed']} (0 required)", True)
    m = bill["levers_vs_rollups"]
    check(m == m and m <= MAX_LEVER_MISMATCH, f"Σ levers vs the rollups' saving: {m:.3%} apart (≤ 1 % required)",
          True)
    cr = bill["cost_ratio"]
    check(cr is not None and cr <= 0.5, f"target: kvgate's cost ÷ baseline's = {cr} (issue 16's target: ≤ 0.5; "
          "what bounds it on this mix: docs/benchmarks.md, \"The bill\")", False)
    tr = bill["multi_turn_ttft_p50_ratio"]
    check(tr is not None and tr <= 0.6, f"target: multi-turn TTFT p50 ratio = {tr} (issue 16's target: ≤ 0.6)", False)
    return out, sound
