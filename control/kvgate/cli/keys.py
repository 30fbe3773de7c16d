"""``kvgate keys``: tenants' API keys, through the control plane's API with the admin token.

``kvgate keys create --tenant T [--name N]`` prints the secret once (it is stored nowhere);
``kvgate keys list [--tenant T] [--json]``; ``kvgate keys revoke ID`` (the gateways refuse the key
within ``gateway.auth_cache_ttl_s`` seconds). docs/tenants.md.
"""

from __future__ import annotations

import json
import time

import click

from .ops import _client, _fail, connection


def _when(ts) -> str:
    return "never" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@click.group("keys")
def keys_command() -> None:
    """Tenants' API keys (create, list, revoke)."""


@keys_command.command("create")
@click.option("--tenant", required=True, help="The tenant id (from the policy's tenants).")
@click.option("--name", default="", help="A label for the key (who or what uses it).")
@connection
@click.pass_context
def create_command(ctx, tenant: str, name: str, control_url, token) -> None:
    """Create a key and print its secret: the only time it is shown."""
    from ..control.client import ControlError

    try:
        out = _client(ctx, control_url, token).create_key(tenant, name)
    except ControlError as exc:
        _fail(exc)
    k = out["key"]
    click.echo(f"created {k['id']} for tenant {k['tenant']}" + (f" ({k['name']})" if k["name"] else ""), err=True)
    click.echo("the secret below is shown once and stored nowhere: keep it now", err=True)
    click.echo(out["secret"])


@keys_command.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@connection
@click.pass_context
def list_command(ctx, tenant: str | None, as_json: bool, control_url, token) -> None:
    """Every key: id, tenant, name, created, last use, revoked (never secrets)."""
    from ..control.client import ControlError

    try:
        keys = _client(ctx, control_url, token).keys(tenant)
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(keys, indent=2))
        return
    if not keys:
        click.echo("no API keys" + (f" for tenant {tenant}" if tenant else "") + " (kvgate keys create --tenant T)")
        return
    rows = [("ID", "TENANT", "NAME", "CREATED", "LAST USED", "STATE")]
    rows += [(k["id"], k["tenant"], k["name"] or "-", _when(k["created"]), _when(k["last_used"]),
              "revoked" if k["revoked"] else "active") for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@keys_command.command("revoke")
@click.argument("key_id", metavar="ID")
@connection
@click.pass_context
def revoke_command(ctx, key_id: str, control_url, token) -> None:
    """Revoke a key (by its id, from `kvgate keys list`)."""
    from ..control.client import ControlError

    try:
        k = _client(ctx, control_url, token).revoke_key(key_id)["key"]
    except ControlError as exc:
        _fail(exc)
    click.echo(f"revoked {k['id']} (tenant {k['tenant']}); gateways refuse it within a few seconds "
               "(gateway.auth_cache_ttl_s)")
