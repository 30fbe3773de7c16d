"""``kvgate analyze TRACE``: the workload's reuse, the predicted hit ratios, the verdict, the lint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..policy.loader import load_policy
from .lint import prefix_lint
from .predict import CacheConfig, predict
from .savings import predicted_savings
from .stats import trace_stats
from .verdict import verdict
from .workload import WorkloadError, load_lines, load_workload


def is_redis(source: str) -> bool:
    """Whether ``source`` names a live Redis (``redis://HOST:PORT/DB``) rather than a file."""
    return str(source).startswith(("redis://", "rediss://", "unix://"))


def log_block_tokens(pool) -> int:
    """Tokens per block of the gateway log's ``blocks``: chunk_chars ÷ chars_per_token (≥ 1)."""
    pi = pool.prefix_index
    return max(1, round(pi.chunk_chars / pi.chars_per_token))


def analyze(path, requests=None, nodes=None, policy="policies/demo.yaml", progress=None, since_s=None) -> dict:
    """The whole analysis as the ``--json`` document (docs/analyze.md). ``path``: a file
    (Mooncake trace, chat requests or an exported gateway log) or ``redis://HOST:PORT/DB``
    (the live ``kvgate:log`` stream, entries from ``since_s`` seconds ago)."""
    pol = load_policy(policy)
    pool = pol.pools[0]
    bt = log_block_tokens(pool)
    if is_redis(path):
        from .logexport import read_log

        reqs = load_lines(read_log(str(path), since_s, requests), str(path), requests, bt)
    else:
        reqs = load_workload(path, requests, bt)
    if not reqs:
        raise WorkloadError(f"{path}: no requests")
    cfg = CacheConfig.from_policy(pol, nodes=nodes)
    stats = trace_stats(reqs)
    pred = predict(reqs, cfg, on_request=progress)
    gain = pred["chash"].hit_ratio - pred["round_robin"].hit_ratio
    word, rows = verdict(stats, len(cfg.nodes), cfg.num_gpu_blocks, cfg.block_size, gain)
    doc = {k: v for k, v in stats.__dict__.items()}
    doc["nodes"] = len(cfg.nodes)
    doc["cache_blocks_per_node"] = cfg.num_gpu_blocks
    doc["block_size"] = cfg.block_size
    doc["predicted"] = {b: p.as_json() for b, p in pred.items()}
    doc["verdict"] = word
    doc["verdict_rows"] = [r.as_json() for r in rows]
    doc["lint"] = prefix_lint(reqs).as_json()
    doc["source"] = reqs[0].source
    doc["savings"] = predicted_savings(reqs, pred, pool.prices)
    if doc["savings"]["priced"]:
        u = doc["savings"]["usd"]
        doc["verdict_saving_usd"] = {"cache": u["cache"], "prefix": u["prefix"]["chash_bounded"],
                                     "affinity": u["affinity"], "batch": u["batch"],
                                     "share_of_full_price": round(
                                         (u["cache"] + u["prefix"]["chash_bounded"] + u["batch"]) / u["full_price"], 4)
                                     if u["full_price"] else 0.0}
    return doc


def _png(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = doc["reuse_by_depth"][:64]
    x = [d["tokens_from"] / 1000 for d in depth]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(x, [d["shared_share"] for d in depth], width=0.45, label="shared (common prefix)")
    ax.bar(x, [d["seen_share"] - d["shared_share"] for d in depth], width=0.45,
           bottom=[d["shared_share"] for d in depth], label="per conversation")
    ax.set_xlabel("prefix depth (k tokens, 512-token blocks)")
    ax.set_ylabel("share of requests reaching it, already seen")
    ax.set_title(f"reuse by prefix depth: {doc['requests']} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title="workload")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k in ("requests", "mean_input_tokens", "mean_output_tokens", "request_rate_per_s", "first500_repeat_share",
              "first500_seen_before_share", "reuse_share", "shared_reuse_share", "conversation_reuse_share",
              "conversations", "session_length_mean", "session_length_p90", "session_length_max", "turn_gap_p50_s"):
        v = doc[k]
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    t.add_row("session_length_histogram", " ".join(f"{k}:{v}" for k, v in doc["session_length_histogram"].items()))
    c.print(t)
    h = Table(title="hottest prefixes")
    for col in ("prefix", "requests", "tokens", "common"):
        h.add_column(col)
    for p in doc["hottest_prefixes"]:
        h.add_row(p["prefix"], str(p["requests"]), str(p["tokens"]), str(p["common"]))
    c.print(h)
    p = Table(title=f"predicted prefix hit ratio, {doc['nodes']} nodes x {doc['cache_blocks_per_node']} blocks")
    for col in ("balancer", "hit ratio", "imbalance", "note"):
        p.add_column(col)
    for b, v in doc["predicted"].items():
        p.add_row(b, f"{v['hit_ratio']:.4f}", f"{v['imbalance']:.3f}", "approximate" if v.get("approximate") else "")
    c.print(p)
    v = Table(title=f"verdict: {doc['verdict']}")
    for col in ("factor", "value", "threshold", "met"):
        v.add_column(col)
    for r in doc["verdict_rows"]:
        v.add_row(r["factor"], f"{r['value']:.4g}", r["threshold"], "yes" if r["passed"] else "no")
    c.print(v)
    sv = doc["savings"]
    if not sv["priced"]:
        c.print(f"predicted saving per lever: n/a ({sv['note']})")
    else:
        u = sv["usd"]
        st = Table(title=f"predicted saving per lever at the policy's prices (full price ${u['full_price']:.4f})")
        for col in ("lever", "saving $", "note"):
            st.add_column(col)
        st.add_row("response cache", f"{u['cache']:.6f}",
                   f"{sv['cache_repeats']} repeats; {sv['cache_note']}" if sv["cache_identifiable"]
                   else f"not identifiable: {sv['cache_note']}")
        for b, x in u["prefix"].items():
            st.add_row(f"prefix cache, {b}", f"{x:.6f}", "cached tokens x (input - cached price)")
        st.add_row("affinity (chash_bounded - round robin)", f"{u['affinity']:.6f}", "")
        st.add_row("batch", f"{u['batch']:.6f}", sv["batch_note"] or f"{sv['batch_requests']} batch requests")
        c.print(st)
        vs = doc["verdict_saving_usd"]
        c.print(f"verdict saving: ${vs['cache'] + vs['prefix'] + vs['batch']:.6f} "
                f"({vs['share_of_full_price']:.1%} of the full price; affinity ${vs['affinity']:.6f})")
    lint = doc["lint"]
    if not lint["applicable"]:
        c.print(f"prefix-stability lint: n/a ({lint['note']})")
    else:
        c.print(f"prefix-stability lint: {lint['flagged']} of {lint['checked']} requests flagged, "
                f"{lint['lost_tokens']} tokens of reuse lost ({lint['lost_share']:.1%}); variable span starts at "
                f"token {lint['start_mode']} (message {lint['start_message']}, {lint['start_role']})")


@click.command("analyze")
@click.argument("trace")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=None, help="Analyse the first N lines.")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Engines to model [default: the pool's].")
@click.option("--policy", default="policies/demo.yaml", show_default=True, help="Cache size and routing from here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document instead of tables.")
@click.option("--png", type=click.Path(dir_okay=False), default=None, help="Write the reuse-by-depth chart here.")
@click.option("--since", default=None, help="redis:// only: entries this recent (1h, 30m, 2d) [default: all].")
def analyze_command(trace, n_requests, nodes, policy, as_json, png, since) -> None:
    """What kvgate would save on TRACE: a Mooncake JSONL, chat requests JSONL, an exported
    gateway log (kvgate log export) or the live log at redis://HOST:PORT/DB: docs/analyze.md."""
    import redis
    from rich.progress import Progress

    from .logexport import parse_since

    try:
        since_s = parse_since(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        if is_redis(trace):
            total = n_requests
        else:
            if not Path(trace).is_file():
                raise OSError(f"{trace}: no such file")
            total = n_requests or sum(1 for line in open(trace, encoding="utf-8") if line.strip())
        with Progress(transient=True, disable=as_json) as bar:
            task = bar.add_task("modelling the engines' caches", total=total)
            doc = analyze(trace, n_requests, nodes, policy, progress=lambda: bar.advance(task), since_s=since_s)
    except redis.RedisError as exc:
        click.echo(f"error: {trace}: {exc}", err=True)
        sys.exit(2)
    except (WorkloadError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if png:
        _png(doc, png)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _table(doc)
