"""``kvgate replay TRACE``: replay a production trace through the running gateway per balancer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import typing
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..policy import PolicyError, load_policy
from ..policy.model import Balancer
from .replay import PolicyReport, ReplayError, build_report, compute_ceiling, pooled_capacity, \
    reset_prefix_caches, scrape_engine, send_trace, wait_engines_idle
from .trace import load_trace

BALANCERS: tuple[str, ...] = typing.get_args(Balancer)
"""Every balancer the policy schema accepts (``kvgate.policy.model.Balancer``)."""


def _fmt_tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if abs(n) >= 1e6 else f"{n / 1e3:.1f}k"


def _balancer_switch(stack, policy, restore_policy):
    """``(apply(balancer) -> str, restore() -> None)`` through the control plane's API: it is the
    only writer of nginx config, and each switch is recorded as a policy version (a balancer
    change is a runtime push, no reload). Raises ControlError when no control plane of this
    run directory answers, or its admin token cannot be read."""
    from ..control.client import ControlClient, ControlError
    from ..control.token import read_token
    from ..policy import dump_policy

    control = stack.control_url(restore_policy)
    if not (stack._live_pid("control") and stack.http_healthy(control + "/healthz")):
        raise ControlError(f"no control plane of {stack.run_dir} answers at {control}: the replay switches "
                           "balancers through it (start the stack with `kvgate up`; `kvgate status` says what runs)")
    try:
        client = ControlClient(control, read_token(stack.token_file), timeout=120)
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read the admin token {stack.token_file}: {exc}") from None
    original = client.policy().get("yaml")

    def apply(name: str) -> str:
        res = client.apply(dump_policy(policy.with_balancer(name)), source=f"kvgate replay ({name})")
        return f"policy version {res['version']} via the control plane (nginx {res['result']})"

    def restore() -> None:
        if original:
            client.apply(original, source="kvgate replay (restore)")

    return apply, restore


def render_table(reports: dict[str, PolicyReport], baseline: str | None) -> Table:
    """The replay's summary table: one column per balancer."""
    table = Table(title="kvgate trace replay: what affinity routing saved", title_justify="left")
    table.add_column("metric")
    for name in reports:
        table.add_column(name, justify="right")
    rows = [
        ("requests ok / failed", lambda r: f"{r.requests_ok} / {r.requests_failed}"),
        ("prefix-cache hit ratio (engines' counters)", lambda r: f"{r.hit_ratio:.1%}"),
        ("pooled ceiling (one cache, all engines' size)", lambda r: f"{r.ceiling:.1%}"),
        ("hit ratio ÷ ceiling", lambda r: f"{r.ratio_to_ceiling:.2f}"),
        ("load imbalance (max ÷ mean prefill/node)", lambda r: f"{r.imbalance:.2f}"),
        ("TTFT p50 at the client", lambda r: f"{r.ttft_p50_s * 1000:.0f} ms"),
        ("TTFT p99 at the client", lambda r: f"{r.ttft_p99_s * 1000:.0f} ms"),
        ("TTFT mean at the engines (vLLM histogram)", lambda r: f"{r.engine_ttft_mean_s * 1000:.0f} ms"),
        ("prefill tokens computed", lambda r: _fmt_tokens(r.prefill_total)),
    ]
    for label, fn in rows:
        table.add_row(label, *(fn(r) for r in reports.values()))
    if baseline and baseline in reports:
        base = reports[baseline].prefill_total

        def saved(r: PolicyReport) -> str:
            if r is reports[baseline]:
                return "(baseline)"
            delta = base - r.prefill_total
            return f"{_fmt_tokens(delta)} ({delta / base:.1%})" if base else "-"

        table.add_row(f"prefill tokens saved vs {baseline}", *(saved(r) for r in reports.values()))
    return table


@click.command("replay")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Use this policy's gateway, nodes and pools [default: the running stack's]; "
              "the running policy is restored afterwards.")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests.")
@click.option("--policies", "balancers", default="round_robin,chash", show_default=True,
              help="Comma-separated balancers to compare, in order.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Divide the trace's arrival times by this (match 1/simulator.time_scale).")
@click.option("--concurrency", type=click.IntRange(min=1), default=128, show_default=True,
              help="Most requests in flight at once.")
@click.option("--max-tokens-cap", type=click.IntRange(min=1), default=None,
              help="Cap each request's max_tokens (default: the trace's output length).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON here.")
@click.pass_context
def replay_command(ctx: click.Context, trace_path: Path, policy_path: Path | None, limit: int | None,
                   balancers: str, speedup: float, concurrency: int, max_tokens_cap: int | None,
                   json_path: Path | None) -> None:
    """Replay TRACE (Mooncake JSONL) through the running gateway once per balancer and compare.

    Before each balancer the engines' prefix caches are reset and the control plane applies
    the policy with that balancer (a policy version each); afterwards the running policy is
    applied again. Needs the stack's control plane (``kvgate up``).
    """
    from ..control.client import ControlError
    from ..stack import Stack

    console = Console(stderr=True)

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM/SIGHUP unwind like Ctrl-C, so the `finally` below restores the policy's balancer
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    stack = Stack((ctx.obj or {}).get("run_dir"))
    try:
        running = stack.load_running_policy()
        policy = load_policy(policy_path) if policy_path else running
    except PolicyError as exc:
        click.echo(f"error: invalid policy {exc}", err=True)
        sys.exit(2)
    if policy is None:
        raise click.UsageError(f"no running stack under {stack.run_dir}; start one with `kvgate up`")
    # what nginx must run again afterwards: the stack's own policy, not a --policy override
    restore_policy = running or policy
    names = [b.strip() for b in balancers.split(",") if b.strip()]
    bad = [b for b in names if b not in BALANCERS]
    if bad or not names:
        raise click.BadParameter(f"unknown balancer(s) {bad}; choose from {', '.join(BALANCERS)}",
                                 param_hint="--policies")
    if len(set(names)) != len(names):
        raise click.BadParameter(f"a balancer is listed twice: {balancers}", param_hint="--policies")
    if json_path is not None:
        parent = json_path.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"cannot write {json_path}: {parent} is not a writable folder",
                                     param_hint="--json")
    try:
        trace = load_trace(trace_path, limit)
    except (ValueError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if not trace:
        click.echo(f"error: {trace_path} holds no requests", err=True)
        sys.exit(2)

    pool = policy.pools[0]
    nodes = pool.nodes
    gateway = f"http://{policy.gateway.listen}"
    if not stack.nginx.pid():
        click.echo(f"error: the gateway of {stack.run_dir} is not running; start it with `kvgate up`", err=True)
        sys.exit(1)
    down = [n.id for n in nodes if not stack.http_healthy(f"{n.url}/health")]
    if down:
        click.echo(f"error: node(s) not healthy: {', '.join(down)} (see `kvgate status`)", err=True)
        sys.exit(1)
    try:
        apply_balancer, restore = _balancer_switch(stack, policy, restore_policy)
    except ControlError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    span = (trace[-1].timestamp_s - trace[0].timestamp_s) / speedup
    console.print(f"replaying {len(trace)} requests of {trace_path.name} (~{span:.0f} s each at speedup "
                  f"{speedup:g}) through {gateway} to {len(nodes)} nodes; balancers: {', '.join(names)}")
    t = time.perf_counter()
    num_blocks, block_size, source = pooled_capacity(policy, nodes)
    with Progress(TextColumn(f"{'ceiling':>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("ceiling", total=len(trace))
        ceiling = compute_ceiling(trace, num_blocks, block_size, on_request=lambda: progress.advance(task))
    console.print(f"pooled ceiling {ceiling:.1%}: one cache of {num_blocks} blocks x {block_size} tokens "
                  f"(from {source}), computed offline in {time.perf_counter() - t:.1f} s")

    reports: dict[str, PolicyReport] = {}
    try:
        for name in names:
            result = apply_balancer(name)
            console.print(f"[bold]{name}[/]: {result}; resetting prefix caches")
            reset_prefix_caches(nodes)
            before = {n.id: scrape_engine(n) for n in nodes}
            with Progress(TextColumn(f"{name:>12}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                          console=console, transient=False) as progress:
                task = progress.add_task(name, total=len(trace), failed=0)
                failed = 0

                def done(r) -> None:
                    nonlocal failed
                    failed += not r.ok
                    progress.update(task, advance=1, failed=failed)

                results = asyncio.run(send_trace(gateway, pool.models[0], trace, speedup, concurrency,
                                                 max_tokens_cap, on_done=done))
            wait_engines_idle(nodes)
            after = {n.id: scrape_engine(n) for n in nodes}
            reports[name] = build_report(results, before, after, ceiling)
            for err in reports[name].errors:
                console.print(f"  [red]error[/]: {err}")
    except (ReplayError, ControlError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        try:
            restore()
        except ControlError as exc:
            click.echo(f"warning: could not restore the policy's balancer: {exc}", err=True)

    baseline = "round_robin" if "round_robin" in reports else None
    Console(width=max(100, Console().width)).print(render_table(reports, baseline))
    if json_path:
        json_path.write_text(json.dumps({k: r.as_json() for k, r in reports.items()}, indent=2) + "\n")
        click.echo(f"report written to {json_path}")
    if any(r.requests_failed for r in reports.values()):
        sys.exit(1)
