"""``kvgate`` operator commands (kvgate.cli.ops) that go through the control plane's API with the admin token:
``kvgate nodes``, ``drain``, ``undrain``, ``warm``, ``apply``, ``events``, ``token``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

_conn = [
    click.option("--control-url", envvar="KVGATE_CONTROL_URL", default=None,
                 help="Control plane URL [default: the running stack's control.listen]."),
    click.option("--token", envvar="KVGATE_TOKEN", default=None,
                 help="Admin token [default: <run dir>/admin.token]."),
]


def connection(f):
    for opt in reversed(_conn):
        f = opt(f)
    return f


def _client(ctx: click.Context, control_url: str | None, token: str | None):
    from ..control.client import ControlClient, ControlError, resolve
    from ..rundir import default_run_dir

    run_dir = Path((ctx.obj or {}).get("run_dir") or default_run_dir())
    try:
        url, tok = resolve(run_dir, control_url, token)
    except ControlError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    return ControlClient(url, tok, run_dir=run_dir)  # run_dir: its self-signed control.tls certificate


def _fail(exc) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2 if 400 <= getattr(exc, "status", 0) < 500 else 1)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def node_row(n: dict) -> list[str]:
    rep = n.get("report") or {}
    eng = rep.get("engine") or {}
    gpu = rep.get("gpu") or {}
    if gpu.get("status") == "ok":
        devs = gpu.get("devices") or []
        used = sum(d.get("memory_used_bytes") or 0 for d in devs) / 2**30
        total = sum(d.get("memory_total_bytes") or 0 for d in devs) / 2**30
        gtxt = f"{used:.0f}/{total:.0f} GiB"
    else:
        gtxt = "no GPU" if rep else "-"
    q, h = eng.get("prefix_cache_queries"), eng.get("prefix_cache_hits")
    hit = eng.get("prefix_cache_hit_rate")
    if hit is None and q:
        hit = (h or 0) / q
    age = n.get("report_age_s")
    return [n["id"], n["pool"], n["state"], str(n.get("weight") if n.get("weight") is not None else "-"),
            str(n.get("target_weight") or "-"), gtxt,
            "-" if eng.get("running") is None else f"{eng['running']:.0f}/{eng.get('waiting') or 0:.0f}",
            _pct(eng.get("kv_cache_usage")), _pct(hit), "-" if age is None else f"{age:.0f}s"]


@click.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@connection
@click.pass_context
def nodes_command(ctx, as_json: bool, control_url, token) -> None:
    """List the nodes: state, weight in force and target, GPU memory, running/waiting, KV-cache use,
    prefix-cache hit ratio (engine lifetime) and report age."""
    from ..control.client import ControlError

    try:
        nodes = _client(ctx, control_url, token).nodes()
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(nodes, indent=2))
        return
    head = ["node", "pool", "state", "weight", "target", "gpu mem", "run/wait", "kv use", "prefix hit", "report"]
    rows = [head] + [node_row(n) for n in nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@click.command("drain")
@click.argument("node")
@click.option("--wait", is_flag=True, help="Wait until the node is drained (exit 0); exit 1 when --timeout "
              "passes, or the drain ended by drain.timeout_s with requests still in flight.")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds --wait waits.")
@click.option("--force", is_flag=True, help="Drain even the last serving node of its pool (its pool then fails).")
@connection
@click.pass_context
def drain_command(ctx, node: str, wait: bool, timeout: float, force: bool, control_url, token) -> None:
    """Stop new requests reaching NODE; with --wait, return once its in-flight requests finished.
    Draining a draining or drained node is not an error. With --wait, a drain that ended by its
    timeout (drain.timeout_s) with requests still in flight exits 1 and says how many."""
    from ..control.client import ControlError

    client = _client(ctx, control_url, token)
    last, polling = None, False
    try:
        n = client.action(node, "drain?force=true" if force else "drain")
        click.echo(f"{node}: {n['state']}")
        if not wait:
            return
        deadline = time.monotonic() + timeout
        polling = True
        while n["state"] == "draining":
            if time.monotonic() > deadline:
                click.echo(f"error: {node} still draining after {timeout:.0f}s", err=True)
                sys.exit(1)
            time.sleep(0.5)
            n = client.node(node)
            d = n.get("drain") or {}
            now = (d.get("inflight_gateway"), d.get("inflight_engine"))
            if now != last and n["state"] == "draining":
                click.echo(f"{node}: draining, in flight: gateway {_num(now[0])}, engine {_num(now[1])}")
                last = now
    except ControlError as exc:
        if exc.status == 404 and polling:
            g, e = last or (None, None)
            click.echo(f"error: {node} was removed from the policy while it was draining (in flight when last "
                       f"seen: gateway {_num(g)}, engine {_num(e)})", err=True)
            sys.exit(1)
        _fail(exc)
    if n["state"] != "drained":
        click.echo(f"error: {node} is {n['state']} ({n.get('reason')})", err=True)
        sys.exit(1)
    d = n.get("drain") or {}
    if d.get("timed_out"):
        g, e = d.get("inflight_gateway"), d.get("inflight_engine")
        known = [v for v in (g, e) if v is not None]
        count = f"{max(known):.0f} request(s)" if known else "an unknown number of requests"
        took = (d.get("deadline") or 0) - (d.get("started") or 0)
        click.echo(f"error: {node}: the drain timed out after {took:.0f}s with {count} still in flight (gateway "
                   f"{_num(g)}, engine {_num(e)}, when it timed out): it takes no new requests, but stopping its "
                   "engine while requests run cuts them; see what is in flight now with `kvgate nodes --json` "
                   "(inflight_gateway, inflight_engine)", err=True)
        sys.exit(1)
    click.echo(f"{node}: drained ({n.get('reason')})")


def _num(v) -> str:
    return "unknown" if v is None else f"{v:.0f}"


def _work(b: dict) -> str:
    """What a node of a ``node_has_work`` refusal still has (state and in-flight counts)."""
    return (f"{b.get('state')}, {b.get('inflight', 0)} request(s) in flight: {_num(b.get('inflight_gateway'))} "
            f"at the gateway, {_num(b.get('inflight_engine'))} at the engine")


@click.command("undrain")
@click.argument("node")
@connection
@click.pass_context
def undrain_command(ctx, node: str, control_url, token) -> None:
    """Bring a drained NODE back: warm-up, then its weight ramps up to active."""
    from ..control.client import ControlError

    try:
        n = _client(ctx, control_url, token).action(node, "undrain")
    except ControlError as exc:
        _fail(exc)
    click.echo(f"{node}: {n['state']} (then ramping, then active; follow with `kvgate nodes`)")


@click.command("invalidate")
@connection
@click.pass_context
def invalidate_command(ctx, control_url, token) -> None:
    """Invalidate the whole response cache (a new cache namespace version, pushed to the gateway
    without a reload; old entries are never read again and expire by their TTL)."""
    from ..control.client import ControlError

    try:
        out = _client(ctx, control_url, token).invalidate_cache()
    except ControlError as exc:
        _fail(exc)
    click.echo(f"response cache invalidated: namespace v{out['old']} -> v{out['new']} "
               f"(policy version {out['version']}, nginx {out['result']})")


@click.command("warm")
@click.argument("node")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the warm-up to finish.")
@connection
@click.pass_context
def warm_command(ctx, node: str, wait: bool, control_url, token) -> None:
    """Send NODE the pool's warm-up prompts and hottest prefixes now (its state does not change)."""
    from ..control.client import ControlError

    client = _client(ctx, control_url, token)
    try:
        n = client.action(node, "warm")
        while wait and (n.get("warmup") or {}).get("status") == "running":
            time.sleep(0.5)
            n = client.node(node)
    except ControlError as exc:
        _fail(exc)
    w = n.get("warmup") or {}
    r = w.get("result") or {}
    if not wait:
        click.echo(f"{node}: warm-up started")
        return
    if not r.get("prompts"):
        click.echo(f"{node}: nothing to send: the pool has no warmup.prompts and no captured hot prefixes "
                   "(warmup.capture_prefix_text is off, or no traffic yet)")
        return
    ttft = (f"; TTFT {r['ttft_before_ms']:.1f} ms cold → {r['ttft_after_ms']:.1f} ms warm"
            if r.get("ttft_before_ms") is not None and r.get("ttft_after_ms") is not None else "")
    click.echo(f"{node}: warm-up {w.get('status')}: {r.get('sent', 0)} sent, {r.get('failed', 0)} failed "
               f"({r.get('from_policy', 0)} policy prompt(s), {r.get('from_hot_prefixes', 0)} hot prefix(es)){ttft}")
    if w.get("status") == "failed":
        sys.exit(1)


@click.command("apply")
@click.argument("policy", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Remove nodes that still have work (requests in flight, or a drain "
              "not finished): their keys move at once and their requests are left to end on them.")
@connection
@click.pass_context
def apply_command(ctx, policy: Path, force: bool, control_url, token) -> None:
    """Apply POLICY through the control plane (validated, nginx -t, reload; the running config
    keeps serving on any error). A POLICY that drops a node that still has work is refused
    (exit 2) unless --force: drain the node first (`kvgate drain NODE --wait`)."""
    from ..control.client import ControlError

    try:
        text = policy.read_text(encoding="utf-8")
    except OSError as exc:
        click.echo(f"error: cannot read {policy}: {exc.strerror}", err=True)
        sys.exit(2)
    except UnicodeDecodeError:
        click.echo(f"error: {policy} is not UTF-8 text: is it a policy YAML file?", err=True)
        sys.exit(2)
    client = _client(ctx, control_url, token)
    try:
        # relative static_answers are FILE's folder's (not the control plane's cwd or run dir)
        res = client.apply(text, source=f"kvgate apply {policy}", force=force,
                           files_base=str(policy.resolve().parent))
    except ControlError as exc:
        if exc.code == "node_has_work":
            busy = exc.error.get("nodes") or []
            if len(busy) == 1:
                click.echo(f"error: {policy} not applied: node {busy[0]['id']} still has work ({_work(busy[0])})",
                           err=True)
            else:
                click.echo(f"error: {policy} not applied: {len(busy)} nodes still have work:", err=True)
                for b in busy:
                    click.echo(f"  {b['id']} ({_work(b)})", err=True)
            waits = "; ".join(f"`kvgate drain {b['id']} --wait`" for b in busy)
            click.echo(f"  drain first and wait ({waits}), then apply again; or `kvgate apply --force {policy}` "
                       "removes now (keys move at once, requests in flight are left to end on the node).\n"
                       "  The running config keeps serving.", err=True)
            sys.exit(2)
        if exc.issues:
            click.echo(f"error: invalid policy {policy}:", err=True)
            for i in exc.issues:
                click.echo(f"  {i['path']}: {i['reason']}" if i.get("path") else f"  {i['reason']}", err=True)
            sys.exit(2)
        _fail(exc)
    what = "applied as version" if res["changed"] else "unchanged, still version"
    click.echo(f"{policy}: {what} {res['version']} (nginx {res['result']})")
    gw = res.get("gateways")
    if gw:
        lost = f"; lost, not waited for: {', '.join(gw['lost'])}" if gw["lost"] else ""
        if gw["complete"]:
            click.echo(f"gateways: all {gw['members'] - len(gw['lost'])} live member(s) run version {res['version']} "
                       f"(waited {gw['waited_s']:.2f}s){lost}")
        else:
            click.echo(f"gateways: not yet on version {res['version']} after {gw['waited_s']:.1f}s: "
                       f"{', '.join(gw['laggards'])} (applied anyway: they follow when they catch up){lost}")
    try:
        joining = [n["id"] for n in client.nodes() if n["state"] == "joining"]
    except ControlError:
        joining = []
    if joining:
        click.echo(f"joining: {', '.join(joining)}: each waits for its engine to answer /health, then warms up and "
                   "ramps in (`apply` starts no process: `kvgate up POLICY` starts simulated engines and agents)")


@click.command("events")
@click.option("--node", default=None, help="Only this node's events.")
@click.option("--kind", default=None, help="Only events of this kind (prefix: state, reload, warmup, degrade, ...).")
@click.option("-n", "--limit", default=30, show_default=True, type=click.IntRange(1, 1000))
@click.option("--json", "as_json", is_flag=True)
@connection
@click.pass_context
def events_command(ctx, node, kind, limit, as_json, control_url, token) -> None:
    """Show the control plane's events, newest first."""
    from ..control.client import ControlError

    try:
        events = _client(ctx, control_url, token).events(limit=limit, node=node, kind=kind)
    except ControlError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(events, indent=2))
        return
    for ev in events:
        ts = time.strftime("%H:%M:%S", time.localtime(ev["ts"]))
        click.echo(f"{ts}  {ev['kind']:<16} {ev['message']}")


@click.command("token")
@click.pass_context
def token_command(ctx) -> None:
    """Print the admin token of this run directory (created by `kvgate up` / `kvgate control`)."""
    from ..control.token import read_token
    from ..rundir import RunDir

    path = RunDir((ctx.obj or {}).get("run_dir")).token_file
    try:
        click.echo(read_token(path))
    except (OSError, ValueError) as exc:
        click.echo(f"error: no admin token at {path} ({exc}); start the stack with `kvgate up`", err=True)
        sys.exit(1)


COMMANDS = [nodes_command, drain_command, undrain_command, warm_command, apply_command, invalidate_command,
            events_command, token_command]
