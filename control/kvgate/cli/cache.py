"""``kvgate cache``: invalidation of the semantic cache and of tagged entries (issue 15), through
the control plane's API (``kvgate invalidate`` retires the whole exact cache)."""

from __future__ import annotations

import click

from .ops import _client, _fail, connection


@click.group("cache")
def cache_group() -> None:
    """Invalidate parts of the response cache: a pool's semantic entries, or every entry with a tag."""


@cache_group.command("bump-knowledge")
@click.argument("pool")
@connection
@click.pass_context
def bump_knowledge_command(ctx, pool: str, control_url, token) -> None:
    """Retire POOL's semantic cache: its knowledge_version goes up by one, pushed to the gateway without
    a reload (part of every semantic key: old answers are never matched again and expire by their TTL).
    Run it when the documents or facts the pool's answers depend on change."""
    from ..control.client import ControlError

    try:
        out = _client(ctx, control_url, token).bump_knowledge(pool)
    except ControlError as exc:
        _fail(exc)
    click.echo(f"pool {out['pool']}: knowledge version {out['old']} -> {out['new']} (gateway {out['result']})")


@cache_group.command("invalidate")
@click.option("--tag", "tag", required=True, help="Remove every entry stored with this tag (X-Kvgate-Cache-Tags).")
@connection
@click.pass_context
def invalidate_command(ctx, tag: str, control_url, token) -> None:
    """Remove the cached answers tagged TAG: the exact entries and the semantic service's."""
    from ..control.client import ControlError

    try:
        out = _client(ctx, control_url, token).invalidate_tag(tag)
    except ControlError as exc:
        _fail(exc)
    sem = out.get("removed_semantic")
    click.echo(f"tag {out['tag']}: {out['removed_exact']} exact entries removed"
               + (f", {sem} semantic" if sem is not None else ""))
    if out.get("semantic_error"):
        click.echo(f"warning: {out['semantic_error']} (its entries now point at removed answers: they miss)",
                   err=True)
