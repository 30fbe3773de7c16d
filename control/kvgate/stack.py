"""Run a whole kvgate stack as local processes: a private Redis, the engine simulators, the
control plane (which writes and starts nginx), one node agent per simulated engine and one
batch worker (``kvgate batch-worker``, when ``batch.enabled``).

Everything lives under one *run directory* (:mod:`kvgate.rundir`: ``state.json``, ``pids/``,
``logs/``, ``redis/``, ``nginx/``, the admin token).

The stack supervises processes; it never writes nginx config. The control plane is the only
writer (issue 10): ``up`` starts ``kvgate control --policy``, which renders the policy with the
node states kept in Redis and starts (or reloads) nginx, or, when a control plane of ours
already runs, applies the policy through its API. ``up`` is idempotent: a process that is
already running and healthy is left alone, stale pid files (process gone, or the pid reused by
another program) are removed, and a changed policy is applied through the control plane (a
new policy version; nginx reloads only for structural changes).
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
import requests
import urllib3

from .addr import split_host_port
from .nginxctl import Nginx, find_binary
from .render import render
from .policy import NodeConfig, Policy, PolicyError, load_policy
from .rundir import DEFAULT_RUN_DIR, RunDir, default_run_dir  # noqa: F401 (default_run_dir: re-export)


class StackError(RuntimeError):
    """A part of the stack could not be started or is unhealthy; the message says which and why."""


def _port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _gone(proc: psutil.Process, timeout: float) -> bool:
    """Wait until ``proc`` exited: gone, or a zombie its parent (init, for our daemons) has not
    reaped yet — it holds no port and no file any more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _exit_reason(log: Path, start: int, most: int = 4) -> str:
    """Why a process exited, from what it wrote to ``log`` after byte ``start``: from its last
    ``error: ...`` line on (kvgate's commands print one), else the last lines; repeated lines
    (nginx says the same bind() failure five times, with and without a timestamp) once."""
    try:
        with open(log, "rb") as fh:
            fh.seek(start)
            lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError as exc:
        return f"(its log is unreadable: {exc})"
    errors = [i for i, ln in enumerate(lines) if ln.startswith("error: ")]
    picked = lines[errors[-1]:] if errors else lines[-most:]
    out: list[str] = []
    seen: set[str] = set()
    for ln in picked:
        ln = ln.removeprefix("error: ")
        key = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d \[(\w+)\] \d+#\d+: ", r"nginx: [\1] ", ln)
        if key not in seen:
            seen.add(key)
            out.append(ln)
    text = ""
    for ln in out[:most]:
        text += ln if not text else (" " if text.endswith(":") else " | ") + ln
    return text or "(nothing in its log)"


@dataclass
class Component:
    """One line of ``kvgate status``."""

    name: str
    pid: int | None
    healthy: bool
    detail: str


class Stack:
    """The local processes of one policy under one run directory.

    Args:
        run_dir: where pid files, logs, the Redis dir and the nginx prefix live.
    """

    def __init__(self, run_dir: Path | None = None):
        self.dir = RunDir(run_dir)
        self.run_dir = self.dir.root
        self.pids = self.dir.pids
        self.logs = self.dir.logs
        self.nginx = Nginx(self.dir.nginx_prefix)

    # ----------------------------------------------------------------- lock
    @contextlib.contextmanager
    def locked(self, timeout: float = 120.0, echo=print) -> Iterator[None]:
        """Hold the run directory's lock: two ``up``/``down`` at once would start parts the
        other does not know about. Waits up to ``timeout`` s, then raises StackError."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir.lock_file, "a+") as fh:
            deadline = time.monotonic() + timeout
            told = False
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StackError(f"another kvgate up/down holds {self.dir.lock_file}; "
                                         f"gave up after {timeout:.0f}s") from None
                    if not told:
                        echo("waiting for another kvgate up/down on this run directory ...")
                        told = True
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # ---------------------------------------------------------------- state
    @property
    def state_file(self) -> Path:
        return self.dir.state_file

    @property
    def running_policy_file(self) -> Path:
        """A copy of the policy the stack runs (:attr:`kvgate.rundir.RunDir.running_policy_file`)."""
        return self.dir.running_policy_file

    def policy_path(self) -> Path | None:
        """The operator's policy file the running stack was started from, if any."""
        return self.dir.policy_path()

    def _running_listen(self) -> str | None:
        """The gateway address of the running stack's policy (None if unknown or invalid now)."""
        try:
            running = self.load_running_policy()
        except PolicyError:
            return None
        return running.gateway.listen if running else None

    def load_running_policy(self) -> Policy | None:
        """The policy the stack runs (its copy in the run directory), or None if none was started.

        Raises:
            PolicyError: the copy no longer validates (a newer kvgate with stricter rules).
        """
        return self.dir.load_running_policy()

    # ----------------------------------------------------------- pid files
    @property
    def token_file(self) -> Path:
        """The admin token of this run directory (mode 0600; created by the first ``up``)."""
        return self.dir.token_file

    def _pid_file(self, name: str) -> Path:
        return self.dir.pid_file(name)

    def _is_ours(self, name: str, proc: psutil.Process) -> bool:
        """Whether ``proc`` is the process ``name`` of this run directory — checked exactly, so
        a reused pid (an editor, a shell, a test run) is never signalled."""
        if name == "redis":
            # redis-server rewrites its title; its working directory (--dir) is ours alone
            return "redis-server" in proc.name() and Path(proc.cwd()) == self.dir.redis_dir
        if name == "redis-replica" or name.startswith("sentinel-"):
            # the local Sentinel set (start_redis): each runs in a folder of its own under redis/
            return "redis-" in proc.name() and Path(proc.cwd()) == self.dir.redis_dir / name
        if name.startswith("sim-"):
            return proc.cmdline()[1:6] == ["-m", "kvgate", "sim", "--node-id", name[4:]]
        if name == "control":
            return proc.cmdline()[1:6] == ["-m", "kvgate", "--run-dir", str(self.run_dir), "control"]
        if name.startswith("agent-"):
            cmd = proc.cmdline()
            return cmd[1:6] == ["-m", "kvgate", "agent", "--node-id", name[6:]] and str(self.token_file) in cmd
        if name in ("batch-worker", "semantic"):
            return proc.cmdline()[1:6] == ["-m", "kvgate", "--run-dir", str(self.run_dir), name]
        if name.startswith("gateway-"):
            return proc.cmdline()[1:8] == ["-m", "kvgate", "--run-dir", str(self.run_dir), "gateway", "--id", name[8:]]
        return False

    def _live_pid(self, name: str) -> int | None:
        """The pid recorded for ``name`` if that process still runs and is ours
        (:meth:`_is_ours`); a stale pid file is removed."""
        f = self._pid_file(name)
        try:
            pid = int(f.read_text().strip())
        except (OSError, ValueError):
            f.unlink(missing_ok=True)
            return None
        try:
            proc = psutil.Process(pid)
            alive = proc.status() != psutil.STATUS_ZOMBIE and self._is_ours(name, proc)
        except psutil.Error:
            alive = False
        if not alive:
            f.unlink(missing_ok=True)
            return None
        return pid

    def _cmdline(self, pid: int) -> list[str]:
        try:
            return psutil.Process(pid).cmdline()
        except psutil.Error:
            return []

    # --------------------------------------------------------------- redis
    def start_redis(self, policy: Policy) -> str:
        """Start the private redis-server (when ``redis.managed``) or keep the running one.

        Returns ``started``, ``running``, ``restarted`` (the policy moved it to another
        address) or ``external`` (``redis.managed: false``; a Redis we had started is stopped).
        """
        host, port = policy.redis.host, policy.redis.port
        pid = self._live_pid("redis")
        if not policy.redis.managed:
            self._stop_sentinel_set(keep=[])
            if pid:
                self._stop_pid("redis")
            return "external"
        if policy.redis.sentinels:
            # the replica and the sentinels are started (or kept) after the master, below
            result = self._start_master(policy, host, port, pid)
            return self._start_sentinel_set(policy, result)
        self._stop_sentinel_set(keep=[])
        return self._start_master(policy, host, port, pid)

    def _start_master(self, policy: Policy, host: str, port: int, pid: int | None) -> str:
        restarted = False
        if pid:
            if f"{host}:{port}" in " ".join(self._cmdline(pid)):
                return "running"
            self._stop_pid("redis")
            restarted = True
        if _port_open(host, port):
            raise StackError(f"redis: port {host}:{port} is already in use by another program "
                             f"(set redis.managed: false to use an existing Redis)")
        try:
            binary = find_binary("redis-server", "redis-server")
        except FileNotFoundError as exc:
            raise StackError(f"redis: {exc}") from None
        rdir = self.dir.redis_dir
        rdir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            [binary, "--bind", host, "--port", str(port), "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "everysec") if policy.redis.persist else ("--appendonly", "no")),
             "--daemonize", "yes", "--pidfile", str(self._pid_file("redis")),
             "--logfile", str(self.logs / "redis.log"), "--dir", str(rdir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        if res.returncode != 0:
            raise StackError(f"redis: redis-server exited with {res.returncode}: {res.stdout.strip()[-500:]} "
                             f"(see {self.logs / 'redis.log'})")
        # --daemonize returns before the daemon wrote its pid file; wait so `down` can find it.
        deadline = time.monotonic() + 5
        pid_file = self._pid_file("redis")
        while time.monotonic() < deadline:
            try:
                if pid_file.read_text().endswith("\n"):  # redis writes "<pid>\n" in one go
                    break
            except OSError:
                pass
            time.sleep(0.05)
        return "restarted" if restarted else "started"

    REPLICA_PORT_OFFSET = 1
    """The local Sentinel set's replica listens on the master's port + this (docs/sentinel.md)."""
    SENTINEL_DOWN_AFTER_MS = 1000
    SENTINEL_FAILOVER_TIMEOUT_MS = 5000

    def _daemon(self, name: str, cmd: list[str], log_name: str) -> None:
        """Run a daemonizing redis-server/redis-sentinel ``cmd`` and wait for its pid file."""
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            raise StackError(f"{name}: exited with {res.returncode}: {res.stdout.strip()[-500:]} "
                             f"(see {self.logs / log_name})")
        deadline = time.monotonic() + 5
        pid_file = self._pid_file(name)
        while time.monotonic() < deadline:
            try:
                if pid_file.read_text().endswith("\n"):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        # a daemonized redis writes its pid file once it listens: none means it exited (a port
        # that a connect() found closed but bind() found taken, e.g. by an outgoing connection)
        raise StackError(f"{name}: did not start: {_exit_reason(self.logs / log_name, 0)} "
                         f"(see {self.logs / log_name})")

    def _start_sentinel_set(self, policy: Policy, master_result: str) -> str:
        """With ``redis.sentinels`` (and ``managed``): one replica of the master at PORT+1 and one
        redis-sentinel per listed address (quorum 2, or 1 with a single sentinel; down-after
        SENTINEL_DOWN_AFTER_MS), each in ``redis/<name>/`` with its own config file (Sentinel
        rewrites it). A running one is kept; one no longer listed is stopped. Returns the
        master's result (as up() reads it); ``sentinel_set_started`` names the parts started."""
        host, port = policy.redis.host, policy.redis.port
        name = policy.redis.master_name
        started = []
        self.logs.mkdir(parents=True, exist_ok=True)
        rport = port + self.REPLICA_PORT_OFFSET
        if not self._live_pid("redis-replica"):
            if _port_open(host, rport):
                raise StackError(f"redis: the replica's port {host}:{rport} (redis.url's port + 1) is already in use")
            d = self.dir.redis_dir / "redis-replica"
            d.mkdir(parents=True, exist_ok=True)
            self._daemon("redis-replica", [
                find_binary("redis-server", "redis-server"), "--bind", host, "--port", str(rport), "--save", "",
                *(("--appendonly", "yes", "--appendfsync", "everysec") if policy.redis.persist
                  else ("--appendonly", "no")),
                "--replicaof", host, str(port),
                "--daemonize", "yes", "--pidfile", str(self._pid_file("redis-replica")),
                "--logfile", str(self.logs / "redis-replica.log"), "--dir", str(d)], "redis-replica.log")
            started.append("replica")
        wanted = []
        quorum = 1 if len(policy.redis.sentinels) == 1 else 2
        for addr in policy.redis.sentinels:
            shost, _, sport = addr.rpartition(":")
            sname = f"sentinel-{sport}"
            wanted.append(sname)
            if self._live_pid(sname):
                continue
            if _port_open(shost.strip("[]"), int(sport)):
                raise StackError(f"redis: sentinel port {addr} is already in use by another program")
            d = self.dir.redis_dir / sname
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            # written afresh at each start: a kept file would name the master of an earlier run
            conf.write_text(
                f"bind {shost.strip('[]')}\nport {sport}\ndir {d}\ndaemonize yes\n"
                f"pidfile {self._pid_file(sname)}\nlogfile {self.logs / (sname + '.log')}\n"
                f"sentinel monitor {name} {host} {port} {quorum}\n"
                f"sentinel down-after-milliseconds {name} {self.SENTINEL_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {name} {self.SENTINEL_FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {name} 1\n")
            self._daemon(sname, [find_binary("redis-sentinel", "redis-sentinel"), str(conf)], sname + ".log")
            started.append(sname)
        self._stop_sentinel_set(keep=["redis-replica", *wanted])
        self.sentinel_set_started = started
        return master_result

    def _stop_sentinel_set(self, keep: list[str]) -> None:
        """Stop the local Sentinel set's processes not in ``keep`` (sentinels first)."""
        if not self.pids.is_dir():
            return
        for f in sorted(self.pids.glob("sentinel-*.pid")) + [self._pid_file("redis-replica")]:
            if f.stem not in keep:
                self._stop_pid(f.stem)

    def redis_healthy(self, policy: Policy) -> bool:
        import redis

        from . import redisconn

        try:
            return bool(redisconn.from_url(policy.redis.client_url, socket_timeout=1, socket_connect_timeout=1).ping())
        except (redis.RedisError, ValueError):
            return False

    # ----------------------------------------------------------- simulators
    @staticmethod
    def sim_command(policy: Policy, node: NodeConfig) -> list[str]:
        """The ``kvgate sim`` command line for a ``simulate: true`` node."""
        sim = policy.simulator
        return [sys.executable, "-m", "kvgate", "sim", "--node-id", node.id, "--host", node.host,
                "--port", str(node.port), "--model", policy.pool_of_node(node.id).models[0],
                "--time-scale", str(sim.time_scale), "--prefill-s-per-token", str(sim.prefill_s_per_token),
                "--decode-s-per-token", str(sim.decode_s_per_token), "--max-num-seqs", str(sim.max_num_seqs),
                "--block-size", str(sim.block_size), "--num-gpu-blocks", str(sim.num_gpu_blocks),
                "--stream-interval", str(sim.stream_interval)]

    def start_sim(self, policy: Policy, node: NodeConfig) -> str:
        """Start the node's simulator, keep it if it runs with the same settings, or restart it
        when the policy changed them. Returns ``started``, ``running`` or ``restarted``."""
        def port_free() -> None:
            if _port_open(node.host, node.port):
                raise StackError(f"sim-{node.id}: port {node.address} is already in use by another program")

        return self._keep_or_spawn(f"sim-{node.id}", self.sim_command(policy, node), before_start=port_free)

    def _keep_or_spawn(self, name: str, cmd: list[str], before_start=None) -> str:
        """Keep process ``name`` if it runs with exactly ``cmd``'s arguments, else (re)start it
        in its own session with output to ``logs/<name>.log``. Returns ``running``,
        ``started`` or ``restarted``."""
        pid = self._live_pid(name)
        restarted = False
        if pid:
            # argv[0] may differ (a venv's python through a symlink); the arguments decide
            if self._cmdline(pid)[1:] == cmd[1:]:
                return "running"
            self._stop_pid(name)
            restarted = True
        if before_start:
            before_start()
        self._spawn(name, cmd)
        return "restarted" if restarted else "started"

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start ``cmd`` detached (own session), output to ``logs/<name>.log``, pid to ``pids/<name>.pid``."""
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, close_fds=True)
        self._pid_file(name).write_text(f"{proc.pid}\n")
        return proc

    @staticmethod
    def http_healthy(url: str) -> bool:
        """Whether ``url`` answers 200. An ``https://`` one is not verified: this asks a process the
        stack started whether it is up and sends no credential (the clients that send the admin
        token verify, docs/tls.md)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                return requests.get(url, timeout=1, verify=not url.startswith("https://")).status_code == 200
        except requests.RequestException:
            return False

    # ----------------------------------------------------------------- up
    def up(self, policy_path: Path, timeout: float = 30.0, echo=print, restore: bool = True) -> Policy:
        """Start (or reconcile) every component of the policy and wait until all are healthy.

        The policy is validated and its nginx config tested (``nginx -t`` on a staged copy:
        nothing of the running gateway is written) before any process is touched. nginx is
        then written and started by the control plane: a new ``kvgate control`` applies the
        policy at its start, a running one through ``PUT /api/v1/policy``. A failure later
        stops what this call started and, when ``restore``, reconciles back to the previous
        running policy (best effort: a warning is echoed if that fails too); the previous
        policy stays the running one.

        Raises:
            PolicyError: the policy file is invalid.
            StackError: a component did not start or did not become healthy within ``timeout`` s.
            NginxError: the rendered nginx config was rejected by ``nginx -t``.
        """
        policy = load_policy(policy_path)
        for d in (self.pids, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.nginx.test(render(policy, self.nginx.lua_dir))
        if not self.nginx.pid() or policy.gateway.listen != self._running_listen():
            if _port_open(*split_host_port(policy.gateway.listen)):
                raise StackError(f"gateway: {policy.gateway.listen} is already in use by another program")

        started: list[str] = []
        try:
            result = self.start_redis(policy)
            echo(f"redis     {result}")
            if result in ("started", "restarted"):
                started.append("redis")
            sims = [n for n in policy.nodes() if n.simulate]
            # the simulators of removed nodes stop only once the policy is applied: the control
            # plane refuses to remove a node that still has work, and its engine must keep serving
            self._per_node("sim", sims, lambda node: self.start_sim(policy, node), echo, started, stop_others=False)
            self._wait_healthy(policy, sims, timeout)
            # the control plane is nginx's only writer: the policy goes through it, rendered with
            # the node states in Redis (drained nodes stay down), tested, loaded, recorded as a version
            if self._control_keeps(policy):
                echo(f"control   {self.apply_via_control(policy_path, policy)}")
                self.nginx.wait_ready(policy.gateway.listen, timeout=timeout, tls=policy.gateway.tls is not None)
            else:
                nginx_before = self.nginx.pid()
                result = self.start_control(policy_path, policy, timeout)
                echo(f"control   {result}")
                if result in ("started", "restarted"):
                    started.append("control")
                self.nginx.wait_ready(policy.gateway.listen, timeout=timeout, tls=policy.gateway.tls is not None)
                echo(f"nginx     {'reloaded' if nginx_before else 'started'} by the control plane")
            self._stop_unlisted("sim", sims, echo)
            self.start_gateways(policy, timeout, echo, started)
            self._per_node("agent", sims, lambda node: self.start_agent(policy, node), echo, started)
            result = self.start_batch_worker(policy_path, policy)
            echo(f"batch-worker {result}")
            if result in ("started", "restarted"):
                started.append("batch-worker")
            result = self.start_semantic(policy_path, policy)
            echo(f"semantic  {result}")
            if result in ("started", "restarted"):
                started.append("semantic")
        except BaseException:
            # Leave nothing half-started behind: stop what this call started (and only that),
            # then bring back what the previous policy ran (parts this call replaced).
            for name in reversed(started):
                self._stop_pid(name)
            if restore and self.running_policy_file.exists():
                try:
                    self.up(self.running_policy_file, timeout=timeout, echo=lambda *_: None, restore=False)
                except Exception as exc:  # the original failure is what the caller must see
                    echo(f"warning: could not restore the previous policy: {exc}")
            raise
        self.dir.record_running(policy_path)
        return policy

    # -------------------------------------------------------- control plane
    def control_url(self, policy: Policy) -> str:
        """``http(s)://`` + the control plane's connect address (``https`` with ``control.tls``)."""
        from .control.https import base_url

        return base_url(policy.control)

    def control_command(self, policy_path: Path, policy: Policy) -> list[str]:
        """The ``kvgate control`` command line of this run directory."""
        return [sys.executable, "-m", "kvgate", "--run-dir", str(self.run_dir), "control",
                "--policy", str(Path(policy_path).resolve()), "--listen", policy.control.listen,
                "--redis-url", policy.redis.client_url,
                "--nginx-prefix", str(self.nginx.prefix), "--token-file", str(self.token_file)]

    def _control_keeps(self, policy: Policy) -> bool:
        """Whether a control plane of ours runs on the policy's address with the policy's Redis
        (then it stays, and the policy is applied through its API)."""
        pid = self._live_pid("control")
        if not pid:
            return False
        cmd = self._cmdline(pid)

        def arg(name: str) -> str | None:
            return cmd[cmd.index(name) + 1] if name in cmd[:-1] else None

        return arg("--listen") == policy.control.listen and arg("--redis-url") == policy.redis.client_url \
            and self.http_healthy(self.control_url(policy) + "/healthz")

    def apply_via_control(self, policy_path: Path, policy: Policy) -> str:
        from .control.client import ControlClient, ControlError
        from .control.token import read_token

        try:
            client = ControlClient(self.control_url(policy), read_token(self.token_file), timeout=120,
                                   verify=self._ca_args(policy)[-1] if self._ca_args(policy) else None)
            res = client.apply(Path(policy_path).read_text(encoding="utf-8"), source=f"kvgate up {policy_path}",
                               files_base=str(Path(policy_path).resolve().parent))
        except (ControlError, OSError, ValueError) as exc:
            raise StackError(f"control: applying the policy failed: {exc}") from None
        return (f"applied policy version {res['version']} (nginx {res['result']})" if res["changed"]
                else f"running (policy version {res['version']})")

    def start_control(self, policy_path: Path, policy: Policy, timeout: float) -> str:
        """Start ``kvgate control`` (restarting one on another address) and wait for ``/healthz``:
        it answers once the policy is applied and nginx runs with it. Returns ``started`` or
        ``restarted``. Raises StackError with the end of the control plane's log when it exits
        (an invalid policy, nginx refusing the config, a busy gateway port, Redis down)."""
        from .control.token import ensure_token

        ensure_token(self.token_file)
        restarted = bool(self._live_pid("control"))
        if restarted:
            self._stop_pid("control")
        if _port_open(*split_host_port(self.control_url(policy).split("://", 1)[1])):
            raise StackError(f"control: {policy.control.listen} is already in use by another program")
        log = self.dir.log_file("control")
        log_start = log.stat().st_size if log.exists() else 0
        proc = self._spawn("control", self.control_command(policy_path, policy))
        deadline = time.monotonic() + timeout
        while not self.http_healthy(self.control_url(policy) + "/healthz"):
            if proc.poll() is not None:
                self._pid_file("control").unlink(missing_ok=True)
                raise StackError(f"control plane exited at start: {_exit_reason(log, log_start)} (see {log})")
            if time.monotonic() > deadline:
                raise StackError(f"control plane not healthy after {timeout:.0f}s (see {self.logs / 'control.log'})")
            time.sleep(0.1)
        return "restarted" if restarted else "started"

    # ------------------------------------------------------ gateway members
    def gateway_prefix(self, member_id: str) -> Path:
        """The nginx prefix of a gateway member beyond the first (docs/scale-out.md)."""
        return self.run_dir / "gateways" / member_id / "nginx"

    def gateway_command(self, policy: Policy, member_id: str) -> list[str]:
        """The ``kvgate gateway`` supervisor command line of a member beyond the first."""
        return [sys.executable, "-m", "kvgate", "--run-dir", str(self.run_dir), "gateway", "--id", member_id,
                "--control", self.control_url(policy), "--token-file", str(self.token_file),
                "--prefix", str(self.gateway_prefix(member_id)), *self._ca_args(policy)]

    def start_gateways(self, policy: Policy, timeout: float, echo, started: list[str]) -> None:
        """Start (or keep) one ``kvgate gateway`` supervisor per member beyond the first, stop those of
        members no longer listed, and wait until each member's nginx answers ``/kvgate/health``
        (its supervisor starts it with the control plane's current version). Raises StackError."""
        members = policy.gateway_members()[1:]
        for m in members:
            name = f"gateway-{m.id}"

            def port_free(m=m) -> None:
                if _port_open(*split_host_port(m.listen)):
                    raise StackError(f"{name}: {m.listen} is already in use by another program")

            result = self._keep_or_spawn(name, self.gateway_command(policy, m.id), before_start=port_free)
            echo(f"{name:<9} {result}")
            if result in ("started", "restarted"):
                started.append(name)
        wanted = {f"gateway-{m.id}" for m in members}
        for f in sorted(self.pids.glob("gateway-*.pid")):
            if f.stem not in wanted and self._stop_pid(f.stem, timeout=15):
                echo(f"{f.stem:<9} stopped (no longer in the policy)")
        deadline = time.monotonic() + timeout
        scheme = "https" if policy.gateway.tls else "http"
        for m in members:
            while not self.http_healthy(f"{scheme}://{m.listen}/kvgate/health"):
                if not self._live_pid(f"gateway-{m.id}"):
                    log = self.logs / f"gateway-{m.id}.log"
                    raise StackError(f"gateway-{m.id} exited at start: {_exit_reason(log, 0)} (see {log})")
                if time.monotonic() > deadline:
                    raise StackError(f"gateway-{m.id}: {m.listen} not answering after {timeout:.0f}s "
                                     f"(see {self.logs / f'gateway-{m.id}.log'})")
                time.sleep(0.1)

    def agent_command(self, policy: Policy, node: NodeConfig) -> list[str]:
        """The ``kvgate agent`` command line for a simulated node."""
        return [sys.executable, "-m", "kvgate", "agent", "--node-id", node.id, "--engine-url", node.url,
                "--control-url", self.control_url(policy), "--token-file", str(self.token_file),
                *self._ca_args(policy)]

    @staticmethod
    def _ca_args(policy: Policy) -> list[str]:
        """``--ca-file FILE`` for a client of an HTTPS control plane (docs/tls.md), else nothing."""
        from .control.https import client_verify

        verify = client_verify(policy.control) if policy.control.tls is not None else True
        return ["--ca-file", verify] if isinstance(verify, str) else []

    def start_agent(self, policy: Policy, node: NodeConfig) -> str:
        """Start the node agent of a simulated node (restart it when its arguments changed).
        Returns ``started``, ``running`` or ``restarted``."""
        return self._keep_or_spawn(f"agent-{node.id}", self.agent_command(policy, node))

    def batch_worker_command(self, policy_path: Path, policy: Policy | None = None) -> list[str]:
        """The ``kvgate batch-worker`` command line of this run directory (it re-reads the
        policy file when it changes; ``--metrics-listen`` from ``batch.metrics_listen``)."""
        cmd = [sys.executable, "-m", "kvgate", "--run-dir", str(self.run_dir), "batch-worker",
               "--policy", str(Path(policy_path).resolve()), "--token-file", str(self.token_file)]
        if policy is not None and policy.batch.metrics_listen:
            cmd += ["--metrics-listen", policy.batch.metrics_listen]
        return cmd

    def start_batch_worker(self, policy_path: Path, policy: Policy) -> str:
        """Start (or keep) one batch worker when ``batch.enabled``, else stop a running one.
        Returns ``started``, ``running``, ``restarted``, ``stopped`` or ``disabled``."""
        if not policy.batch.enabled:
            return "stopped" if self._stop_pid("batch-worker") else "disabled"
        return self._keep_or_spawn("batch-worker", self.batch_worker_command(policy_path, policy))

    def start_semantic(self, policy_path: Path, policy: Policy) -> str:
        """Start (or keep) the semantic service (``kvgate semantic``) when a pool turns the
        semantic cache on or names static answers, else stop a running one. It re-reads the
        policy file (static answers) when it changes. Returns ``started``, ``running``,
        ``restarted``, ``stopped`` or ``disabled``."""
        if not any(p.semantic.enabled or p.semantic.static_answers for p in policy.pools):
            return "stopped" if self._stop_pid("semantic") else "disabled"
        cmd = [sys.executable, "-m", "kvgate", "--run-dir", str(self.run_dir), "semantic",
               "--policy", str(Path(policy_path).resolve())]
        return self._keep_or_spawn("semantic", cmd)

    def _per_node(self, kind: str, nodes: list[NodeConfig], start, echo, started: list[str],
                  stop_others: bool = True) -> None:
        """Start (or keep) one ``<kind>-<node>`` process per node with ``start(node)``, note the
        ones started in ``started``, and (``stop_others``) stop the ``<kind>-*`` processes of nodes
        not listed."""
        for node in nodes:
            result = start(node)
            echo(f"{f'{kind}-{node.id}':<9} {result}")
            if result in ("started", "restarted"):
                started.append(f"{kind}-{node.id}")
        if stop_others:
            self._stop_unlisted(kind, nodes, echo)

    def _stop_unlisted(self, kind: str, nodes: list[NodeConfig], echo) -> None:
        """Stop the ``<kind>-*`` processes of nodes not in ``nodes``."""
        wanted = {f"{kind}-{n.id}" for n in nodes}
        for f in sorted(self.pids.glob(f"{kind}-*.pid")):
            if f.stem not in wanted and self._stop_pid(f.stem):
                echo(f"{f.stem:<9} stopped (no longer in the policy)")

    def _wait_healthy(self, policy: Policy, sims: list[NodeConfig], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {f"sim-{n.id}": f"{n.url}/health" for n in sims}
        while True:
            pending = {k: u for k, u in pending.items() if not self.http_healthy(u)}
            redis_ok = self.redis_healthy(policy)
            if not pending and redis_ok:
                return
            for name in pending:
                if not self._live_pid(name):
                    raise StackError(f"{name} exited at start; see {self.logs / (name + '.log')}")
            if time.monotonic() > deadline:
                what = ", ".join(sorted(pending)) or f"redis at {policy.redis.url}"
                raise StackError(f"not healthy after {timeout:.0f}s: {what} (logs in {self.logs})")
            time.sleep(0.2)

    # --------------------------------------------------------------- down
    def _stop_pid(self, name: str, timeout: float = 10.0) -> bool:
        """SIGTERM the process ``name`` (if it runs and is ours), SIGKILL it after ``timeout`` s."""
        pid = self._live_pid(name)
        if not pid:
            return False
        try:
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            if not _gone(proc, timeout):
                proc.kill()
                _gone(proc, 5)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as exc:
            raise StackError(f"{name}: could not stop pid {pid}: {exc}") from None
        self._pid_file(name).unlink(missing_ok=True)
        return True

    def down(self, echo=print) -> None:
        """Stop the agents, the control plane, nginx, the simulators and Redis of this run
        directory (whatever is running). The control plane goes first, so it does not eject
        nodes whose engines are being stopped."""
        if self.pids.is_dir():
            # the batch worker first: lines it sent to a stopping gateway would only be retried
            first = [self._pid_file("batch-worker"), self._pid_file("control")]
            for f in first + sorted(self.pids.glob("agent-*.pid")):
                if f.exists() and self._stop_pid(f.stem):
                    echo(f"{f.stem:<9} stopped")
        if self.nginx.pid():
            self.nginx.stop()
            echo("nginx     stopped")
        self.dir.clear_running()
        if self.pids.is_dir():
            # sentinels before the servers they watch (else they start a failover during the stop)
            for f in sorted(self.pids.glob("sentinel-*.pid")) + sorted(self.pids.glob("*.pid")):
                name = f.stem
                if self._stop_pid(name):
                    echo(f"{name:<9} stopped")
                else:
                    f.unlink(missing_ok=True)

    # ------------------------------------------------------------- status
    def status(self) -> list[Component]:
        """What runs under this run directory and whether each part answers its health check."""
        policy = self.load_running_policy()
        out: list[Component] = []
        if policy is None:
            return out
        if policy.redis.managed:
            pid = self._live_pid("redis")
            out.append(Component("redis", pid, self.redis_healthy(policy), policy.redis.url))
            if policy.redis.sentinels:
                rpid = self._live_pid("redis-replica")
                out.append(Component("redis-replica", rpid, rpid is not None,
                                     f"replica on port {policy.redis.port + self.REPLICA_PORT_OFFSET}"))
                for addr in policy.redis.sentinels:
                    spid = self._live_pid(f"sentinel-{addr.rpartition(':')[2]}")
                    out.append(Component(f"sentinel-{addr.rpartition(':')[2]}", spid, spid is not None,
                                         f"{addr} (monitors {policy.redis.master_name})"))
        else:
            out.append(Component("redis", None, self.redis_healthy(policy), f"{policy.redis.url} (external)"))
        for node in policy.nodes():
            pid = self._live_pid(f"sim-{node.id}") if node.simulate else None
            kind = "sim" if node.simulate else "node"
            out.append(Component(f"{kind}-{node.id}", pid, self.http_healthy(f"{node.url}/health"), node.url))
        listen = policy.gateway.listen
        scheme = "https" if policy.gateway.tls else "http"
        out.append(Component("nginx", self.nginx.pid(),
                             self.http_healthy(f"{scheme}://{listen}/kvgate/health"), f"{scheme}://{listen}"))
        scheme = "https" if policy.gateway.tls else "http"
        for m in policy.gateway_members()[1:]:
            pid = self._live_pid(f"gateway-{m.id}")
            out.append(Component(f"gateway-{m.id}", pid, self.http_healthy(f"{scheme}://{m.listen}/kvgate/health"),
                                 f"{scheme}://{m.listen}  (supervisor; nginx in {self.gateway_prefix(m.id)})"))
        control = self.control_url(policy)
        out.append(Component("control", self._live_pid("control"), self.http_healthy(control + "/healthz"),
                             f"{control}  (admin token: kvgate token)"))
        for node in policy.nodes():
            if node.simulate:
                pid = self._live_pid(f"agent-{node.id}")
                out.append(Component(f"agent-{node.id}", pid, pid is not None, f"reports {node.id} to {control}"))
        if policy.batch.enabled:
            pid = self._live_pid("batch-worker")
            out.append(Component("batch-worker", pid, pid is not None, f"runs batch lines through {scheme}://{listen}"))
        if any(p.semantic.enabled or p.semantic.static_answers for p in policy.pools):
            pid = self._live_pid("semantic")
            where = policy.semantic_service.listen or f"unix:{self.run_dir / 'semantic.sock'}"
            out.append(Component("semantic", pid, pid is not None, f"semantic cache and static answers on {where}"))
        return out
