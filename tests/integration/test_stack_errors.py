"""`kvgate up` failure modes a user meets: a busy port, stale pid files, nothing running."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvgate(run_dir, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout)


def write_policy(path, gw, rd, node):
    path.write_text(f"""
gateway: {{listen: "127.0.0.1:{gw}"}}
redis: {{url: "redis://127.0.0.1:{rd}/0"}}
pools:
  - name: p
    models: [m]
    nodes: [{{id: a, url: "http://127.0.0.1:{node}", simulate: true}}]
simulator: {{model: m, time_scale: 0.01}}
""")


def test_busy_port_is_reported_and_nothing_is_left_running(tmp_path):
    gw, rd, node = free_port(), free_port(), free_port()
    policy = tmp_path / "p.yaml"
    write_policy(policy, gw, rd, node)
    run_dir = tmp_path / "run"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", node))
        squatter.listen()
        proc = kvgate(run_dir, "up", str(policy))
    try:
        assert proc.returncode == 1
        assert f"sim-a: port 127.0.0.1:{node} is already in use by another program" in proc.stderr
        assert "Traceback" not in proc.stderr
        # the Redis this call had started is stopped again
        assert not list((run_dir / "pids").glob("*.pid"))
        assert kvgate(run_dir, "status").returncode == 1
    finally:
        kvgate(run_dir, "down")


def test_stale_pid_files_are_cleaned(tmp_path):
    gw, rd, node = free_port(), free_port(), free_port()
    policy = tmp_path / "p.yaml"
    write_policy(policy, gw, rd, node)
    run_dir = tmp_path / "run"
    (run_dir / "pids").mkdir(parents=True)
    # a pid that exists but is not ours (this test process) and one that does not exist
    (run_dir / "pids" / "sim-a.pid").write_text(f"{os.getpid()}\n")
    (run_dir / "pids" / "redis.pid").write_text("999999999\n")
    try:
        proc = kvgate(run_dir, "up", str(policy))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "sim-a     started" in proc.stdout and "redis     started" in proc.stdout
        assert int((run_dir / "pids" / "sim-a.pid").read_text()) != os.getpid()
        st = kvgate(run_dir, "status")
        assert st.returncode == 0, st.stdout
    finally:
        down = kvgate(run_dir, "down")
    assert "sim-a     stopped" in down.stdout
    assert not list((run_dir / "pids").glob("*.pid"))


def test_status_with_nothing_running(tmp_path):
    proc = kvgate(tmp_path / "run", "status")
    assert proc.returncode == 1
    assert "nothing runs under" in proc.stdout
