"""``kvgate sim`` as a command: options, validation, and a real process serving HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests
from click.testing import CliRunner

from kvgate.policy.model import SimulatorConfig
from kvgate.sim.cli import sim_command


def test_help_lists_one_option_per_config_field():
    result = CliRunner().invoke(sim_command, ["--help"])
    assert result.exit_code == 0
    for field in SimulatorConfig.model_fields:
        assert "--" + field.replace("_", "-") in result.output
    for option in ("--host", "--port", "--node-id"):
        assert option in result.output


def test_invalid_config_is_rejected_before_serving():
    result = CliRunner().invoke(sim_command, ["--num-gpu-blocks", "1"])
    assert result.exit_code == 2
    assert "num_gpu_blocks" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_serves_and_logs_one_start_line(tmp_path):
    port = _free_port()
    log = tmp_path / "sim.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate.sim.cli", "--port", str(port), "--node-id", "n7", "--model", "m",
             "--time-scale", "0.01"],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        assert r.status_code == 200 and r.headers["X-Kvgate-Sim-Node"] == "n7"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(3):
            assert requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=5).ok
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    lines = log.read_text().splitlines()
    assert any(f"kvgate sim n7 serving m on http://127.0.0.1:{port}" in line for line in lines)
    assert not any("POST /v1/chat/completions" in line for line in lines)  # access log off by default
