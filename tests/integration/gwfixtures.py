"""Reusable integration fixtures: real redis-server, real engine simulators
(``kvgate sim`` subprocesses) and the real gateway (nginx + Lua), each on a free
port in a temp folder, all stopped at teardown.

``fleet`` (module scope) is the shared setup: 3 simulators, one Redis and a
gateway with ``debug_headers`` on; tests flush Redis through ``fleet_clean``.
Tests that break things (kill a node, stop Redis) build their own with the
factories ``start_sims``, ``start_redis`` and ``start_gateway``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis as redis_lib
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvgate.nginxctl import Nginx
from kvgate.policy.loader import parse_policy
from kvgate.policy.model import Policy
from kvgate.render import default_lua_dir

pytestmark = pytest.mark.integration

MODEL = "m"

if not all(shutil.which(b) or shutil.which(b, path="/usr/sbin:/usr/bin") for b in ("nginx", "redis-server")):  # pragma: no cover
    pytest.exit("integration tests need nginx (with libnginx-mod-http-lua) and redis-server: run `make setup`", 2)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback TCP port never handed out before in this process: the kernel may give a
    just-released ephemeral port again, and two roles of one fleet on one port break its policy
    (a fresh-clone run saw "pools[0].nodes[1].url: ... is also gateway.listen")."""
    while True:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def kvgate_cli(run_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real ``kvgate`` CLI (``python -m kvgate --run-dir RUN_DIR ...``) as a user would."""
    return subprocess.run([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout)


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def _stop_all(items: list[Any]) -> None:
    """``stop()`` each of ``items`` (last started first); one failing stop does not leak the others."""
    with ExitStack() as stack:
        for item in items:
            stack.callback(item.stop)


# --------------------------------------------------------------------------- Redis
@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen
    dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis(host="127.0.0.1", port=self.port, db=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _start_redis(base: Path) -> RedisServer:
    port = free_port()
    d = base / f"redis-{port}"
    d.mkdir(parents=True)
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(d), "--logfile", str(d / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = RedisServer(port, proc, d)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on {port} exited with {proc.returncode}; see {d / 'redis.log'}")
        try:
            with redis_lib.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=1) as c:
                return bool(c.ping())
        except redis_lib.RedisError:
            return False

    try:
        _wait(ready, 10, f"redis-server on {port}")
    except BaseException:
        server.stop()  # not returned to any fixture: nobody else would stop it
        raise
    return server


# --------------------------------------------------------------------------- simulators
@dataclass
class Sim:
    node_id: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def metrics(self) -> dict[str, float]:
        """Sample name → value summed over labels (e.g. ``vllm:prompt_tokens_total``)."""
        text = requests.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out


SIM_ARGS = [
    # 10 ms per output token, near-free prefill: streams are visible, tests stay fast
    "--time-scale", "0.5", "--decode-s-per-token", "0.02", "--prefill-s-per-token", "0.00001",
    "--default-max-tokens", "4",
]


def _start_sims(n: int, base: Path, prefix: str = "n", extra_args: tuple[str, ...] = ()) -> list[Sim]:
    """Start ``n`` simulators (``SIM_ARGS`` + ``extra_args``) and wait until all answer; if any
    fails, stop the others and raise."""
    sims: list[Sim] = []

    def ready(sim: Sim) -> bool:
        if not sim.alive():
            raise RuntimeError(f"simulator {sim.node_id} exited; see {base}")
        try:
            return requests.get(sim.url + "/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    try:
        for i in range(n):
            port = free_port()
            node_id = f"{prefix}{i + 1}"
            # the child gets its own copy of the fd: ours is closed as soon as it has started
            with open(base / f"sim-{node_id}-{port}.log", "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from kvgate.sim.cli import sim_command; sim_command()",
                     "--port", str(port), "--node-id", node_id, "--model", MODEL, *SIM_ARGS, *extra_args],
                    stdout=log, stderr=subprocess.STDOUT,
                )
            sims.append(Sim(node_id, port, proc))  # recorded before any wait, so a failure stops it
        for sim in sims:
            _wait(lambda: ready(sim), 20, f"simulator {sim.node_id}")
    except BaseException:
        _stop_all(sims)  # the caller never sees these: stop them here
        raise
    return sims


def sims_total(sims: list[Sim], name: str) -> float:
    return sum(s.metrics().get(name, 0.0) for s in sims if s.alive())


# --------------------------------------------------------------------------- gateway
@dataclass
class Gateway:
    nginx: Nginx
    policy: Policy
    sims: list[Sim]
    redis: RedisServer | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def listen(self) -> str:
        return self.policy.gateway.listen

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def chat(self, messages: list[dict] | str, *, headers: dict | None = None, **params: Any) -> requests.Response:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"model": MODEL, "messages": messages, **params}
        return requests.post(self.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)

    def metrics(self) -> dict[str, float]:
        """``name{sorted labels}`` → value, parsed with prometheus_client (proves it parses); from
        the internal listener (the client listener serves /metrics only with auth off)."""
        text = requests.get(f"http://{self.policy.gateway.internal_listen}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def metric_sum(self, name: str, **labels: str) -> float:
        total = 0.0
        for key, value in self.metrics().items():
            if not key.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total

    def wait_metric(self, name: str, expected: float, timeout: float = 5.0, **labels: str) -> float:
        """``metric_sum(name, **labels)`` once it reaches ``expected`` (asserted equal).

        Counters of the log phase are written after the client has its response, possibly
        by another worker than the one answering ``/metrics``: read right away, the last
        request may not be counted yet. Raises AssertionError with the last value after
        ``timeout`` seconds or when the value passes ``expected``."""
        deadline = time.monotonic() + timeout
        while (value := self.metric_sum(name, **labels)) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert value == expected, f"{name}{labels} = {value}, expected {expected}"
        return value

    def stop(self) -> None:
        self.nginx.stop(timeout=5)


def make_policy(sims: list[Sim], redis: RedisServer | None, *, balancer: str = "chash",
                gateway: dict | None = None, cache: dict | None = None, pool: dict | None = None,
                top: dict | None = None) -> Policy:
    """The test policy over ``sims``; ``gateway``/``cache``/``pool`` update those sections, ``top``
    adds top-level sections (e.g. ``semantic_service``)."""
    # internal_listen: a free port too, so gateways of tests running at once never collide
    gw = {"listen": f"127.0.0.1:{free_port()}", "internal_listen": f"127.0.0.1:{free_port()}",
          "worker_processes": 2, "debug_headers": True,
          "connect_timeout_s": 0.5, "read_timeout_s": 30, "max_body_bytes": 65536,
          "worker_shutdown_timeout_s": 40}
    gw.update(gateway or {})
    p = {"name": "default", "models": [MODEL], "balancer": balancer,
         "nodes": [{"id": s.node_id, "url": s.url} for s in sims]}
    p.update(pool or {})
    data = {"version": 1, "gateway": gw, "cache": cache or {}, "pools": [p], **(top or {})}
    data["redis"] = {"url": redis.url if redis else f"redis://127.0.0.1:{free_port()}/0", "timeout_ms": 200,
                     "managed": False}
    return parse_policy(data, "test-policy")


def private_dir(base: Path, name: str) -> Path:
    """A folder only root can enter, like a repo in a 0700 home: workers (nobody) cannot read it."""
    d = base / name
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    return d


def _start_gateway(base: Path, policy: Policy, sims: list[Sim], redis: RedisServer | None,
                   batch_secret: str = "") -> Gateway:
    private = private_dir(base, f"private-{policy.gateway.listen.rsplit(':', 1)[1]}")
    # the Lua modules too live where workers cannot read them: they must be loaded in init
    lua_dir = private / "lua"
    shutil.copytree(default_lua_dir(), lua_dir)
    nginx = Nginx(private / "prefix", lua_dir=lua_dir, batch_secret=batch_secret)
    try:
        assert nginx.apply(policy) == "started"
        nginx.wait_ready(policy.gateway.listen)
    except BaseException:
        nginx.stop(timeout=5)  # a no-op when it never started
        raise
    return Gateway(nginx, policy, sims, redis)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def factory() -> RedisServer:
        server = _start_redis(tmp_path)
        started.append(server)
        return server

    yield factory
    _stop_all(started)


@pytest.fixture
def start_sims(tmp_path: Path) -> Iterator[Callable[..., list[Sim]]]:
    started: list[Sim] = []

    def factory(n: int = 3, prefix: str = "n") -> list[Sim]:
        sims = _start_sims(n, tmp_path, prefix)
        started.extend(sims)
        return sims

    yield factory
    _stop_all(started)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def factory(sims: list[Sim], redis: RedisServer | None, *, batch_secret: str = "", **policy_kw: Any) -> Gateway:
        """A gateway over ``sims``; ``batch_secret``: kvgate.json's (the X-Kvgate-Batch key)."""
        gw = _start_gateway(tmp_path, make_policy(sims, redis, **policy_kw), sims, redis, batch_secret)
        started.append(gw)
        return gw

    yield factory
    _stop_all(started)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """3 simulators + Redis + gateway (chash, debug headers), shared by a test module."""
    base = tmp_path_factory.mktemp("fleet")
    # each part is registered for teardown as soon as it is up (stopped in reverse order);
    # a part that fails to start stops itself, so a failed setup leaks nothing
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(3, base)
        stack.callback(_stop_all, sims)
        gw = _start_gateway(base, make_policy(sims, redis), sims, redis)
        stack.callback(gw.stop)
        yield gw


@pytest.fixture
def fleet_clean(fleet: Gateway) -> Gateway:
    """The shared fleet with an empty response cache."""
    assert fleet.redis is not None
    fleet.redis.client().flushdb()
    return fleet


def wait_cached(gw: Gateway, count: int = 1, timeout: float = 3.0) -> list[bytes]:
    """Wait until Redis holds ``count`` response-cache entries (they are written from a timer)."""
    assert gw.redis is not None
    client = gw.redis.client()
    keys: list[bytes] = []

    def enough() -> bool:
        nonlocal keys
        keys = list(client.scan_iter("kvgate:resp:*"))
        return len(keys) >= count

    _wait(enough, timeout, f"{count} cache entries")
    return keys
