"""`kvgate up / down / status` as a user meets them: busy ports, stale pid files, changed
policies, failed updates, concurrent runs (real redis-server, simulators and nginx)."""

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import requests

from gwfixtures import free_port
from gwfixtures import kvgate_cli as kvgate

pytestmark = pytest.mark.integration


@dataclass
class OneNode:
    """Free ports for a one-node stack, its policy file and its run directory."""

    gw: int
    rd: int
    node: int
    policy: Path
    run_dir: Path
    control: int = 0
    internal: int = field(default_factory=free_port)

    def write(self, path: Path, *, gw: int | None = None, rd: int | None = None, time_scale: str = "0.01",
              extra_node: str = "") -> Path:
        path.write_text(f"""
gateway: {{listen: "127.0.0.1:{gw or self.gw}", internal_listen: "127.0.0.1:{self.internal}"}}
redis: {{url: "redis://127.0.0.1:{rd or self.rd}/0"}}
control: {{listen: "127.0.0.1:{self.control}"}}
pools:
  - name: p
    models: [m]
    nodes: [{{id: a, url: "http://127.0.0.1:{self.node}", simulate: true}}{extra_node}]
simulator: {{model: m, time_scale: {time_scale}}}
""")
        return path

    def up(self, policy: Path | None = None):
        return kvgate(self.run_dir, "up", str(policy or self.policy))


@pytest.fixture
def one_node(tmp_path):
    stack = OneNode(free_port(), free_port(), free_port(), tmp_path / "p.yaml", tmp_path / "run", free_port())
    stack.write(stack.policy)
    yield stack
    kvgate(stack.run_dir, "down")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_busy_port_is_reported_and_nothing_is_left_running(one_node):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", one_node.node))
        squatter.listen()
        proc = one_node.up()
    assert proc.returncode == 1
    assert f"sim-a: port 127.0.0.1:{one_node.node} is already in use by another program" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the Redis this call had started is stopped again
    assert not list((one_node.run_dir / "pids").glob("*.pid"))
    assert kvgate(one_node.run_dir, "status").returncode == 1


def test_stale_pid_files_are_cleaned(one_node):
    pids = one_node.run_dir / "pids"
    pids.mkdir(parents=True)
    # a pid that exists but is not ours (this test process) and one that does not exist
    (pids / "sim-a.pid").write_text(f"{os.getpid()}\n")
    (pids / "redis.pid").write_text("999999999\n")
    proc = one_node.up()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sim-a     started" in proc.stdout and "redis     started" in proc.stdout
    assert int((pids / "sim-a.pid").read_text()) != os.getpid()
    assert kvgate(one_node.run_dir, "status").returncode == 0
    down = kvgate(one_node.run_dir, "down")
    assert "sim-a     stopped" in down.stdout
    assert not list(pids.glob("*.pid"))


def test_status_with_nothing_running(tmp_path):
    proc = kvgate(tmp_path / "run", "status")
    assert proc.returncode == 1
    assert "nothing runs under" in proc.stdout


def test_changed_policy_restarts_only_what_changed(one_node):
    assert one_node.up().returncode == 0
    sim_pid = (one_node.run_dir / "pids" / "sim-a.pid").read_text()

    one_node.write(one_node.policy, time_scale="0.02")
    out = one_node.up()
    assert out.returncode == 0, out.stderr
    assert "sim-a     restarted" in out.stdout and "redis     running" in out.stdout
    assert (one_node.run_dir / "pids" / "sim-a.pid").read_text() != sim_pid

    old_redis = one_node.rd
    one_node.write(one_node.policy, time_scale="0.02", rd=free_port())
    out = one_node.up()
    assert out.returncode == 0, out.stderr
    assert "redis     restarted" in out.stdout and "sim-a     running" in out.stdout
    assert not listening(old_redis)
    assert kvgate(one_node.run_dir, "status").returncode == 0


def test_failed_up_keeps_the_running_policy(one_node, tmp_path):
    assert one_node.up().returncode == 0
    # a policy nginx cannot serve: its listen address is taken by another program
    busy = free_port()
    bad = one_node.write(tmp_path / "bad.yaml", gw=busy)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", busy))
        squatter.listen()
        out = one_node.up(bad)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    st = kvgate(one_node.run_dir, "status")
    assert st.returncode == 0, st.stdout
    assert f"http://127.0.0.1:{one_node.gw}" in st.stdout
    assert requests.get(f"http://127.0.0.1:{one_node.gw}/kvgate/health", timeout=2).status_code == 200


def test_failed_up_restores_what_it_replaced(one_node, tmp_path):
    assert one_node.up().returncode == 0
    # sim-a gets new settings (so it is restarted), then sim-b cannot start: busy port
    busy = free_port()
    bad = one_node.write(tmp_path / "bad.yaml", time_scale="0.02",
                         extra_node=f', {{id: b, url: "http://127.0.0.1:{busy}", simulate: true}}')
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", busy))
        squatter.listen()
        out = one_node.up(bad)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "sim-a     restarted" in out.stdout
    assert f"sim-b: port 127.0.0.1:{busy} is already in use" in out.stderr
    st = kvgate(one_node.run_dir, "status")
    assert st.returncode == 0, st.stdout
    pid = int((one_node.run_dir / "pids" / "sim-a.pid").read_text())
    cmd = psutil.Process(pid).cmdline()
    assert cmd[cmd.index("--time-scale") + 1] == "0.01"


def test_down_never_signals_a_process_that_only_looks_like_ours(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "pids").mkdir(parents=True)
    # a stranger whose command line mentions kvgate, sim and the node id
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "kvgate", "sim", "--node-id", "a"])
    try:
        (run_dir / "pids" / "sim-a.pid").write_text(f"{stranger.pid}\n")
        (run_dir / "pids" / "redis.pid").write_text(f"{stranger.pid}\n")
        out = kvgate(run_dir, "down")
        assert out.returncode == 0
        assert stranger.poll() is None, "down killed a process that was not ours"
        assert not list((run_dir / "pids").glob("*.pid"))
    finally:
        stranger.kill()
        stranger.wait()


def test_concurrent_ups_are_serialised(one_node, tmp_path):
    assert one_node.up().returncode == 0
    policies = [one_node.write(tmp_path / f"p{s}.yaml", time_scale=s) for s in ("0.02", "0.03")]
    procs = [subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(one_node.run_dir), "up", str(p)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in policies]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert kvgate(one_node.run_dir, "status", "--json").returncode == 0
    assert kvgate(one_node.run_dir, "down").returncode == 0
    # everything the three `up`s started is stopped: the node's port is free again
    assert not listening(one_node.node)


def test_a_closed_stdout_does_not_abort_up_or_down(one_node):
    """`kvgate down | head -1` must still stop everything (the pipe closes after one line)."""
    for command in ("up", "down"):
        args = [sys.executable, "-m", "kvgate", "--run-dir", str(one_node.run_dir), command]
        if command == "up":
            args.append(str(one_node.policy))
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.readline()
        proc.stdout.close()  # the reader goes away, as `head -1` does
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert b"Traceback" not in err
        if command == "up":
            assert kvgate(one_node.run_dir, "status").returncode == 0
    assert not listening(one_node.node) and not listening(one_node.gw)


def test_up_leaves_nginx_to_the_control_plane(one_node):
    """`kvgate up` writes no nginx config itself: the control plane renders and starts it."""
    out = one_node.up()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "control   started" in lines and "nginx     started by the control plane" in lines
    assert lines.index("control   started") < lines.index("nginx     started by the control plane")
    log = (one_node.run_dir / "logs" / "control.log").read_text()
    assert "kvgate control on http://" in log
    # the running control plane applies a changed policy itself (a new version), nginx keeps running
    one_node.write(one_node.policy, time_scale="0.02")
    again = one_node.up()
    assert again.returncode == 0, again.stderr
    assert "control   applied policy version 2" in again.stdout and "nginx     " not in again.stdout


def test_replay_without_a_control_plane_says_so(one_node, tmp_path):
    """The replay's balancer switches go only through the control plane: none running → a clear error."""
    assert one_node.up().returncode == 0
    pid = int((one_node.run_dir / "pids" / "control.pid").read_text())
    proc = psutil.Process(pid)
    proc.terminate()
    proc.wait(timeout=30)
    conf = (one_node.run_dir / "nginx" / "conf" / "nginx.conf").read_text()
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [0]}\n')
    out = kvgate(one_node.run_dir, "replay", str(trace), "--policies", "round_robin", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no control plane" in out.stderr and "kvgate up" in out.stderr
    assert "Traceback" not in out.stderr
    assert (one_node.run_dir / "nginx" / "conf" / "nginx.conf").read_text() == conf  # nothing written


def test_nginx_failing_in_the_control_plane_is_reported_and_nothing_is_left(one_node, tmp_path):
    """nginx is started by the control plane: a failure there (here its internal listener's port
    is taken, which the up-front checks do not see) ends `kvgate up` with nginx's own reason."""
    busy = free_port()
    text, n = re.subn(r"^gateway: .*$", f'gateway: {{listen: "127.0.0.1:{one_node.gw}", '
                      f'internal_listen: "127.0.0.1:{busy}"}}', one_node.policy.read_text(), flags=re.M)
    assert n == 1
    policy = tmp_path / "internal-busy.yaml"
    policy.write_text(text)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", busy))
        squatter.listen()
        out = one_node.up(policy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "control plane exited at start: nginx failed to start" in out.stderr, out.stderr
    assert f"127.0.0.1:{busy} failed (98: Address already in use)" in out.stderr
    assert out.stderr.count("Address already in use") == 1  # nginx's repeats said once
    assert "Traceback" not in out.stderr
    assert not list((one_node.run_dir / "pids").glob("*.pid"))
    assert not listening(one_node.gw)
