"""``kvgate up``, ``down``, ``status`` and ``validate``: the local stack of one run directory
(:mod:`kvgate.stack`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ..policy import PolicyError, load_policy

DEFAULT_POLICY = Path("policies") / "demo.yaml"


def _progress(message: str) -> None:
    """Print a progress line of `up`/`down`. A closed stdout (``kvgate down | head -1``) must
    not abort the operation half-way: later lines go to /dev/null instead."""
    try:
        click.echo(message)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _fail_policy(exc: PolicyError) -> None:
    click.echo(f"error: invalid policy {exc.source}:", err=True)
    for issue in exc.issues:
        click.echo(f"  {issue}", err=True)
    sys.exit(2)


def _stack(ctx: click.Context):
    from ..stack import Stack

    return Stack(ctx.obj.get("run_dir"))


@click.command()
@click.argument("policy", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_POLICY)
def validate(policy: Path) -> None:
    """Check a policy file; print each bad field's path and reason."""
    try:
        p = load_policy(policy)
    except PolicyError as exc:
        _fail_policy(exc)
    nodes = sum(len(pool.nodes) for pool in p.pools)
    click.echo(f"{policy}: ok ({len(p.pools)} pool(s), {nodes} node(s))")


@click.command()
@click.argument("policy", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_POLICY)
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for every part to be healthy.")
@click.pass_context
def up(ctx: click.Context, policy: Path, timeout: float) -> None:
    """Start Redis, the engine simulators, the control plane (which writes and starts the nginx
    gateway) and one node agent per simulated engine, for POLICY [default: policies/demo.yaml].

    Safe to run twice: running parts are kept, a changed policy is applied through the control plane.
    """
    from ..nginxctl import NginxError
    from ..stack import StackError

    stack = _stack(ctx)
    try:
        with stack.locked(echo=_progress):
            pol = stack.up(policy, timeout=timeout, echo=_progress)
    except PolicyError as exc:
        _fail_policy(exc)
    except (StackError, NginxError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    _progress("")
    scheme = "https" if pol.gateway.tls else "http"  # gateway.tls: docs/tls.md
    where = f"{scheme}://{pol.gateway.listen}" if pol.public_metrics else pol.gateway.internal_listen
    _progress(f"gateway   {scheme}://{pol.gateway.listen}/v1   (OpenAI-compatible; metrics at {where}/metrics)")
    for m in pol.gateway_members()[1:]:  # docs/scale-out.md
        _progress(f"gateway   {scheme}://{m.listen}/v1   (member {m.id}: `kvgate gateway --id {m.id}`)")
    for node in pol.nodes():
        _progress(f"node {node.id:<4} {node.url}{'  (simulated)' if node.simulate else ''}")
    _progress(f"redis     {pol.redis.url}")
    _progress(f"control   {stack.control_url(pol)}/api/v1   (admin token: `kvgate token`; "
              f"nodes: `kvgate nodes`)")
    _progress(f"admin     {stack.control_url(pol)}/admin/   (web page; sign in with the token `kvgate token` prints)")
    _progress(f"run dir   {stack.run_dir}  (logs in {stack.logs})")


@click.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop everything `kvgate up` started in this run directory."""
    from ..stack import StackError

    stack = _stack(ctx)
    try:
        with stack.locked(echo=_progress):
            stack.down(echo=_progress)
    except StackError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Say what runs and whether it is healthy. Exit 1 if anything is down."""
    stack = _stack(ctx)
    try:
        parts = stack.status()
    except PolicyError as exc:
        _fail_policy(exc)
    if not parts:
        click.echo(f"nothing runs under {stack.run_dir} (start it with `kvgate up`)")
        sys.exit(1)
    if as_json:
        click.echo(json.dumps([p.__dict__ for p in parts], indent=2))
    else:
        width = max(10, *(len(p.name) for p in parts))
        for p in parts:
            state = "healthy" if p.healthy else ("running, unhealthy" if p.pid else "down")
            pid = str(p.pid) if p.pid else "-"
            click.echo(f"{p.name:<{width}} {state:<20} pid {pid:<8} {p.detail}")
        _echo_gateways(stack)
    sys.exit(0 if all(p.healthy for p in parts) else 1)


def _echo_gateways(stack) -> None:
    """The gateway members as the control plane sees them (docs/scale-out.md): also the ones on
    other hosts, which ``stack.status()`` cannot see. Nothing when the control plane does not answer."""
    from ..control.client import ControlClient, ControlError, resolve

    try:
        url, token = resolve(stack.run_dir)
        body = ControlClient(url, token, timeout=5)._call("GET", "/api/v1/gateways")
    except (ControlError, OSError, ValueError):
        return
    members = body.get("gateways") or []
    if not members:
        return
    click.echo(f"gateways (policy version {body.get('version')}, sync every {body.get('sync_s')}s):")
    width = max(8, *(len(m["id"]) for m in members))
    for m in members:
        seen = "-" if m.get("age_s") is None else f"{m['age_s']:.1f}s ago"
        where = "control plane's own" if m.get("local") else "kvgate gateway"
        click.echo(f"  {m['id']:<{width}} {m['state']:<10} version {str(m.get('version') or '-'):<5} "
                   f"seen {seen:<11} {m['listen']}  ({where})")


COMMANDS = [validate, up, down, status]
