"""``kvgate costs``: what each tenant, model, pool or day spent and what each lever saved, from the
control plane's usage rollups (``GET /api/v1/costs``, :mod:`kvgate.costs.report`)."""

from __future__ import annotations

import csv
import json
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from .ops import _client, _fail, connection

CSV_COLUMNS = ("key", "requests", "ok", "failed", "hits", "retried", "prompt", "cached", "completion",
               "avoided_prompt", "avoided_completion", "cost_usd", "saved_cache_usd", "saved_prefix_usd",
               "saved_affinity_usd", "saved_batch_usd", "cost_per_ok_usd", "hit_ratio", "prefix_hit_ratio",
               "rr_prefix_hit_ratio", "unpriced", "unknown_usage")


def _usd(v: float | None) -> str:
    if v is None:
        return "-"
    return f"${v:,.2f}" if abs(v) >= 100 else f"${v:,.4f}" if abs(v) >= 0.01 else f"${v:.6f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _flat(row: dict) -> dict:
    out = {k: row.get(k) for k in CSV_COLUMNS if k in row}
    for lever, v in row["saved_usd"].items():
        out[f"saved_{lever}_usd"] = v
    return out


def table(report: dict) -> Table:
    """The report as a rich table: one row per key, then the total."""
    since = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(report["since"]))
    t = Table(title=f"kvgate costs by {report['by']}, since {since}")
    for col in ("", "requests", "ok", "failed", "hits", "prompt tok", "cached", "completion", "cost",
                "cost/ok", "saved: cache", "prefix", "of which affinity", "batch"):
        # fold, never "…": a bill's figure cut short is a wrong figure
        t.add_column(col, justify="left" if col == "" else "right", overflow="fold")
    for r in report["rows"] + [report["total"]]:
        s = r["saved_usd"]
        t.add_row(r["key"], f"{r['requests']:,}", f"{r['ok']:,}", f"{r['failed']:,}",
                  f"{r['hits']:,} ({_pct(r['hit_ratio'])})", f"{r['prompt']:,}",
                  f"{r['cached']:,} ({_pct(r['prefix_hit_ratio'])})", f"{r['completion']:,}", _usd(r["cost_usd"]),
                  _usd(r["cost_per_ok_usd"]), _usd(s["cache"]), _usd(s["prefix"]), _usd(s["affinity"]),
                  _usd(s["batch"]), style="bold" if r is report["total"] else None,
                  end_section=r is report["rows"][-1] if report["rows"] else False)
    return t


@click.command("costs")
@click.option("--by", type=click.Choice(["tenant", "model", "pool", "day", "hour"]), default="tenant",
              show_default=True, help="Group the rollups by this.")
@click.option("--since", default="24h", show_default=True,
              help="How far back: <n>s|m|h|d|w (the rollups are hourly: from the start of that hour).")
@click.option("--json", "as_json", is_flag=True, help="Print the report object (as GET /api/v1/costs).")
@click.option("--csv", "as_csv", is_flag=True, help="Print the rows and the total as CSV (dollars).")
@connection
@click.pass_context
def costs_command(ctx, by: str, since: str, as_json: bool, as_csv: bool, control_url, token) -> None:
    """Spend and savings per tenant, model, pool or day: requests, tokens, cost, cost per successful
    request (failed and retried requests' cost included) and the saving of each lever (response
    cache, prefix cache and the part of it due to affinity above round robin, batch discount)."""
    from ..control.client import ControlError

    if as_json and as_csv:
        raise click.UsageError("give --json or --csv, not both")
    try:
        report = _client(ctx, control_url, token).costs(by, since)
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if as_csv:
        w = csv.DictWriter(sys.stdout, fieldnames=list(CSV_COLUMNS), extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in report["rows"] + [report["total"]]:
            w.writerow(_flat(r))
        return
    Console(width=max(200, Console().width)).print(table(report))
    t = report["total"]
    if t["unpriced"] or t["unknown_usage"]:
        click.echo(f"{t['unpriced']:,} request(s) without a cost (a pool without prices, or usage unknown); "
                   f"{t['unknown_usage']:,} without token counts (logged before issue 13, or no usage)", err=True)
