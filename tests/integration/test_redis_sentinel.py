"""Shared state through Redis Sentinel (docs/sentinel.md): one master, one replica and three
sentinels, all real binaries on free ports; the master is killed (kill -9) and Sentinel promotes
the replica. The Python side (kvgate.redisconn, the control plane's Store) keeps what it wrote
(WAIT), and the real gateway keeps serving through the switch and then caches through the new
master.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import redis as redis_lib

from gwfixtures import Gateway, _start_gateway, _stop_all, _wait, free_port, make_policy
from kvgate import redisconn
from kvgate.control.store import Store
from kvgate.policy.model import RedisConfig

pytestmark = pytest.mark.integration

MASTER = "kvgate"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


@dataclass
class Proc:
    name: str
    port: int
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)


@dataclass
class SentinelSet:
    master: Proc
    replica: Proc
    sentinels: list[Proc]
    procs: list[Proc] = field(default_factory=list)

    @property
    def sentinel_addrs(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    @property
    def client_url(self) -> str:
        return f"redis+sentinel://{','.join(self.sentinel_addrs)}/{MASTER}/0"

    def redis_config(self) -> RedisConfig:
        return RedisConfig(url=f"redis://127.0.0.1:{self.master.port}/0", sentinels=self.sentinel_addrs,
                           master_name=MASTER, managed=False, timeout_ms=200)

    def master_port(self) -> int | None:
        """The master's port as the first answering sentinel names it."""
        for s in self.sentinels:
            try:
                addr = s.client().sentinel_get_master_addr_by_name(MASTER)
                return int(addr[1]) if addr else None
            except (redis_lib.RedisError, TypeError, ValueError):
                continue
        return None

    def wait_known(self) -> None:
        """Until every sentinel knows the replica and the two other sentinels (a failover needs both)."""

        def known() -> bool:
            for sn in self.sentinels:
                try:
                    m = sn.client().sentinel_master(MASTER)
                    if int(m["num-slaves"]) < 1 or int(m["num-other-sentinels"]) < 2:
                        return False
                except redis_lib.RedisError:
                    return False
            return True

        _wait(known, 20, "every sentinel to know the replica and the other sentinels")

    def stop(self) -> None:
        _stop_all(self.procs)


def _spawn(name: str, port: int, cmd: list[str], d: Path, procs: list[Proc]) -> Proc:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=d)
    p = Proc(name, port, proc)
    procs.append(p)
    return p


def _server_cmd(port: int, d: Path, *extra: str) -> list[str]:
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(d), "--logfile", str(d / f"redis-{port}.log"), *extra]


def start_sentinel_set(base: Path) -> SentinelSet:
    """1 master, 1 replica (``replicaof``), 3 sentinels (quorum 2, down-after 1 s), each sentinel with
    its own config file (Sentinel rewrites it); returns once the replica is linked. A failover
    needs :meth:`SentinelSet.wait_known` first (the sentinels find each other by hello messages,
    every 2 s: a test overlaps that wait with its other setup)."""
    d = base / "sentinel-set"
    d.mkdir()
    procs: list[Proc] = []
    try:
        mport, rport = free_port(), free_port()
        master = _spawn("master", mport, _server_cmd(mport, d), d, procs)
        replica = _spawn("replica", rport, _server_cmd(rport, d, "--replicaof", "127.0.0.1", str(mport)), d, procs)
        sentinels = []
        for i in range(3):
            sport = free_port()
            conf = d / f"sentinel-{sport}.conf"
            conf.write_text(
                f"port {sport}\nbind 127.0.0.1\ndir {d}\nlogfile {d / f'sentinel-{sport}.log'}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {mport} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            sentinels.append(_spawn(f"sentinel{i}", sport, ["redis-sentinel", str(conf)], d, procs))
        s = SentinelSet(master, replica, sentinels, procs)

        def linked() -> bool:
            try:
                info = replica.client().info("replication")
                return info.get("master_link_status") == "up"
            except redis_lib.RedisError:
                return False

        _wait(linked, 15, "the replica's link to the master")
        return s
    except BaseException:
        _stop_all(procs)
        raise


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    s = start_sentinel_set(tmp_path)
    yield s
    s.stop()


def test_policy_and_rendered_config_of_sentinels() -> None:
    """The policy's fields, its one connection string and the data path's rendered block (pure)."""
    from pydantic import ValidationError

    from kvgate.render import data_config

    plain = RedisConfig(url="redis://127.0.0.1:27001/3")
    assert plain.client_url == plain.url and plain.sentinels == [] and plain.master_name == "kvgate"
    cfg = RedisConfig(url="redis://127.0.0.1:27001/3", sentinels=["127.0.0.1:27011", "localhost:27012"],
                      master_name="m-1", sentinel_timeout_ms=100)
    assert cfg.client_url == "redis+sentinel://127.0.0.1:27011,localhost:27012/m-1/3"
    target = redisconn.parse(cfg.client_url)
    assert target.sentinels == [("127.0.0.1", 27011), ("localhost", 27012)] and target.db == 3
    assert redisconn.parse(plain.url) is None
    for bad in ({"sentinels": ["nohost"]}, {"sentinels": ["h:0"]}, {"sentinels": ["h:1", "h:1"]},
                {"master_name": "a b"}, {"master_name": ""}):
        with pytest.raises(ValidationError):
            RedisConfig(**bad)

    policy = make_policy([], None, pool={"nodes": [{"id": "n1", "url": "http://127.0.0.1:27002"}]})
    block = data_config(policy)["redis"]
    assert "sentinels" not in block and "master_name" not in block  # a plain Redis's config as before
    block = data_config(policy.model_copy(update={"redis": cfg}))["redis"]
    assert block["sentinels"] == [{"host": "127.0.0.1", "port": 27011}, {"host": "127.0.0.1", "port": 27012}]
    assert block["master_name"] == "m-1" and block["sentinel_timeout_ms"] == 100 and block["db"] == 3


def kill_master(s: SentinelSet) -> float:
    """kill -9 the master; returns time.monotonic() of the kill."""
    os.kill(s.master.proc.pid, signal.SIGKILL)
    s.master.proc.wait(5)
    return time.monotonic()


def wait_promoted(s: SentinelSet, timeout: float = 15) -> float:
    """Wait until the sentinels name the replica as the master; returns time.monotonic() then."""
    _wait(lambda: s.master_port() == s.replica.port, timeout, "the sentinels to promote the replica")
    return time.monotonic()


def test_python_side_follows_a_failover_and_keeps_acknowledged_writes(sentinel_set: SentinelSet) -> None:
    s = sentinel_set
    assert s.redis_config().client_url == s.client_url
    client = redisconn.from_url(s.client_url, socket_timeout=1, socket_connect_timeout=1)
    store = Store(s.client_url, timeout_s=1)
    for i in range(50):
        client.set(f"k{i}", str(i))
    assert redisconn.wait_replicas(client, 1, 1000) == 1
    store.put_nodes([{"id": f"n{i}", "state": "serving", "weight": i} for i in range(20)])
    store.put_node({"id": "drained", "state": "drained"})
    store.put_pool("default", {"degraded": False})
    v = store.add_version("version: 1\n", "digest-1", "test")
    assert store.unreplicated == 0

    s.wait_known()
    killed = kill_master(s)
    promoted = wait_promoted(s)
    failover_s = promoted - killed

    def reads_again() -> bool:
        try:
            return client.get("k0") == b"0"
        except redis_lib.RedisError:
            return False

    _wait(reads_again, 10, "the factory's client to read through the new master")
    assert [client.get(f"k{i}") for i in range(50)] == [str(i).encode() for i in range(50)]
    client.set("after", "1")  # a write: the new master, not a read-only replica
    assert s.replica.client().get("after") == b"1"

    store.BREAKER_S = 0.0  # (its breaker may have tripped on the kill)
    _wait(lambda: store.ping(), 10, "the store through the new master")
    nodes = store.nodes()
    assert len(nodes) == 21 and nodes["drained"]["state"] == "drained" and nodes["n7"]["weight"] == 7
    assert store.pools(["default"]) == {"default": {"degraded": False}}
    assert store.latest_version()["version"] == v["version"]
    print(f"python side: failover (kill -9 -> promoted) {failover_s:.2f} s")


def _cacheable(gw: Gateway, content: str):
    return gw.chat([{"role": "user", "content": content}], temperature=0, max_tokens=4)


def test_gateway_serves_through_a_master_kill_and_caches_through_the_new_master(
        sentinel_set: SentinelSet, start_sims, tmp_path: Path) -> None:
    s = sentinel_set
    sims = start_sims(2)
    policy = make_policy(sims, None)
    policy = policy.model_copy(update={"redis": s.redis_config()})
    gw = _start_gateway(tmp_path, policy, sims, None)
    try:
        first = _cacheable(gw, "warm the cache")
        assert first.status_code == 200 and first.headers["X-Kvgate-Cache"] == "MISS"
        _wait(lambda: _cacheable(gw, "warm the cache").headers["X-Kvgate-Cache"] == "HIT", 5, "a HIT via the master")
        s.wait_known()  # (mostly done while the simulators and nginx started)

        statuses: Counter = Counter()
        outcomes: Counter = Counter()
        errors: list[str] = []
        stop = threading.Event()

        def load(worker: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                # cached (one repeated prompt) and uncached (a new prompt each time) requests
                content = "warm the cache" if n % 2 else f"unique {worker}-{n}"
                try:
                    r = _cacheable(gw, content)
                    statuses[r.status_code] += 1
                    outcomes[r.headers.get("X-Kvgate-Cache", "-")] += 1
                except Exception as exc:  # noqa: BLE001 (a failed request is what is counted)
                    errors.append(repr(exc))
                time.sleep(0.01)

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        killed = kill_master(s)
        promoted = wait_promoted(s)

        # the new master serves: a response stored after the switch is a HIT, stored in the new master
        def new_master_hit() -> bool:
            r = _cacheable(gw, "after the failover")
            return r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "HIT"

        _wait(new_master_hit, 10, "a HIT through the new master")
        served = time.monotonic()
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(10)

        total = sum(statuses.values()) + len(errors)
        print(f"gateway: {total} requests under load, statuses {dict(statuses)}, cache {dict(outcomes)}, "
              f"errors {len(errors)}; kill -9 -> promoted {promoted - killed:.2f} s, "
              f"-> HIT via new master {served - killed:.2f} s")
        assert errors == [] and set(statuses) == {200}, (statuses, errors[:3])
        assert total > 50
        assert list(s.replica.client().scan_iter("kvgate:resp:*")), "no cache entry in the new master"
        assert gw.metric_sum("kvgate_redis_master_changes_total") == 1
        log = (gw.nginx.prefix / "logs" / "error.log").read_text()
        assert log.count("master kvgate moved from") == 1
    finally:
        gw.stop()


def test_stack_starts_and_stops_a_local_sentinel_set(tmp_path: Path) -> None:
    """``kvgate up``'s Redis step with ``redis.managed`` and ``redis.sentinels``: master, replica at
    PORT+1 and one redis-sentinel per address, each with a pid file ``down`` stops them by."""
    from kvgate.policy.loader import parse_policy
    from kvgate.stack import Stack

    mport = free_port()
    while not _free(mport + 1):  # the replica's port
        mport = free_port()
    sports = [free_port() for _ in range(3)]
    data = {"version": 1,
            "gateway": {"listen": f"127.0.0.1:{free_port()}", "internal_listen": f"127.0.0.1:{free_port()}"},
            "control": {"listen": f"127.0.0.1:{free_port()}"},
            "pools": [{"name": "default", "models": ["m"], "nodes": [{"id": "n1", "url": f"http://127.0.0.1:{free_port()}"}]}],
            "redis": {"url": f"redis://127.0.0.1:{mport}/0", "managed": True,
                      "sentinels": [f"127.0.0.1:{p}" for p in sports], "master_name": "local"}}
    policy = parse_policy(data, "sentinel-stack")
    stack = Stack(tmp_path / "run")
    for d in (stack.logs, stack.pids):  # (what `kvgate up` makes before its Redis step)
        d.mkdir(parents=True, exist_ok=True)
    try:
        assert stack.start_redis(policy) == "started"
        assert stack.sentinel_set_started == ["replica", *(f"sentinel-{p}" for p in sports)]
        names = ["redis", "redis-replica", *(f"sentinel-{p}" for p in sports)]
        assert all(stack._live_pid(n) for n in names)
        _wait(lambda: stack.redis_healthy(policy), 10, "the master through the local sentinels")
        client = redisconn.from_url(policy.redis.client_url, socket_timeout=1)
        client.set("x", "1")
        _wait(lambda: redisconn.wait_replicas(client, 1, 500) == 1, 10, "the replica to acknowledge")
        assert stack.start_redis(policy) == "running" and stack.sentinel_set_started == []
    finally:
        stack.down(echo=lambda *_: None)
    assert not any(stack._live_pid(n) for n in ["redis", "redis-replica", *(f"sentinel-{p}" for p in sports)])


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_control_plane_state_survives_a_master_kill(control_fleet) -> None:
    """The whole stack by `kvgate up` with a local Sentinel set: after a drain and a policy apply,
    the master is killed; the control plane's node states and applied versions are intact after
    the failover, and the gateway kept answering."""
    import requests

    from ctlfixtures import default_template

    sports = [free_port() for _ in range(3)]

    def template(fleet, **kw) -> str:
        text = default_template(fleet, **kw)
        plain = f'redis: {{url: "redis://127.0.0.1:{fleet.redis_port}/0"}}'
        assert plain in text
        sentinels = ", ".join(f'"127.0.0.1:{p}"' for p in sports)
        return text.replace(plain, f'redis: {{url: "redis://127.0.0.1:{fleet.redis_port}/0", '
                                   f'sentinels: [{sentinels}], master_name: kvgate}}')

    f = control_fleet(n=2, template=template)
    f.wait_reports()
    assert f.api("POST", "/api/v1/nodes/n2/drain").status_code == 202
    f.wait_state("n2", "drained")
    applied = f.kvgate("apply", str(f.write_policy(weights={"n1": 3})))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    versions = [v["version"] for v in f.api("GET", "/api/v1/policy/versions").json()["versions"]]
    assert len(versions) >= 2

    status = f.kvgate("status")
    assert "redis-replica" in status.stdout and all(f"sentinel-{p}" in status.stdout for p in sports), status.stdout

    master_pid = int((f.run_dir / "pids" / "redis.pid").read_text())
    os.kill(master_pid, signal.SIGKILL)
    t0 = time.monotonic()
    replica = redis_lib.Redis(host="127.0.0.1", port=f.redis_port + 1, socket_timeout=1)
    _wait(lambda: replica.info("replication")["role"] == "master", 15, "the replica's promotion")
    promoted_s = time.monotonic() - t0

    def answers() -> bool:
        try:
            r = f.api("GET", "/api/v1/nodes", timeout=5)
            return r.status_code == 200 and {n["id"]: n["state"] for n in r.json()["nodes"]}.get("n2") == "drained"
        except requests.RequestException:
            return False

    _wait(answers, 15, "the control plane through the new master")
    assert f.states() == {"n1": "active", "n2": "drained"}
    # what the store holds, read from the new master itself (the API's node view is in memory)
    new_master = Store(f"redis://127.0.0.1:{f.redis_port + 1}/0")
    assert {k: v["state"] for k, v in new_master.nodes().items()} == {"n1": "active", "n2": "drained"}
    assert [v["version"] for v in new_master.versions()] == versions
    body: dict = {}

    def versions_api() -> bool:  # (the control plane's store breaker may hold errors for 2 s)
        nonlocal body
        body = f.api("GET", "/api/v1/policy/versions").json()
        return "versions" in body

    _wait(versions_api, 10, "the control plane's versions through the new master")
    after = [v["version"] for v in body["versions"]]
    assert after == versions
    r = requests.post(f.gateway + "/v1/chat/completions", timeout=30,
                      json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    print(f"control plane: kill -9 -> promoted {promoted_s:.2f} s; states and {len(after)} versions intact")
