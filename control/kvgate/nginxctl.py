"""Run the gateway's private nginx: apply a policy as a transaction, start, reload, stop.

A reload is a transaction (the ingress-nginx controller's shape): render, compare
with what is installed, ``nginx -t`` on a staged copy, atomic rename into
``conf/``, then start or ``nginx -s reload``. A config that ``nginx -t`` rejects
never replaces the running one; the config that ran before the last change is
kept as ``conf/*.last-good``.

nginx runs as a daemon (the master re-parents to init), started with
``nginx -p PREFIX -c conf/nginx.conf``; its pid is read from ``logs/nginx.pid``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from .policy.model import Policy
from .render import Runtime, default_lua_dir, render

CONF = "conf/nginx.conf"
DATA = "conf/kvgate.json"
_DIRS = ("conf", "logs", "tmp")


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
    """

    def __init__(self, prefix: Path, nginx_bin: str | None = None, lua_dir: Path | None = None):
        self.prefix = Path(prefix).resolve()
        self._nginx_bin = nginx_bin
        self.lua_dir = Path(lua_dir).resolve() if lua_dir else default_lua_dir()
        self.listen: str | None = None
        self.digest: str | None = None

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

    def apply(self, policy: Policy, runtime: Runtime | None = None, start: bool = True) -> str:
        """Make nginx run ``policy`` (with the control plane's ``runtime`` weights, if given).

        Args:
            start: start nginx when it is not running; with False (another process runs
                nginx, e.g. a compose service) the tested config is only written.

        Returns:
            ``"unchanged"`` (already running this exact config), ``"started"``, ``"reloaded"``
            or ``"written"`` (not running and ``start`` is False).

        Raises:
            NginxError: ``nginx -t`` refused the config (the running one is untouched),
                or nginx failed to start/reload.
        """
        files = render(policy, self.lua_dir, runtime)
        running = self.pid() is not None
        installed = self._installed()
        if running and all(installed.get(rel) == text for rel, text in files.items()):
            self.listen = policy.gateway.listen
            self.digest = json.loads(files[DATA])["digest"]
            return "unchanged"
        self.test(files)
        previous = (self.listen, self.digest)
        # reload()/start() wait for this config's digest on its address
        self.listen = policy.gateway.listen
        self.digest = json.loads(files[DATA])["digest"]
        conf_dir = self.prefix / "conf"
        if running:
            for rel, old in installed.items():
                if old is not None:
                    (self.prefix / (rel + ".last-good")).write_text(old)
        # stage next to the target so os.replace is an atomic rename on one file system
        for rel, text in files.items():
            target = self.prefix / rel
            tmp = conf_dir / (target.name + ".new")
            tmp.write_text(text)
            os.replace(tmp, target)
        if running:
            try:
                self.reload()
            except NginxError:
                self._rollback(installed)
                self.listen, self.digest = previous
                raise
            return "reloaded"
        if not start:
            return "written"
        self.start()
        return "started"

    def _rollback(self, installed: dict[str, str | None]) -> None:
        """Put the files that were running back (the master kept running them)."""
        for rel, old in installed.items():
            if old is not None:
                tmp = self.prefix / (rel + ".new")
                tmp.write_text(old)
                os.replace(tmp, self.prefix / rel)
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

    def _health_digest(self, listen: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{listen}/kvgate/health", timeout=1) as resp:
                return json.loads(resp.read()).get("digest")
        except (OSError, ValueError):
            return None

    def wait_ready(self, listen: str, timeout: float = 10) -> None:
        """Wait until ``GET http://<listen>/kvgate/health`` answers 200; raises :class:`NginxError`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._health_digest(listen) is not None:
                return
            if self.pid() is None and time.monotonic() > deadline - timeout + 1:
                break
            time.sleep(0.05)
        raise NginxError(f"gateway on {listen} is not answering:\n" + _emerg(self.error_log_tail()))


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
