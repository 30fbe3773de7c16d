"""`kvgate up` failure modes a user meets: a busy port, stale pid files, nothing running."""

import os
import socket

import pytest
import requests

from gwfixtures import free_port
from gwfixtures import kvgate_cli as kvgate

pytestmark = pytest.mark.integration


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


def test_changed_policy_restarts_only_what_changed(tmp_path):
    gw, rd, rd2, node = free_port(), free_port(), free_port(), free_port()
    policy = tmp_path / "p.yaml"
    write_policy(policy, gw, rd, node)
    run_dir = tmp_path / "run"
    try:
        assert kvgate(run_dir, "up", str(policy)).returncode == 0
        sim_pid = (run_dir / "pids" / "sim-a.pid").read_text()

        policy.write_text(policy.read_text().replace("time_scale: 0.01", "time_scale: 0.02"))
        out = kvgate(run_dir, "up", str(policy))
        assert out.returncode == 0, out.stderr
        assert "sim-a     restarted" in out.stdout and "redis     running" in out.stdout
        assert (run_dir / "pids" / "sim-a.pid").read_text() != sim_pid

        policy.write_text(policy.read_text().replace(f"redis://127.0.0.1:{rd}/0", f"redis://127.0.0.1:{rd2}/0"))
        out = kvgate(run_dir, "up", str(policy))
        assert out.returncode == 0, out.stderr
        assert "redis     restarted" in out.stdout and "sim-a     running" in out.stdout
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", rd), timeout=1).close()
        assert kvgate(run_dir, "status").returncode == 0
    finally:
        kvgate(run_dir, "down")


def test_failed_up_keeps_the_running_policy(tmp_path):
    gw, rd, node = free_port(), free_port(), free_port()
    good = tmp_path / "good.yaml"
    write_policy(good, gw, rd, node)
    run_dir = tmp_path / "run"
    try:
        assert kvgate(run_dir, "up", str(good)).returncode == 0
        # a policy nginx cannot serve: its listen address is taken by another program
        busy = free_port()
        bad = tmp_path / "bad.yaml"
        write_policy(bad, busy, rd, node)
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", busy))
            squatter.listen()
            out = kvgate(run_dir, "up", str(bad))
        assert out.returncode == 1, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        st = kvgate(run_dir, "status")
        assert st.returncode == 0, st.stdout
        assert f"http://127.0.0.1:{gw}" in st.stdout
        assert requests.get(f"http://127.0.0.1:{gw}/kvgate/health", timeout=2).status_code == 200
    finally:
        kvgate(run_dir, "down")


def test_down_never_signals_a_process_that_only_looks_like_ours(tmp_path):
    import subprocess
    import sys

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


def test_failed_up_restores_what_it_replaced(tmp_path):
    import psutil

    gw, rd, node, busy = free_port(), free_port(), free_port(), free_port()
    good = tmp_path / "good.yaml"
    write_policy(good, gw, rd, node)
    run_dir = tmp_path / "run"
    try:
        assert kvgate(run_dir, "up", str(good)).returncode == 0
        # sim-a gets new settings (so it is restarted), then sim-b cannot start: busy port
        bad = tmp_path / "bad.yaml"
        bad.write_text(good.read_text().replace("time_scale: 0.01", "time_scale: 0.02").replace(
            "simulate: true}]", f'simulate: true}}, {{id: b, url: "http://127.0.0.1:{busy}", simulate: true}}]'))
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", busy))
            squatter.listen()
            out = kvgate(run_dir, "up", str(bad))
        assert out.returncode == 1, out.stdout + out.stderr
        assert "sim-a     restarted" in out.stdout
        assert f"sim-b: port 127.0.0.1:{busy} is already in use" in out.stderr
        st = kvgate(run_dir, "status")
        assert st.returncode == 0, st.stdout
        pid = int((run_dir / "pids" / "sim-a.pid").read_text())
        cmd = psutil.Process(pid).cmdline()
        assert cmd[cmd.index("--time-scale") + 1] == "0.01"
    finally:
        kvgate(run_dir, "down")


def test_concurrent_ups_are_serialised(tmp_path):
    import subprocess
    import sys

    gw, rd, node = free_port(), free_port(), free_port()
    run_dir = tmp_path / "run"
    policies = []
    for scale in ("0.01", "0.02", "0.03"):
        p = tmp_path / f"p{scale}.yaml"
        write_policy(p, gw, rd, node)
        p.write_text(p.read_text().replace("time_scale: 0.01", f"time_scale: {scale}"))
        policies.append(p)
    try:
        assert kvgate(run_dir, "up", str(policies[0])).returncode == 0
        procs = [subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), "up", str(p)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for p in policies[1:]]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        st = kvgate(run_dir, "status", "--json")
        assert st.returncode == 0, st.stdout
    finally:
        kvgate(run_dir, "down")
    # everything the three `up`s started is stopped: the node's port is free again
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", node), timeout=1).close()
