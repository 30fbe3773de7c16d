"""``kvgate gateway``: the supervisor of one gateway member on its host (issue 17 item 1,
docs/scale-out.md).

A policy's ``gateways:`` lists the nginx instances sharing it; the control plane drives the first
itself, and each other member runs this supervisor next to its nginx. Every round (at least every
``control.gateway_sync_s``; a change arrives at once, through a long poll of
``GET /api/v1/gateways/<id>/config?known=<tag>``) it

1. gets the current policy version's text and the runtime in force from the control plane,
2. renders the member's static files *here* (:meth:`kvgate.policy.model.Policy.member_policy` and
   :meth:`kvgate.nginxctl.Nginx.apply`): the Lua folder of this host's kvgate install, this nginx's
   own push secret and batch secret, host names resolved on this host. Receiving files rendered by
   the control plane would carry its paths and its resolver's answers, and another gateway's push
   secret; the policy text is all a host needs (``static_answers`` files are read by the semantic
   service, not by nginx),
3. applies them through the confirmed transaction (``nginx -t`` on a staged copy, atomic swap,
   reload confirmed by the health digest, rollback to the last good files), or, when only the
   runtime changed, pushes it to the member's internal listener (no reload). nginx is *started*
   only with a config fetched from the control plane, so a restarted gateway runs the current
   version from its first request, and
4. reports ``POST /api/v1/gateways/<id>/status``: the version and runtime digest it runs, nginx's
   pid and health, the last apply's result or error, and its in-flight count per node (its own
   ``/metrics``).

A control plane that does not answer leaves a running nginx serving what it has (reported again
when the plane is back) and a stopped one stopped. SIGTERM/SIGINT stop nginx gracefully, then the
supervisor.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import requests

from ..control import probes
from ..control.gateways import runtime_from_fields
from ..nginxctl import Nginx, NginxError
from ..policy import PolicyError, parse_policy_text
from ..policy.tls import files_stamp, resolve_tls

log = logging.getLogger("kvgate.gateway")

RETRY_S = 1.0
"""Pause after the control plane did not answer (seconds)."""
REFUSED_RETRY_S = 10.0
"""Pause after the control plane refused the supervisor (401/404) while nginx serves (seconds)."""


class SupervisorError(RuntimeError):
    """The control plane refused the supervisor (unknown member, wrong token): not retried."""


class Supervisor:
    """One member's supervisor loop.

    Args:
        control_url: the control plane, ``http://HOST:PORT``.
        member_id: this member's id in the policy's ``gateways:``.
        prefix: this member's nginx prefix (``conf/``, ``logs/``, ``tmp/``).
        token: the admin token (also the source of the batch secret rendered into kvgate.json).
        sync_s: the longest wait between two rounds; None: the policy's ``control.gateway_sync_s``.
        lua_dir: the Lua folder (default: this install's).
        verify: requests' ``verify`` for an ``https://`` control plane (a CA bundle's path, or True).
    """

    def __init__(self, control_url: str, member_id: str, prefix: Path, token: str, sync_s: float | None = None,
                 lua_dir: Path | None = None, verify: str | bool = True):
        from ..batch.records import batch_secret

        self.url = control_url.rstrip("/")
        self.id = member_id
        self.sync_override = sync_s
        self.sync_s = sync_s or 1.0
        self.nginx = Nginx(prefix, lua_dir=lua_dir, batch_secret=batch_secret(token))
        # the Batch API's routes of this member go to the control plane where this host reaches it
        self.nginx.control_url = self.url
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"
        self.verify = verify
        self.metrics_http = requests.Session()
        self.applied_tag: str | None = None
        self.seen_tag: str | None = None
        self.version: int | None = None
        self.runtime_digest: str | None = None
        self.result: str | None = None
        self.tls: Any = None
        """The member's ``gateway.tls`` as last applied, and its files' stamp then (renewal check)."""
        self.tls_stamp: Any = None
        self.error: str | None = None
        self.applied_at: float | None = None
        self.apply_s: float | None = None
        self.stopping = threading.Event()

    # ------------------------------------------------------------ control plane
    def _call(self, method: str, path: str, timeout: float, **kw: Any) -> dict[str, Any]:
        try:
            # verify per request: requests lets $REQUESTS_CA_BUNDLE override a session's (psf/requests#3829)
            resp = self.http.request(method, self.url + path, timeout=timeout, verify=self.verify, **kw)
        except requests.RequestException as exc:
            raise ConnectionError(f"control plane at {self.url} not reachable: {type(exc).__name__}") from None
        if resp.status_code in (401, 404):
            raise SupervisorError(f"control plane refused {method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise ConnectionError(f"control plane answered HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError:
            raise ConnectionError("control plane answered no JSON") from None

    def fetch(self, wait_s: float) -> dict[str, Any]:
        """The member's config; a long poll of ``wait_s`` when a config was seen before."""
        params = {"known": self.seen_tag, "wait": f"{wait_s:g}"} if self.seen_tag and wait_s > 0 else None
        return self._call("GET", f"/api/v1/gateways/{self.id}/config", timeout=wait_s + 10, params=params)

    # ------------------------------------------------------------ nginx
    def apply(self, cfg: dict[str, Any]) -> None:
        """Make nginx run ``cfg`` (the transaction of :meth:`kvgate.nginxctl.Nginx.apply`). A refused
        config is reported (``error``) and tried again at the next round; the running one serves."""
        self.seen_tag = cfg["tag"]
        t0 = time.monotonic()
        try:
            policy = parse_policy_text(cfg["policy"], f"version {cfg['version']}").member_policy(self.id)
            # relative certificate paths: the policy file's folder, as the control plane reads them
            policy = resolve_tls(policy, cfg.get("files_base"))
            self.tls = policy.gateway.tls
            self.tls_stamp = files_stamp(self.tls) if self.tls else None
            result = self.nginx.apply(policy, runtime_from_fields(cfg.get("runtime")), start=True)
        except (PolicyError, NginxError, KeyError, ValueError, OSError) as exc:
            self.result, self.error = "failed", str(exc)[:2000]
            log.warning("gateway %s: version %s not applied, the running config keeps serving: %s",
                        self.id, cfg.get("version"), str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        self.apply_s = round(time.monotonic() - t0, 3)
        self.applied_tag, self.version, self.runtime_digest = cfg["tag"], cfg["version"], cfg["runtime_digest"]
        self.result, self.error, self.applied_at = result, None, time.time()
        if result != "unchanged":
            log.info("gateway %s: policy version %s %s in %.3fs", self.id, cfg["version"], result, self.apply_s)

    def _tls_renewed(self) -> bool:
        """Whether this member's certificate files changed on disk since the last apply (a renewal:
        applying again renders their new digest into nginx.conf, so the confirmed reload loads
        them; a pair that does not match is refused by ``nginx -t`` and reported, the old serves)."""
        if self.tls is None:
            return False
        return files_stamp(self.tls) != self.tls_stamp

    def status(self) -> dict[str, Any]:
        """What is reported to the control plane (see :data:`kvgate.control.gateways.STATUS_FIELDS`)."""
        pid = self.nginx.pid()
        healthy = False
        inflight = None
        if pid is not None and self.nginx.listen and self.nginx.internal_listen:
            healthy = self.nginx._health_digest(self.nginx.listen) == self.nginx.digest
            snap = probes.fetch_gateway(self.metrics_http, self.nginx.internal_listen)
            if snap.get("ok"):
                inflight = snap["inflight"]
        running = pid is not None
        return {"version": self.version if running else None,
                "runtime_digest": self.runtime_digest if running else None,
                "static_digest": self.nginx.digest if running else None, "nginx_pid": pid, "healthy": healthy,
                "result": self.result, "error": self.error, "inflight": inflight, "listen": self.nginx.listen,
                "applied_at": self.applied_at, "apply_s": self.apply_s}

    def report(self) -> None:
        self._call("POST", f"/api/v1/gateways/{self.id}/status", timeout=10, json=self.status())

    # ------------------------------------------------------------ loop
    def round(self) -> None:
        """One round: fetch (long poll while nginx runs the last config), apply when it differs or
        nginx is not running, report. Raises ConnectionError (control plane unreachable),
        SupervisorError."""
        running = self.nginx.pid() is not None
        wait = self.sync_s if running and self.applied_tag == self.seen_tag else 0.0
        cfg = self.fetch(wait)
        if self.sync_override is None:
            self.sync_s = float(cfg.get("sync_s") or 1.0)
        if cfg.get("first"):
            raise SupervisorError(f"gateway {self.id} is the policy's first member: the control plane drives "
                                  "it itself (run no supervisor for it)")
        if cfg["tag"] != self.applied_tag or self.nginx.pid() is None or self._tls_renewed():
            if cfg["tag"] == self.seen_tag and self.result == "failed" and wait == 0.0:
                # the same config failed the round before: try again after a sync interval
                self.stopping.wait(self.sync_s)
            self.apply(cfg)
        self.report()

    def run(self) -> int:
        """Rounds until :attr:`stopping`; then nginx is stopped. Returns the exit code (2: refused)."""
        code = 0
        while not self.stopping.is_set():
            try:
                self.round()
            except SupervisorError as exc:
                if self.nginx.pid() is None:
                    log.error("%s", exc)
                    code = 2
                    break
                # a refusal (a replaced token, a member id the applied policy no longer lists)
                # must not take a serving gateway down: it keeps serving what it runs, and asks
                # again; only SIGTERM stops it
                log.error("%s (nginx keeps serving its config; asking again in %.0fs)", exc, REFUSED_RETRY_S)
                self.stopping.wait(REFUSED_RETRY_S)
            except ConnectionError as exc:
                log.warning("gateway %s: %s (nginx %s)", self.id, exc,
                            "keeps serving" if self.nginx.pid() else "not started")
                self.stopping.wait(RETRY_S)
        self.nginx.stop()
        return code


@click.command("gateway")
@click.option("--control", "control_url", default=None, envvar="KVGATE_CONTROL_URL",
              help="The control plane's URL [default: the running stack's control.listen].")
@click.option("--id", "member_id", required=True, help="This member's id in the policy's `gateways:`.")
@click.option("--prefix", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="This member's nginx prefix [default: <run dir>/gateways/<id>/nginx].")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The admin token file [default: $KVGATE_TOKEN, else <run dir>/admin.token].")
@click.option("--sync-s", type=click.FloatRange(min=0.05, max=60), default=None,
              help="Longest wait between two rounds [default: the policy's control.gateway_sync_s].")
@click.option("--ca-file", type=click.Path(dir_okay=False, path_type=Path), default=None, envvar="KVGATE_CA_FILE",
              help="CA bundle that signs an https:// control plane's certificate (docs/tls.md).")
@click.pass_context
def gateway_command(ctx: click.Context, control_url: str | None, member_id: str, prefix: Path | None,
                    token_file: Path | None, sync_s: float | None, ca_file: Path | None) -> None:
    """Run one gateway member (its own nginx) for the control plane: fetch its policy version and
    runtime, apply them through the confirmed reload transaction or a runtime push, report its status."""
    import os

    from ..control.client import ControlError, resolve
    from ..control.token import read_token
    from ..rundir import RunDir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = RunDir((ctx.obj or {}).get("run_dir"))
    try:
        if token_file is not None:
            token = read_token(token_file)
            url, _ = resolve(run_dir.root, control_url, token)
        else:
            url, token = resolve(run_dir.root, control_url, os.environ.get("KVGATE_TOKEN"))
    except (ControlError, OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    sup = Supervisor(url, member_id, prefix or run_dir.root / "gateways" / member_id / "nginx", token, sync_s,
                     verify=str(ca_file) if ca_file else True)

    def _stop(signum, _frame):
        sup.stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    click.echo(f"kvgate gateway {member_id}: control plane {url}, nginx prefix {sup.nginx.prefix}", err=True)
    from urllib.parse import urlsplit

    from ..policy.model import is_loopback_listen

    parts = urlsplit(url)
    if parts.scheme == "http" and not is_loopback_listen(f"{parts.hostname}:{parts.port or 80}"):
        click.echo(f"warning: the admin token goes to {url} in plain HTTP, and the Batch API's requests "
                   "(with tenants' keys) too: serve the control plane over HTTPS beyond one host "
                   "(control.tls, docs/tls.md)", err=True)
    sys.exit(sup.run())
