"""``kvgate batches``: every tenant's Batch API batches, through the control plane's API with the
admin token (tenants use ``/v1/batches`` with their own key; docs/batch-api.md).

``kvgate batches list [--tenant T] [--status S] [--limit N] [--json]``; ``kvgate batches show ID
[--json]``; ``kvgate batches cancel ID`` (no new lines start; lines in flight finish; the batch
ends ``cancelled`` with the lines done so far in its output file).
"""

from __future__ import annotations

import json
import time

import click

from ..batch.records import STATUSES
from .ops import _client, _fail, connection


def _when(ts) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _progress(b: dict) -> str:
    rc = b["request_counts"]
    if not rc["total"]:
        return "-"
    return f"{rc['completed'] + rc['failed']}/{rc['total']} ({(rc['completed'] + rc['failed']) / rc['total']:.0%})"


@click.group("batches")
def batches_command() -> None:
    """Batch API batches of every tenant (list, show, cancel)."""


@batches_command.command("list")
@click.option("--tenant", default=None, help="Only this tenant's batches.")
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only batches in this status.")
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@connection
@click.pass_context
def list_command(ctx, tenant: str | None, status: str | None, limit: int, as_json: bool, control_url, token) -> None:
    """Batches, newest first: id, tenant, status, progress, failed, created, output file."""
    from ..control.client import ControlError

    try:
        out = _client(ctx, control_url, token).batches(tenant=tenant, status=status, limit=limit)
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    rows = out["batches"]
    if not rows:
        click.echo("no batches" + (f" of tenant {tenant}" if tenant else "") + (f" {status}" if status else ""))
        return
    table = [("ID", "TENANT", "STATUS", "DONE", "FAILED", "CREATED", "OUTPUT")]
    table += [(b["id"], b["tenant"] or "-", b["status"], _progress(b), str(b["request_counts"]["failed"]),
               _when(b["created_at"]), b["output_file_id"] or "-") for b in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@batches_command.command("show")
@click.argument("batch_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@connection
@click.pass_context
def show_command(ctx, batch_id: str, as_json: bool, control_url, token) -> None:
    """One batch: status, every timestamp, counts, files, errors."""
    from ..control.client import ControlError

    try:
        b = _client(ctx, control_url, token).batch(batch_id)
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(b, indent=2))
        return
    rc = b["request_counts"]
    click.echo(f"{b['id']}  tenant {b['tenant'] or '-'}  {b['status']}  {b['endpoint']}  "
               f"window {b['completion_window']}")
    click.echo(f"  lines      {rc['total']} total, {rc['completed']} completed, {rc['failed']} failed  "
               f"({_progress(b)} finished)")
    click.echo(f"  input      {b['input_file_id']}")
    click.echo(f"  output     {b['output_file_id'] or '-'}   errors {b['error_file_id'] or '-'}")
    for f in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at", "expires_at"):
        if b.get(f):
            click.echo(f"  {f:<15}{_when(b[f])}")
    if b.get("metadata"):
        click.echo(f"  metadata   {json.dumps(b['metadata'])}")
    errors = (b.get("errors") or {}).get("data") or []
    for e in errors[:20]:
        where = f"line {e['line']}: " if e.get("line") else ""
        click.echo(f"  error      {where}{e.get('code')}: {e.get('message')}")
    if len(errors) > 20:
        click.echo(f"  ... and {len(errors) - 20} more errors (--json prints them all)")


@batches_command.command("cancel")
@click.argument("batch_id", metavar="ID")
@connection
@click.pass_context
def cancel_command(ctx, batch_id: str, control_url, token) -> None:
    """Cancel a batch: no new lines; lines in flight finish; the output keeps what is done."""
    from ..control.client import ControlError

    try:
        b = _client(ctx, control_url, token).cancel_batch(batch_id)
    except ControlError as exc:
        _fail(exc)
    click.echo(f"{b['id']} is {b['status']}: lines in flight finish, then it is cancelled "
               "(`kvgate batches show` follows it)")
