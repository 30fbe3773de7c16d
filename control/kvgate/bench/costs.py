"""``kvgate bench costs``: do the bill's sums match what the engines computed? (issue 13's acceptance)

On the running stack (``kvgate up policies/demo.yaml``, or ``make demo``'s), one run:

1. snapshots every engine's ``vllm:prompt_tokens_total`` and ``vllm:prefix_cache_hits_total``
   and the usage rollups' sums (every bucket of ``kvgate:usage:hours``);
2. replays the first ``--requests`` trace requests through the gateway (streamed, as
   ``kvgate replay`` does, ``Cache-Control: no-store``), restarting the control plane (the
   rollups' consumer) when half of them have been sent;
3. sends one cacheable request ``--repeats`` + 1 times (no ``no-store``): the first is computed,
   the rest are response-cache hits;
4. waits until the engines are idle and the consumer group has acknowledged every log entry,
   and prints, side by side: Σ prompt tokens of the rollups against Σ of the engines' prompt
   token deltas, Σ cached tokens against Σ prefix-cache hit deltas, the cache-hit savings
   against ``repeats`` × the price of the avoided answer, with ✓/✗ per row (exact equality).

Nothing else may use the engines meanwhile (warm-ups, another replay): their counters would
count it. Run by hand; the figures go in ``docs/costs.md``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import click
import redis
import requests
from rich.console import Console
from rich.table import Table

from .. import redisconn
from ..policy.loader import PolicyError
from .replay import ReplayError, scrape_engine, send_trace, wait_engines_idle
from .trace import load_trace

PROMPT = "vllm:prompt_tokens_total"
HITS = "vllm:prefix_cache_hits_total"
HOURS = "kvgate:usage:hours"
GROUP = "kvgate-usage"
STREAM = "kvgate:log"
SUMMED = ("requests", "ok", "hits", "prompt", "cached", "completion", "avoided_prompt", "avoided_completion",
          "cost", "saved_cache", "saved_prefix")


def rollup_sums(r: redis.Redis) -> dict[str, int]:
    """Σ of :data:`SUMMED` over every bucket listed in ``kvgate:usage:hours``."""
    out = dict.fromkeys(SUMMED, 0)
    for key in r.zrange(HOURS, 0, -1):
        fields = r.hgetall(key)
        for f in SUMMED:
            out[f] += int(fields.get(f.encode(), 0))
    return out


def engine_sums(nodes) -> dict[str, float]:
    """Σ over the engines of the two vLLM counters."""
    snaps = [scrape_engine(n) for n in nodes]
    return {PROMPT: sum(s.get(PROMPT, 0.0) for s in snaps), HITS: sum(s.get(HITS, 0.0) for s in snaps)}


def consumer_caught_up(r: redis.Redis) -> bool:
    """The consumer group has been delivered and acknowledged every entry of the log stream."""
    try:
        groups = r.xinfo_groups(STREAM)
        last = r.xinfo_stream(STREAM)["last-generated-id"]
    except redis.ResponseError:
        return False
    for g in groups:
        if g["name"] in (GROUP, GROUP.encode()):
            delivered = g["last-delivered-id"]
            return g["pending"] == 0 and _id(delivered) >= _id(last)
    return False


def _id(v) -> tuple[int, int]:
    s = v.decode() if isinstance(v, bytes) else str(v)
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise ReplayError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def running_stack(ctx: click.Context):
    """``(stack, policy)`` of the running stack of the command's run dir, for the benchmarks that
    drive it: exit 2 for a running policy that no longer validates, a usage error when nothing runs."""
    from ..stack import Stack

    stack = Stack((ctx.obj or {}).get("run_dir"))
    try:
        policy = stack.load_running_policy()
    except PolicyError as exc:
        click.echo(f"error: invalid policy {exc}", err=True)
        sys.exit(2)
    if policy is None or not stack.nginx.pid():
        raise click.UsageError(f"no running stack under {stack.run_dir}; start one with `kvgate up`")
    return stack, policy


@click.command("costs")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--requests", "limit", type=click.IntRange(min=2), default=2000, show_default=True,
              help="Replay the first N trace requests.")
@click.option("--repeats", type=click.IntRange(min=0), default=200, show_default=True,
              help="Cache hits of one repeated cacheable request.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Divide the trace's arrival times by this (1 / simulator.time_scale).")
@click.option("--concurrency", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--no-restart", is_flag=True, help="Do not restart the control plane half-way.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the figures as JSON here.")
@click.pass_context
def costs_command(ctx: click.Context, trace_path: Path, limit: int, repeats: int, speedup: float, concurrency: int,
                  no_restart: bool, json_path: Path | None) -> None:
    """Replay TRACE plus REPEATS cache hits through the running stack and compare the usage
    rollups' sums with the engines' own counters (exactly equal, or ✗)."""
    console = Console(stderr=True)
    stack, policy = running_stack(ctx)
    policy_path = stack.policy_path()
    pool = policy.pools[0]
    nodes = pool.nodes
    prices = pool.prices.nano_usd_per_token() if pool.prices else None
    gateway = f"http://{policy.gateway.listen}"
    r = redisconn.from_url(policy.redis.client_url)
    trace = load_trace(trace_path, limit)
    console.print(f"{len(trace)} trace requests + {repeats} cache hits through {gateway}; the control plane "
                  f"{'stays up' if no_restart else 'restarts half-way'}")
    try:
        wait_engines_idle(nodes)
        _wait(lambda: consumer_caught_up(r), 60, "the usage consumer to catch up before the run")
        eng0, roll0 = engine_sums(nodes), rollup_sums(r)
        sent = [0]
        restarted: list[str] = []

        def restart_half_way() -> None:
            _wait(lambda: sent[0] >= len(trace) // 2, 3600, "half of the requests")
            assert policy_path is not None
            stack.start_control(policy_path, policy, timeout=60)
            restarted.append(time.strftime("%H:%M:%S"))

        def done(_res) -> None:
            sent[0] += 1

        thread = None
        if not no_restart:
            thread = threading.Thread(target=restart_half_way, daemon=True)
            thread.start()
        results = asyncio.run(send_trace(gateway, pool.models[0], trace, speedup, concurrency, on_done=done))
        if thread:
            thread.join(timeout=120)
        failed = sum(not x.ok for x in results)
        # the repeated cacheable request: computed once, then answered by the response cache
        # (a question of this run only: an answer cached by an earlier run would make the first a hit)
        body = {"model": pool.models[0], "messages": [{"role": "user", "content": "kvgate bench costs: the same "
                                                       f"question, asked {repeats + 1} times, run {time.time():.6f}"}],
                "max_tokens": 32, "temperature": 0}
        first = requests.post(gateway + "/v1/chat/completions", json=body, timeout=60)
        first.raise_for_status()
        usage = first.json()["usage"]
        hits = 0
        for _ in range(repeats):
            resp = requests.post(gateway + "/v1/chat/completions", json=body, timeout=60)
            hits += resp.status_code == 200 and resp.headers.get("X-Kvgate-Cache") == "HIT"
        wait_engines_idle(nodes)
        # every request sent is in the rollups: the gateways flush their log every 0.5 s, then the
        # consumer must read and acknowledge it (a timeout here is a lost entry: reported below)
        sent_total = len(trace) + 1 + repeats
        try:
            _wait(lambda: consumer_caught_up(r) and rollup_sums(r)["requests"] - roll0["requests"] >= sent_total,
                  60, "the usage consumer to count every request sent")
        except ReplayError as exc:
            console.print(f"[red]{exc}[/]")
        eng1, roll1 = engine_sums(nodes), rollup_sums(r)
    except (ReplayError, requests.RequestException, redis.RedisError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)

    d_roll = {k: roll1[k] - roll0[k] for k in SUMMED}
    d_eng = {k: round(eng1[k] - eng0[k]) for k in eng0}
    avoided_price = (usage["prompt_tokens"] * prices.input + usage["completion_tokens"] * prices.output) \
        if prices else None
    rows = [
        ("requests", d_roll["requests"], sent_total, "requests sent"),
        ("Σ prompt tokens", d_roll["prompt"], d_eng[PROMPT], "engines' vllm:prompt_tokens_total"),
        ("Σ cached prompt tokens", d_roll["cached"], d_eng[HITS], "engines' vllm:prefix_cache_hits_total"),
        ("cache hits", d_roll["hits"], repeats, "repeats sent"),
        ("tokens avoided by hits", d_roll["avoided_prompt"] + d_roll["avoided_completion"],
         repeats * usage["total_tokens"] if "total_tokens" in usage else None, "repeats × the answer's usage"),
    ]
    if avoided_price is not None:
        rows.append(("cache-hit savings (n$)", d_roll["saved_cache"], repeats * avoided_price,
                     "repeats × (prompt × input + completion × output price)"))
    table = Table(title=f"kvgate bench costs: {len(trace)} trace requests ({failed} failed) + {repeats} hits"
                  + (f", control plane restarted at {restarted[0]}" if restarted else ""))
    for col in ("figure", "rollups", "measured", "measured by", "equal"):
        table.add_column(col, justify="right" if col in ("rollups", "measured") else "left")
    for name, got, want, by in rows:
        table.add_row(name, f"{got:,}", "—" if want is None else f"{want:,}", by,
                      "—" if want is None else ("✓" if got == want else f"✗ ({got - want:+,})"))
    Console(width=max(110, Console().width)).print(table)
    console.print(f"hits answered by the cache: {hits} of {repeats}; rollup requests +{d_roll['requests']:,}, "
                  f"cost ${d_roll['cost'] / 1e9:.4f}, saved by the cache ${d_roll['saved_cache'] / 1e9:.6f}, "
                  f"by the prefix cache ${d_roll['saved_prefix'] / 1e9:.4f}")
    if json_path:
        json_path.write_text(json.dumps({"rollups": d_roll, "engines": d_eng, "repeats": repeats, "hits": hits,
                                         "failed": failed, "restarted": bool(restarted),
                                         "avoided_price_nusd": avoided_price, "usage": usage}, indent=2) + "\n")
    bad = [name for name, got, want, _ in rows if want is not None and got != want]
    if bad:
        click.echo(f"mismatch: {', '.join(bad)}", err=True)
        sys.exit(1)
