"""Run the gateway's private nginx: apply a policy and a runtime, start, reload, stop.

Two kinds of change (the ingress-nginx controller's shape):

* the *static* files (``conf/nginx.conf``, ``conf/kvgate.json``: listeners, pools, timeouts …)
  change through a reload transaction: render, compare with what is installed, ``nginx -t``
  on a staged copy, atomic rename into ``conf/``, then start or ``nginx -s reload``, confirmed
  by the health digest. A config that ``nginx -t`` rejects never replaces the running one; the
  config that ran before the last change is kept as ``conf/*.last-good`` and put back when the
  reload fails.
* the *runtime* (weights, node states, balancer per pool, cache namespace:
  :func:`kvgate.render.runtime_document`) is pushed to the gateway's loopback-only internal
  listener (:mod:`kvgate.gateway.dynamic`) without a reload. ``conf/runtime.json`` holds it too,
  written before every start, reload and push, so a gateway that (re)loads serves the current
  runtime from its first request.

nginx runs as a daemon (the master re-parents to init), started with
``nginx -p PREFIX -c conf/nginx.conf``; its pid is read from ``logs/nginx.pid``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from .gateway import dynamic
from .policy.model import Policy
from .render import Runtime, default_lua_dir, render, runtime_document, runtime_json

CONF = "conf/nginx.conf"
DATA = "conf/kvgate.json"
RUNTIME = "conf/runtime.json"
"""The runtime in force (or being pushed): read by the gateway's ``init_by_lua`` at every load."""
SECRET = "conf/push.secret"
"""The internal listener's push secret (0600, created once, kept across reloads)."""
_DIRS = ("conf", "logs", "tmp")
PUSH_SETTLE_S = 0.3
"""How long :meth:`Nginx.apply` waits after a push before it returns ``"pushed"``: every worker
checks the shared dict's version every 0.2 s (``lua/kvgate/config.lua`` ``SYNC_S``), so once this
has passed each one routes on the new runtime, as after a confirmed reload."""
CONFIRM_S = 10.0
"""How long a started or reloaded gateway may take to answer ``GET /kvgate/config`` (seconds)."""


def _write(path: Path, text: str, private: bool = False) -> None:
    """Write ``text`` to ``path``; ``private``: readable by its owner only (0600), for kvgate.json,
    which holds the batch secret (nginx's master reads it in init_by_lua, before dropping to
    its workers' user)."""
    if not private:
        path.write_text(text)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class NginxError(RuntimeError):
    """nginx refused a config or did not start/stop; the message carries nginx's own [emerg] lines."""


def _emerg(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = [ln for ln in lines if "[emerg]" in ln or "[alert]" in ln or "[error]" in ln]
    return "\n".join(picked or lines[-5:])


def find_binary(name: str, package: str) -> str:
    """Path of a system binary: ``$PATH`` first, then ``/usr/sbin`` and ``/usr/bin`` (a
    non-login root shell may lack ``/usr/sbin``). Raises FileNotFoundError naming the
    Debian package to install."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        raise FileNotFoundError(f"{name} is not installed (apt-get install {package}, or run `make setup`)")
    return found


class Nginx:
    """One private nginx instance under ``prefix``.

    Args:
        prefix: the ``-p`` directory (created if missing); holds ``conf/``, ``logs/``, ``tmp/``.
        nginx_bin: the nginx executable.
        lua_dir: the folder with ``kvgate/*.lua`` (default: the repo's ``lua/``).
        batch_secret: the key of the Batch API worker's ``X-Kvgate-Batch`` header, rendered into
            kvgate.json (:func:`kvgate.batch.records.batch_secret` of the admin token; ``""``: the
            gateway refuses every batch header).
    """

    def __init__(self, prefix: Path, nginx_bin: str | None = None, lua_dir: Path | None = None,
                 batch_secret: str = ""):
        self.prefix = Path(prefix).resolve()
        self.batch_secret = batch_secret
        self._nginx_bin = nginx_bin
        self.lua_dir = Path(lua_dir).resolve() if lua_dir else default_lua_dir()
        self.listen: str | None = None
        self.client_tls = False
        """Whether ``listen`` serves HTTPS (``gateway.tls``): the health digest is read over TLS then."""
        self.digest: str | None = None
        self.internal_listen: str | None = None
        self.control_url: str | None = None
        """Where this gateway's /v1/files and /v1/batches reach the control plane; None: its
        ``control.listen`` on this host (a member's supervisor sets its ``--control`` URL)."""

    # ----------------------------------------------------------------- helpers
    def _dirs(self) -> None:
        for d in _DIRS:
            (self.prefix / d).mkdir(parents=True, exist_ok=True)

    @property
    def nginx_bin(self) -> str:
        """The nginx executable, looked up on first use (raises :class:`NginxError` if missing)."""
        if self._nginx_bin is None:
            try:
                self._nginx_bin = find_binary("nginx", "nginx libnginx-mod-http-lua")
            except FileNotFoundError as exc:
                raise NginxError(str(exc)) from None
        return self._nginx_bin

    def _run(self, *args: str, conf: str = CONF) -> subprocess.CompletedProcess:
        cmd = [self.nginx_bin, "-p", str(self.prefix) + "/", "-c", conf, *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise NginxError(f"`nginx {' '.join(args)}` did not finish within 60s") from None
        except OSError as exc:
            raise NginxError(f"cannot run {self.nginx_bin}: {exc}") from None

    def _installed(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for rel in (CONF, DATA):
            p = self.prefix / rel
            out[rel] = p.read_text() if p.exists() else None
        return out

    def error_log_tail(self, lines: int = 20) -> str:
        p = self.prefix / "logs/error.log"
        if not p.exists():
            return ""
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])

    # ----------------------------------------------------------------- public
    def test(self, files: dict[str, str]) -> None:
        """``nginx -t`` on ``files`` staged in a temp conf dir; raises :class:`NginxError`."""
        self._dirs()
        stage = Path(tempfile.mkdtemp(prefix="conf.staging-", dir=self.prefix))
        try:
            self._write(stage, files)
            # Note: nginx -t does not run init_by_lua; the data config is checked
            # here for JSON syntax and by the health digest after start/reload.
            if DATA in files:
                try:
                    json.loads(files[DATA])
                except ValueError as exc:
                    raise NginxError(f"kvgate: {DATA} is not valid JSON: {exc}") from None
            res = self._run("-t", "-q", conf=str(stage / "nginx.conf"))
            if res.returncode != 0:
                raise NginxError("nginx -t rejected the config:\n" + _emerg(res.stderr + res.stdout))
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    @staticmethod
    def _write(conf_dir: Path, files: dict[str, str]) -> None:
        for rel, text in files.items():
            name = rel.removeprefix("conf/")
            (conf_dir / name).write_text(text)

    def push_secret(self) -> str:
        """The internal listener's secret from ``conf/push.secret``, created (0600) on first use.
        Raises :class:`NginxError` when the file cannot be created or read."""
        self._dirs()
        try:
            return dynamic.ensure_secret(self.prefix / SECRET)
        except (OSError, ValueError) as exc:
            raise NginxError(f"push secret: {exc}") from None

    def render(self, policy: Policy) -> dict[str, str]:
        """The static files for ``policy`` with this gateway's push secret and batch secret (see
        :func:`kvgate.render.render`)."""
        return render(policy, self.lua_dir, push_secret_sha256=dynamic.secret_sha256(self.push_secret()),
                      batch_secret=self.batch_secret, run_dir=self.prefix.parent, control_url=self.control_url)

    def apply(self, policy: Policy, runtime: Runtime | None = None, start: bool = True) -> str:
        """Make nginx run ``policy`` with the control plane's ``runtime`` (None: the policy as written).

        The static files go through the reload transaction when they differ from the installed
        ones (or nginx is not running); otherwise a runtime that differs from the one in force is
        pushed, without a reload.

        Args:
            start: start nginx when it is not running; with False (another process runs
                nginx, e.g. a compose service) the tested config is only written.

        Returns:
            ``"unchanged"`` (already running this config and runtime), ``"pushed"`` (the runtime
            changed: in force in every worker within 0.2 s), ``"started"``, ``"reloaded"`` or
            ``"written"`` (not running and ``start`` is False).

        Raises:
            NginxError: ``nginx -t`` refused the config (the running one is untouched), nginx
                failed to start/reload (the last good files are back), or the gateway refused or
                did not take a push (the message is the gateway's; the runtime in force stays).
        """
        files = self.render(policy)
        doc = runtime_document(policy, runtime)
        doc_text = runtime_json(doc)
        running = self.pid() is not None
        installed = self._installed()
        digest = json.loads(files[DATA])["digest"]
        if running and installed.get(CONF) == files[CONF] and _digest_of(installed.get(DATA)) == digest:
            self.listen, self.digest = policy.gateway.listen, digest
            self.client_tls = policy.gateway.tls is not None
            self.internal_listen = policy.gateway.internal_listen
            if installed.get(DATA) != files[DATA]:
                # only the runtime's defaults differ: read at the next load, after runtime.json
                self._install({DATA: files[DATA]})
            return self._push(doc, doc_text)
        self.test(files)
        previous = (self.listen, self.digest, self.internal_listen, self.client_tls)
        # reload()/start() wait for this config's digest on its address
        self.listen, self.digest = policy.gateway.listen, digest
        self.client_tls = policy.gateway.tls is not None
        self.internal_listen = policy.gateway.internal_listen
        old_runtime = self._read(RUNTIME)
        if running:
            for rel, old in installed.items():
                if old is not None:
                    _write(self.prefix / (rel + ".last-good"), old, private=rel == DATA)
        # the runtime first: the new config's init_by_lua seeds its workers from it
        self._install({RUNTIME: doc_text, **files})
        if running:
            try:
                self.reload()
                self._confirm(doc, doc_text)
            except NginxError:
                self._rollback(installed, old_runtime)
                self.listen, self.digest, self.internal_listen, self.client_tls = previous
                raise
            return "reloaded"
        if not start:
            return "written"
        self.start()
        self._confirm(doc, doc_text)
        return "started"

    def runtime_in_force(self) -> dict[str, Any]:
        """``GET /kvgate/config`` of the running gateway: ``{"version", "digest", "runtime", "loads"}``
        (``loads`` rises by one at every reload). Raises :class:`NginxError` when it does not answer."""
        if not self.internal_listen:
            raise NginxError("no policy applied yet: the internal listener is not known")
        try:
            return dynamic.current(self.internal_listen, self.push_secret())
        except dynamic.PushError as exc:
            raise NginxError(str(exc)) from None

    def _push(self, doc: dict[str, Any], doc_text: str) -> str:
        """Push ``doc`` unless it is the runtime in force; ``"pushed"`` or ``"unchanged"``."""
        assert self.internal_listen
        secret = self.push_secret()
        try:
            in_force = dynamic.current(self.internal_listen, secret)
        except dynamic.PushError:
            in_force = None  # the push says why
        if in_force is not None and _same_runtime(in_force, doc, doc_text):
            if self._read(RUNTIME) != doc_text:
                self._install({RUNTIME: doc_text})
            return "unchanged"
        old_runtime = self._read(RUNTIME)
        self._install({RUNTIME: doc_text})
        try:
            dynamic.push(self.internal_listen, secret, doc_text)
        except dynamic.PushError as exc:
            # runtime.json says what the gateway runs: the next load must not take the refused one
            kept = runtime_json(in_force["runtime"]) if in_force is not None else old_runtime
            if kept is not None:
                self._install({RUNTIME: kept})
            raise NginxError(f"runtime not pushed, the one in force keeps serving: {exc}") from None
        time.sleep(PUSH_SETTLE_S)
        return "pushed"

    def _confirm(self, doc: dict[str, Any], doc_text: str) -> None:
        """After a start or reload: wait until the gateway answers ``GET /kvgate/config`` and
        runs ``doc``, pushing it once if a load took another runtime. Raises :class:`NginxError`."""
        assert self.internal_listen
        secret = self.push_secret()
        deadline = time.monotonic() + CONFIRM_S
        while True:
            try:
                in_force = dynamic.current(self.internal_listen, secret)
                break
            except dynamic.PushError as exc:
                if time.monotonic() > deadline or self.pid() is None:
                    raise NginxError(f"the gateway's internal listener does not answer: {exc}\n"
                                     + _emerg(self.error_log_tail())) from None
                time.sleep(0.05)
        if _same_runtime(in_force, doc, doc_text):
            return
        try:
            dynamic.push(self.internal_listen, secret, doc_text)
        except dynamic.PushError as exc:
            raise NginxError(f"the reloaded gateway does not run the current runtime: {exc}") from None

    def _read(self, rel: str) -> str | None:
        p = self.prefix / rel
        return p.read_text() if p.exists() else None

    def _install(self, files: dict[str, str]) -> None:
        """Write each file atomically: staged next to its target (one file system), then renamed."""
        self._dirs()
        for rel, text in files.items():
            target = self.prefix / rel
            tmp = target.with_name(target.name + ".new")
            _write(tmp, text, private=rel == DATA)
            os.replace(tmp, target)

    def _rollback(self, installed: dict[str, str | None], old_runtime: str | None = None) -> None:
        """Put the files that were running back (the master kept running them), the runtime too:
        without a previous ``runtime.json`` (a gateway installed before it existed) the refused
        one is removed, so the next load seeds from the running kvgate.json, never from a runtime
        naming pools it does not have (init_by_lua would refuse to start)."""
        back = {rel: old for rel, old in installed.items() if old is not None}
        if old_runtime is not None:
            back[RUNTIME] = old_runtime
        else:
            (self.prefix / RUNTIME).unlink(missing_ok=True)
        self._install(back)
        self.digest = None
        res = self._run("-s", "reload")
        if res.returncode != 0:
            raise NginxError("nginx reload of the last good config failed:\n" + _emerg(res.stderr + res.stdout))

    def start(self) -> None:
        """Start the daemon with ``conf/nginx.conf``; returns once the master wrote its pid."""
        self._dirs()
        if self.pid() is not None:
            return
        res = self._run()
        if res.returncode != 0:
            raise NginxError("nginx failed to start:\n" + _emerg(res.stderr + res.stdout + "\n" + self.error_log_tail()))
        deadline = time.monotonic() + 10
        while self.pid() is None:
            if time.monotonic() > deadline:
                raise NginxError("nginx did not write logs/nginx.pid:\n" + _emerg(self.error_log_tail()))
            time.sleep(0.02)

    def reload(self) -> None:
        """``nginx -s reload``; when a digest is known, waits until the health endpoint reports it."""
        if self.pid() is None:
            raise NginxError("nginx is not running")
        res = self._run("-s", "reload")
        if res.returncode != 0:
            raise NginxError("nginx reload failed:\n" + _emerg(res.stderr + res.stdout))
        if self.listen and self.digest:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self._health_digest(self.listen) == self.digest:
                    return
                time.sleep(0.05)
            raise NginxError("nginx did not pick up the new config:\n" + _emerg(self.error_log_tail()))

    def stop(self, timeout: float = 10) -> None:
        """Graceful quit (in-flight streams may finish) for up to ``timeout`` s, then TERM, then KILL."""
        pid = self.pid()
        if pid is None:
            return
        workers = _children(pid)
        for sig, wait in ((signal.SIGQUIT, timeout), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                for w in workers:
                    try:
                        os.kill(w, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _alive(pid) and not any(_alive(w) for w in workers):
                    self._clean_pid()
                    return
                time.sleep(0.05)
        self._clean_pid()

    def _clean_pid(self) -> None:
        try:
            (self.prefix / "logs/nginx.pid").unlink()
        except FileNotFoundError:
            pass

    def pid(self) -> int | None:
        """The master's pid from ``logs/nginx.pid`` if that process is alive (a stale file is removed)."""
        path = self.prefix / "logs/nginx.pid"
        try:
            pid = int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if _alive(pid) and _is_master_of(pid, self.prefix):
            return pid
        self._clean_pid()
        return None

    def _health_digest(self, listen: str, tls: bool | None = None) -> str | None:
        """The digest ``GET /kvgate/health`` on ``listen`` reports (None: no answer); over HTTPS
        when ``tls`` (None: :attr:`client_tls`)."""
        tls = self.client_tls if tls is None else tls
        # our own gateway on an address we just configured: this reads which config it runs, no
        # trust is given to the answer, so the certificate is not verified (a self-signed one, or
        # one for a name that is not this address, must not stop a reload's confirmation)
        ctx = None
        if tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        try:
            with urllib.request.urlopen(f"{'https' if tls else 'http'}://{listen}/kvgate/health", timeout=1,
                                        context=ctx) as resp:
                return json.loads(resp.read()).get("digest")
        except (OSError, ValueError):
            return None

    def wait_ready(self, listen: str, timeout: float = 10, tls: bool | None = None) -> None:
        """Wait until ``GET http(s)://<listen>/kvgate/health`` answers 200 (``tls``: over HTTPS;
        None: as the last applied policy says); raises :class:`NginxError`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._health_digest(listen, tls) is not None:
                return
            if self.pid() is None and time.monotonic() > deadline - timeout + 1:
                break
            time.sleep(0.05)
        raise NginxError(f"gateway on {listen} is not answering:\n" + _emerg(self.error_log_tail()))


def _digest_of(text: str | None) -> str | None:
    """The ``digest`` of an installed kvgate.json (None: missing or not kvgate's)."""
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return data.get("digest") if isinstance(data, dict) else None


def _same_runtime(in_force: dict[str, Any], doc: dict[str, Any], doc_text: str) -> bool:
    """Whether the gateway's answer to ``GET /kvgate/config`` is the runtime ``doc``: the same stored
    bytes (sha256 of ``doc_text``), or the same document."""
    return in_force.get("digest") == hashlib.sha256(doc_text.encode()).hexdigest() or in_force.get("runtime") == doc


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _is_master_of(pid: int, prefix: Path) -> bool:
    """Whether ``pid`` is the nginx master of this prefix: its title reads
    ``nginx: master process nginx -p PREFIX/ ...``, so a reused pid is never taken for it."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "nginx" in title and f"-p {prefix}/" in title


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []
