"""``kvgate bench scaleout``: what happens to the prefix-cache hit ratio when the fleet grows.

The seeds' story: a fleet whose hit rate fell from 92 % to 31 % when it grew from one replica
to four. This command measures it on the running stack (``kvgate up POLICY``) with the seed's
multi-turn workload (:mod:`kvgate.bench.multiturn`): for each engine count N (default 4, 2, 1)
and each balancer (default ``round_robin`` and the pool's own), it

1. applies, through the control plane, the running policy with the first pool's nodes cut to
   its first N and its balancer replaced (a policy version each; counts run from large to small,
   so no node joins mid-experiment: a joining node would ramp up and be warmed);
2. resets every engine's prefix cache (``POST /reset_prefix_cache``) and snapshots the engines'
   vLLM counters;
3. sends the same conversations (closed loop, streamed, ``Cache-Control: no-store`` so the
   response cache answers nothing, ``X-Session-Id`` = the conversation);
4. waits until the engines are idle and reads their counters again.

The running policy is applied again at the end, also after an error, Ctrl-C or SIGTERM.

Figures per run (docs/benchmarks.md, "Scale-out"), from the counter deltas summed over the
N engines: ``hit_ratio`` = Δ``vllm:prefix_cache_hits_total`` ÷ Δ``vllm:prefix_cache_queries_total``;
``conv_hit_ratio`` (the per-conversation part) = (H − (R − E)·S) ÷ (Q − R·S), where H, Q are
those deltas, R the turns the engines served (Δ``vllm:prompt_tokens_total`` counts their
prompt tokens; R is the client's count of successful turns), S the shared system prompt's
tokens that can be a hit (its full blocks: the common token prefix of two conversations' first
prompts, rounded down to the engines' block size) and E the engines that served at least one
turn (each computes the system prompt once after the reset; every other turn hits it). The
same ratio from the streams' ``usage.cached_tokens`` (Σ max(0, cached − S) ÷ Σ (prompt − S),
exact per turn) is ``conv_hit_ratio_usage``, a check of the counter figure. ``follow_ups_warm``
(from usage): the share of follow-up turns (k ≥ 1) whose engine held the whole previous turn's
prompt (``cached_tokens`` ≥ its full blocks) — about 1/N under round robin, 1 under affinity;
the per-conversation hit ratio falls less than that because a turn that misses its previous
turn may still find an older turn of its conversation on its engine (a shorter prefix).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..policy import NodeConfig, Policy
from ..sim.tokenizer import tokenize_chat
from .multiturn import Conversation, TurnResult, multi_turn_workload, send_conversations, turn_messages
from .replay import HITS, PROMPT_TOKENS, QUERIES, ReplayError, _percentile, reset_prefix_caches, scrape_engine, \
    wait_engines_idle

JSON_KEYS = ("engines", "balancer", "turns_ok", "turns_failed", "hit_ratio", "conv_hit_ratio",
             "conv_hit_ratio_usage", "follow_ups_warm", "ttft_p50_s", "ttft_p99_s", "engines_used", "prompt_tokens",
             "hit_tokens")


@dataclass
class RunReport:
    """One engine count × balancer. Ratios in [0, 1]; TTFT in seconds at the client (successful
    turns); token figures are the engines' counter deltas summed over the run's engines."""

    engines: int
    balancer: str
    turns_ok: int
    turns_failed: int
    hit_ratio: float
    conv_hit_ratio: float
    conv_hit_ratio_usage: float
    follow_ups_warm: float
    ttft_p50_s: float
    ttft_p99_s: float
    engines_used: int
    prompt_tokens: float
    hit_tokens: float
    errors: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        """Exactly :data:`JSON_KEYS`."""
        d = asdict(self)
        return {k: d[k] for k in JSON_KEYS}


def shared_system_tokens(convs: list[Conversation], block_size: int) -> int:
    """S: the tokens every conversation's prompts share and an engine can cache — the common
    token prefix (simulator tokeniser, chat template) of the first prompt of two conversations
    with the first conversation's system prompt, rounded down to whole blocks."""
    if not convs:
        return 0
    a = tokenize_chat(turn_messages(convs[0], 0))
    other = convs[1] if len(convs) > 1 and convs[1].system == convs[0].system else None
    b = tokenize_chat(turn_messages(other, 0)) if other else \
        tokenize_chat([{"role": "system", "content": convs[0].system}, {"role": "user", "content": "-"}])
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // block_size * block_size


def build_run_report(engines: int, balancer: str, results: list[TurnResult], before: dict[str, dict[str, float]],
                     after: dict[str, dict[str, float]], system_tokens: int, block_size: int) -> RunReport:
    """The figures of one run from the client's results and the engines' counter snapshots
    (node id → counters, :func:`kvgate.bench.replay.scrape_engine`). See the module docstring."""
    q = h = p = 0.0
    used = 0
    for node_id, a in after.items():
        b = before.get(node_id, {})
        dq = a.get(QUERIES, 0.0) - b.get(QUERIES, 0.0)
        q += dq
        h += a.get(HITS, 0.0) - b.get(HITS, 0.0)
        p += a.get(PROMPT_TOKENS, 0.0) - b.get(PROMPT_TOKENS, 0.0)
        used += dq > 0
    ok = [r for r in results if r.ok]
    s = system_tokens
    served = len(ok)
    beyond = q - served * s
    conv_hits = h - max(0, served - used) * s
    usage = [r for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    u_beyond = sum(r.prompt_tokens - s for r in usage)
    u_hits = sum(max(0, r.cached_tokens - s) for r in usage)
    # follow-up turns whose whole previous turn was cached where they ran (results: conversation
    # order, then turn order; turn k's prompt starts with turn k-1's prompt)
    warm = follow = 0
    for prev, r in zip(results, results[1:]):
        if r.conversation == prev.conversation and r.turn == prev.turn + 1 and r.ok and prev.ok \
                and r.cached_tokens is not None and prev.prompt_tokens is not None:
            follow += 1
            warm += r.cached_tokens >= prev.prompt_tokens // block_size * block_size
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return RunReport(
        engines=engines, balancer=balancer, turns_ok=served, turns_failed=len(results) - served,
        hit_ratio=round(h / q, 4) if q else 0.0,
        conv_hit_ratio=round(max(0.0, conv_hits) / beyond, 4) if beyond > 0 else 0.0,
        conv_hit_ratio_usage=round(u_hits / u_beyond, 4) if u_beyond > 0 else 0.0,
        follow_ups_warm=round(warm / follow, 4) if follow else 0.0,
        ttft_p50_s=round(_percentile(ttfts, 50), 4), ttft_p99_s=round(_percentile(ttfts, 99), 4),
        engines_used=used, prompt_tokens=p, hit_tokens=h,
        errors=sorted({r.error or "" for r in results if not r.ok})[:5])


def subset_policy(policy: Policy, engines: int, balancer: str) -> Policy:
    """``policy`` with its first pool's nodes cut to the first ``engines`` and its balancer set
    to ``balancer`` (other pools unchanged). Raises ValueError when the pool has fewer nodes."""
    pool = policy.pools[0]
    if engines > len(pool.nodes):
        raise ValueError(f"pool {pool.name} has {len(pool.nodes)} nodes, not {engines}")
    first = pool.model_copy(update={"nodes": list(pool.nodes[:engines]), "balancer": balancer})
    return policy.model_copy(update={"pools": [first, *policy.pools[1:]]})


def render_table(reports: list[RunReport], system_tokens: int) -> Table:
    """One row per engine count × balancer, engine counts ascending."""
    t = Table(title=f"kvgate bench scaleout: the multi-turn workload on 1..N engines "
                    f"(shared system prompt: {system_tokens} cacheable tokens)", title_justify="left")
    for col in ("engines", "balancer", "turns ok / failed", "hit ratio", "per-conv. hit ratio",
                "(from usage)", "follow-ups warm", "TTFT p50", "TTFT p99"):
        t.add_column(col, justify="left" if col == "balancer" else "right")
    for r in sorted(reports, key=lambda r: (r.engines, r.balancer != "round_robin", r.balancer)):
        t.add_row(str(r.engines), r.balancer, f"{r.turns_ok} / {r.turns_failed}", f"{r.hit_ratio:.1%}",
                  f"{r.conv_hit_ratio:.1%}", f"{r.conv_hit_ratio_usage:.1%}", f"{r.follow_ups_warm:.1%}",
                  f"{r.ttft_p50_s * 1000:.0f} ms", f"{r.ttft_p99_s * 1000:.0f} ms")
    return t


def acceptance(reports: list[RunReport]) -> dict[str, dict]:
    """Per balancer, the per-conversation hit ratio at each engine count against its one-engine
    value: ``ratio`` (value ÷ one-engine value; round robin should be about 1/N) and ``delta``
    (value − one-engine value; affinity should stay above −0.05)."""
    out: dict[str, dict] = {}
    for b in dict.fromkeys(r.balancer for r in reports):
        runs = {r.engines: r for r in reports if r.balancer == b}
        if 1 not in runs:
            continue
        one = runs[1].conv_hit_ratio
        out[b] = {str(n): {"ratio": round(r.conv_hit_ratio / one, 4) if one else None,
                           "delta": round(r.conv_hit_ratio - one, 4), "one_over_n": round(1 / n, 4)}
                  for n, r in sorted(runs.items())}
    return out


def write_plot(reports: list[RunReport], path: Path) -> None:
    """PNG: hit ratio and per-conversation hit ratio against the engine count, one line per
    balancer (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for b in dict.fromkeys(r.balancer for r in reports):
        runs = sorted((r for r in reports if r.balancer == b), key=lambda r: r.engines)
        xs = [r.engines for r in runs]
        line, = ax.plot(xs, [r.hit_ratio for r in runs], marker="o", label=f"{b}: hit ratio")
        ax.plot(xs, [r.conv_hit_ratio for r in runs], marker="s", linestyle="--", color=line.get_color(),
                label=f"{b}: per-conversation part")
    ax.set_xlabel("engines")
    ax.set_ylabel("prefix-cache hit ratio (engines' counters)")
    ax.set_xticks(sorted({r.engines for r in reports}))
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Multi-turn workload: hit ratio as the fleet grows")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _ints(text: str, option: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not a comma-separated list of integers: {text}", param_hint=option) from None
    if not vals or min(vals) < 1 or len(set(vals)) != len(vals):
        raise click.BadParameter(f"need distinct integers >= 1: {text}", param_hint=option)
    return vals


def _writable(path: Path | None, option: str) -> None:
    if path is not None:
        parent = path.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"cannot write {path}: {parent} is not a writable folder", param_hint=option)


@click.command("scaleout")
@click.option("--engines", "engines_text", default="1,2,4", show_default=True,
              help="Comma-separated engine counts (the first N nodes of the first pool); run largest first.")
@click.option("--balancers", "balancers_text", default=None,
              help="Comma-separated balancers [default: round_robin and the pool's own].")
@click.option("--conversations", type=click.IntRange(min=1), default=60, show_default=True,
              help="Conversations per run (the same ones in every run).")
@click.option("--turns", "turns_text", default="4,6", show_default=True, help="Turns per conversation: LO,HI.")
@click.option("--system-tokens", type=click.IntRange(min=1), default=3000, show_default=True,
              help="The shared system prompt's length (simulator tokens = words).")
@click.option("--user-tokens", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Each user message's length.")
@click.option("--answer-tokens", type=click.IntRange(min=1), default=200, show_default=True,
              help="Each assistant message re-sent in the history.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Completion length of each turn.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="Conversation starts per modelled second (Poisson).")
@click.option("--think-s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Modelled seconds between an answer and the next turn.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Divide modelled times by this [default: 1 / the policy's simulator.time_scale].")
@click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              help="Most turns in flight at once.")
@click.option("--seed", type=int, default=16, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a PNG of hit ratio against engines here.")
@click.pass_context
def scaleout_command(ctx: click.Context, engines_text: str, balancers_text: str | None, conversations: int,
                     turns_text: str, system_tokens: int, user_tokens: int, answer_tokens: int, max_tokens: int,
                     rate: float, think_s: float, speedup: float | None, concurrency: int, seed: int,
                     json_path: Path | None, plot_path: Path | None) -> None:
    """The multi-turn workload on 1, 2 and 4 engines under round robin and the pool's balancer.

    Needs the running stack and its control plane (``kvgate up POLICY``); nothing else may use
    the engines meanwhile (their counters would count it). The running policy is applied again
    at the end. Exit 1 when a turn failed or the stack could not be driven.
    """
    from ..control.client import ControlError
    from .cli import BALANCERS, _balancer_switch
    from .costs import running_stack

    console = Console(stderr=True)
    stack, policy = running_stack(ctx)
    pool = policy.pools[0]
    counts = sorted(_ints(engines_text, "--engines"), reverse=True)
    if counts[0] > len(pool.nodes):
        raise click.BadParameter(f"pool {pool.name} has {len(pool.nodes)} nodes", param_hint="--engines")
    try:
        lo_hi = [int(x) for x in turns_text.split(",")]
    except ValueError:
        lo_hi = []
    if len(lo_hi) not in (1, 2) or not 1 <= lo_hi[0] <= lo_hi[-1]:
        raise click.BadParameter(f"LO,HI with 1 <= LO <= HI (or one count), not {turns_text}", param_hint="--turns")
    turns = (lo_hi[0], lo_hi[-1])
    own = pool.balancer if pool.balancer != "round_robin" else "chash_bounded"
    names = [b.strip() for b in (balancers_text or f"round_robin,{own}").split(",") if b.strip()]
    bad = [b for b in names if b not in BALANCERS]
    if bad or not names or len(set(names)) != len(names):
        raise click.BadParameter(f"distinct balancers from {', '.join(BALANCERS)}", param_hint="--balancers")
    _writable(json_path, "--json")
    _writable(plot_path, "--plot")
    speed = speedup or 1.0 / policy.simulator.time_scale
    gateway = f"http://{policy.gateway.listen}"
    down = [n.id for n in pool.nodes[:counts[0]] if not stack.http_healthy(f"{n.url}/health")]
    if down:
        click.echo(f"error: node(s) not healthy: {', '.join(down)} (see `kvgate status`)", err=True)
        sys.exit(1)

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)  # unwind like Ctrl-C: the finally restores the policy
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        _, restore = _balancer_switch(stack, policy, policy)
        from ..control.client import ControlClient
        from ..control.token import read_token
        from ..policy import dump_policy
        client = ControlClient(stack.control_url(policy), read_token(stack.token_file), timeout=120)
    except (ControlError, OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)

    convs = multi_turn_workload(conversations=conversations, turns=turns, system_tokens=system_tokens,
                                user_tokens=user_tokens, answer_tokens=answer_tokens, max_tokens=max_tokens,
                                rate_per_s=rate, think_s=think_s, seed=seed)
    n_turns = sum(len(c.turns) for c in convs)
    shared = shared_system_tokens(convs, policy.simulator.block_size)
    console.print(f"{len(convs)} conversations, {n_turns} turns per run (system {system_tokens}, user "
                  f"{user_tokens}, answer {answer_tokens} tokens; {shared} shared cacheable tokens) through "
                  f"{gateway} at speedup {speed:g}; engines {', '.join(map(str, counts))} x {', '.join(names)}")
    reports: list[RunReport] = []
    runs = [(n, b) for n in counts for b in names]
    try:
        with Progress(TextColumn("{task.description:>22}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=console) as progress:
            overall = progress.add_task("all runs", total=len(runs) * n_turns, failed=0)
            failed_all = 0
            for n, b in runs:
                nodes: list[NodeConfig] = list(pool.nodes[:n])
                res = client.apply(dump_policy(subset_policy(policy, n, b)),
                                   source=f"kvgate bench scaleout ({n} engines, {b})")
                progress.console.print(f"[bold]{n} engine(s), {b}[/]: policy version {res['version']} "
                                       f"(nginx {res['result']}); resetting prefix caches")
                time.sleep(0.5)  # the push reaches every nginx worker
                wait_engines_idle(list(pool.nodes))
                reset_prefix_caches(nodes)
                before = {x.id: scrape_engine(x) for x in pool.nodes}
                task = progress.add_task(f"{n} x {b}", total=n_turns, failed=0)
                failed = 0

                def done(r: TurnResult, task=task) -> None:
                    nonlocal failed, failed_all
                    failed += not r.ok
                    failed_all += not r.ok
                    progress.update(task, advance=1, failed=failed)
                    progress.update(overall, advance=1, failed=failed_all)

                results = asyncio.run(send_conversations(gateway, pool.models[0], convs, speedup=speed,
                                                         concurrency=concurrency, on_done=done, no_store=True))
                wait_engines_idle(list(pool.nodes))
                after = {x.id: scrape_engine(x) for x in pool.nodes}
                stray = [x.id for x in pool.nodes[n:]
                         if after[x.id].get(QUERIES, 0.0) != before[x.id].get(QUERIES, 0.0)]
                if stray:
                    raise ReplayError(f"node(s) {', '.join(stray)} outside the {n}-engine pool served requests "
                                      "(another client is using the engines?)")
                rep = build_run_report(n, b, results, {x.id: before[x.id] for x in nodes},
                                       {x.id: after[x.id] for x in nodes}, shared, policy.simulator.block_size)
                reports.append(rep)
                for err in rep.errors:
                    progress.console.print(f"  [red]error[/]: {err}")
    except (ReplayError, ControlError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        try:
            restore()
        except ControlError as exc:
            click.echo(f"warning: could not apply the running policy again: {exc}", err=True)

    Console(width=max(132, Console().width)).print(render_table(reports, shared))
    acc = acceptance(reports)
    for b, per in acc.items():
        cells = ", ".join(f"{n}: {v['ratio']:.2f} of 1 engine ({v['delta']:+.3f})" for n, v in per.items()
                          if v["ratio"] is not None)
        click.echo(f"per-conversation hit ratio, {b}: {cells}")
    if json_path:
        json_path.write_text(json.dumps({
            "workload": {"conversations": len(convs), "turns": n_turns, "turns_range": list(turns),
                         "system_tokens": system_tokens, "user_tokens": user_tokens, "answer_tokens": answer_tokens,
                         "max_tokens": max_tokens, "rate_per_s": rate, "think_s": think_s, "seed": seed,
                         "speedup": speed, "shared_system_tokens": shared},
            "runs": [r.as_json() for r in sorted(reports, key=lambda r: (r.engines, r.balancer))],
            "acceptance": acc}, indent=2) + "\n")
        click.echo(f"report written to {json_path}")
    if plot_path:
        write_plot(reports, plot_path)
        click.echo(f"plot written to {plot_path}")
    if any(r.turns_failed for r in reports):
        sys.exit(1)
