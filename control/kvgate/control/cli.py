"""``kvgate control``: run the control plane (API + reconciler) with waitress."""

from __future__ import annotations

import logging
import signal
import ssl
import sys
from pathlib import Path

import click

from ..policy import PolicyError


@click.command("control")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Policy to apply at start [default: the latest version applied before, kept in Redis].")
@click.option("--redis-url", default=None, help="Redis with the control plane's state [default: the policy's redis.url].")
@click.option("--nginx-prefix", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The gateway's nginx prefix [default: <run dir>/nginx].")
@click.option("--listen", default=None, help="HOST:PORT to serve on [default: the policy's control.listen].")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Admin token file, created (mode 0600) if missing [default: <run dir>/admin.token].")
@click.option("--external-gateway", is_flag=True,
              help="Never start nginx (another process runs it): write the config and reload a running master.")
@click.option("--threads", default=8, show_default=True, help="waitress worker threads.")
@click.pass_context
def control_command(ctx: click.Context, policy_path: Path | None, redis_url: str | None, nginx_prefix: Path | None,
                    listen: str | None, token_file: Path | None, external_gateway: bool, threads: int) -> None:
    """Run the control plane: admin API, node states, weights, drain, warm-up and ramp.

    It owns the gateway's nginx config while it runs; its state lives in Redis.
    """
    import waitress

    from ..addr import split_host_port
    from ..batch.records import batch_secret
    from ..nginxctl import Nginx
    from ..policy import load_policy, parse_policy_text
    from ..policy.model import is_loopback_listen
    from ..policy.tls import resolve_tls
    from ..rundir import RunDir
    from ..web import create_app
    from .plane import ApplyError, ControlPlane
    from .store import Store, StoreError
    from .token import ensure_token

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    rd = RunDir((ctx.obj or {}).get("run_dir"))
    run_dir = rd.root
    text = None
    files_base = None
    try:
        if policy_path is not None:
            files_base = str(policy_path.resolve().parent)  # its relative static_answers
            policy = load_policy(policy_path)
            text = policy_path.read_text(encoding="utf-8")
            source = f"kvgate control --policy {policy_path}"
        else:
            policy = None
            source = "restart"
    except PolicyError as exc:
        click.echo(f"error: invalid policy {exc.source}:", err=True)
        for issue in exc.issues:
            click.echo(f"  {issue}", err=True)
        sys.exit(2)
    url = redis_url or (policy.redis.client_url if policy else None)
    if not url:
        raise click.UsageError("pass --policy or --redis-url (where the state of a previous run is)")
    store = Store(url)
    if not store.ping():
        click.echo(f"error: cannot reach Redis at {url}", err=True)
        sys.exit(1)
    token_path = token_file or rd.token_file
    token, created = ensure_token(token_path)
    if created:
        click.echo(f"admin token written to {token_path} (mode 0600)", err=True)
    # the Batch API worker signs its lines with a key derived from the same token (X-Kvgate-Batch)
    plane = ControlPlane(store, Nginx(nginx_prefix or rd.nginx_prefix, batch_secret=batch_secret(token)),
                         run_dir=run_dir, external_gateway=external_gateway)
    if policy is not None:
        control_cfg = policy.control
    else:
        latest = store.latest_version()
        # control.tls's relative paths: the folder recorded with the version
        control_cfg = (resolve_tls(parse_policy_text(latest["yaml"]), latest.get("files_base")).control
                       if latest else None)
    # each member beyond the first holds one server thread in its long poll (docs/scale-out.md)
    members_policy = policy if policy is not None else (parse_policy_text(latest["yaml"]) if latest else None)
    if members_policy is not None:
        threads += len(members_policy.gateway_members()) - 1
    if listen is None:
        listen = control_cfg.listen if control_cfg is not None else "127.0.0.1:9090"
    tls = control_cfg.tls if control_cfg is not None else None
    if tls is None and not is_loopback_listen(listen):
        click.echo(f"warning: the admin API and page listen on {listen}, beyond loopback, in plain HTTP: the admin "
                   "token and the session cookie cross the network in clear (set control.tls, docs/tls.md; "
                   "control.require_tls refuses such a policy)", err=True)
    # bind first: a busy port must fail before nginx is started or Redis is written
    try:
        host, port = split_host_port(listen)
        if tls is not None:  # waitress has no TLS: cheroot serves the same app (kvgate.control.https)
            from .https import TlsServer

            server = TlsServer(create_app(plane, token), host, port, threads, tls)
            plane.tls_watch.control_server = server  # renewals: reloaded from the tick
        else:
            server = waitress.create_server(create_app(plane, token), host=host, port=port,
                                            threads=threads, ident="kvgate-control")
    except (OSError, ValueError, ssl.SSLError) as exc:
        click.echo(f"error: cannot listen on {listen}: {getattr(exc, 'strerror', None) or exc}", err=True)
        sys.exit(1)
    try:
        plane.start(text, source, files_base)
    except PolicyError as exc:
        server.close()
        click.echo(f"error: invalid policy {exc.source}: " + "; ".join(str(i) for i in exc.issues), err=True)
        sys.exit(2)
    except (ApplyError, StoreError, ValueError) as exc:
        server.close()
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    assert plane.policy is not None

    def _stop(signum, _frame):
        # server.close() only closes the listening socket: waitress's loop keeps running while a
        # client holds an idle keep-alive connection. SystemExit raised here, in the main thread
        # that runs the loop, ends server.run() (waitress catches it and stops its workers;
        # cheroot's kvgate.control.https.TlsServer.run likewise, giving a busy worker 2 s).
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    click.echo(f"kvgate control on {'https' if tls else 'http'}://{listen} (policy version "
               f"{(plane.policy_version or {}).get('version')}, {len(plane.nodes)} node(s))", err=True)
    try:
        server.run()
    except (OSError, ValueError):
        pass  # closed by the signal handler
    plane.stop()
