"""``kvgate agent`` as an operator runs it: a real engine simulator (``kvgate sim`` process), a real
HTTP receiver standing in for the control plane (Flask on werkzeug's server), and the agent as a
subprocess of the installed ``kvgate`` script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
from flask import Flask, jsonify, request
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.serving import make_server

from ctlfixtures import wait_until
from gwfixtures import MODEL, free_port

pytestmark = pytest.mark.integration

TOKEN = "agent-test-token"


def kvgate_bin() -> list[str]:
    script = Path(sys.executable).with_name("kvgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvgate"]


class Receiver:
    """The control plane's report endpoint: records each POST, answers ``status`` + ``body``."""

    def __init__(self, port: int = 0, status: int = 200, body: dict | None = None):
        self.status = status
        self.body = body if body is not None else {"interval_s": 0.2}
        self.reports: list[dict] = []  # {"path", "auth", "json", "status"}
        self._lock = threading.Lock()
        app = Flask("kvgate-test-receiver")

        @app.post("/api/v1/nodes/<node_id>/report")
        def report(node_id: str):
            with self._lock:
                status = self.status
                self.reports.append({"path": request.path, "node_id": node_id, "status": status,
                                     "auth": request.headers.get("Authorization"), "json": request.get_json()})
            if status != 200:
                return jsonify({"error": "unauthorized"}), status
            return jsonify(self.body)

        self.server = make_server("127.0.0.1", port, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.reports)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers():
    started: list[Receiver] = []

    def start(**kw) -> Receiver:
        r = Receiver(**kw)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def agents(tmp_path):
    """``start(*args, env=...)`` → (Popen, stderr log path); killed at teardown if still running."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"agent-{len(procs)}.log"
        full_env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
        full_env.update(env or {})
        with open(log, "wb") as f:
            p = subprocess.Popen([*kvgate_bin(), "agent", *args], stdout=subprocess.DEVNULL, stderr=f,
                                 env=full_env)
        procs.append(p)
        return p, log

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def chat(url: str, max_tokens: int) -> None:
    requests.post(url + "/v1/chat/completions", timeout=60,
                  json={"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})


def scrape_start_time(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "process_start_time_seconds")


def test_agent_reports_adopts_interval_survives_engine_death_and_stops_on_sigterm(start_sims, receivers, agents):
    (sim,) = start_sims(1, prefix="ag")
    rx = receivers(body={"interval_s": 0.2})
    proc, log = agents("--node-id", sim.node_id, "--engine-url", sim.url, "--control-url", rx.url,
                       env={"KVGATE_TOKEN": TOKEN})

    first = wait_until(lambda: rx.snapshot(), "a first report")[0]
    assert first["path"] == f"/api/v1/nodes/{sim.node_id}/report"
    assert first["auth"] == f"Bearer {TOKEN}"
    r = first["json"]
    assert r["node_id"] == sim.node_id and r["agent"]["pid"] == proc.pid
    assert r["gpu"] == {"status": "unavailable", "reason": "NVML Shared Library Not Found"}
    eng = r["engine"]
    assert (eng["url"], eng["healthy"], eng["error"], eng["kind"]) == (sim.url, True, None, "vllm")
    assert isinstance(eng["running"], int) and isinstance(eng["waiting"], int)
    assert eng["num_gpu_blocks"] > 0 and eng["prefix_cache_hit_rate"] is None
    assert eng["start_time"] == pytest.approx(scrape_start_time(sim.url))  # the engine's creation time
    assert r["host"]["memory_total_bytes"] > 0

    # the control plane's interval is adopted: later reports say 0.2 and keep coming
    wait_until(lambda: [x for x in rx.snapshot() if x["json"]["agent"]["interval_s"] == 0.2][3:],
               "four reports at the adopted interval")

    # under load the engine figures move: a request running, prefix-cache queries counted
    load = [threading.Thread(target=chat, args=(sim.url, 150), daemon=True) for _ in range(2)]
    for t in load:
        t.start()
    busy = wait_until(lambda: [x for x in rx.snapshot() if x["json"]["engine"]["running"] >= 1],
                      "a report with a running request")[0]["json"]["engine"]
    assert busy["healthy"] and busy["prefix_cache_queries"] > 0
    for t in load:
        t.join(60)

    # the engine dies: the agent keeps reporting it unhealthy
    sim.stop()
    # (while it shuts down an answer may still be reset or time out; once gone, connections are refused)
    refused = "GET /health: connection failed (Connection refused)"
    down = wait_until(lambda: [x for x in rx.snapshot() if x["json"]["engine"]["error"] == refused],
                      "a report of the dead engine")
    eng = down[0]["json"]["engine"]
    assert eng["healthy"] is False
    assert eng["running"] is None and eng["kind"] is None and eng["start_time"] is None
    # once the engine is gone every report fails at /health; in the shutdown window before, a
    # /health may still answer and the /metrics right after it be reset (an engine going down)
    reports = [x["json"]["engine"] for x in rx.snapshot()]
    gone = next(i for i, e in enumerate(reports) if e["error"] == refused)
    assert all(e["error"].startswith("GET /health: ") for e in reports[gone:])
    assert all(e["error"].startswith(("GET /health: ", "GET /metrics: ")) for e in reports[:gone]
               if not e["healthy"])
    n = len(rx.snapshot())
    wait_until(lambda: len(rx.snapshot()) >= n + 3, "reports after the engine died")
    assert proc.poll() is None

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    text = log.read_text()
    # the first failure is logged (a /metrics reset in the shutdown window, else /health)
    assert "unhealthy: GET /health: " in text or "unhealthy: GET /metrics: " in text
    assert text.count("unhealthy") == 1  # one line per problem, not one per report
    assert "SIGTERM received, stopping" in text and "Traceback" not in text


def test_agent_keeps_trying_through_refused_connections_and_a_rejected_token(start_sims, receivers, agents,
                                                                              tmp_path):
    (sim,) = start_sims(1, prefix="tok")
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("wrong-token\n")
    proc, log = agents("--node-id", sim.node_id, "--engine-url", sim.url,
                       "--control-url", f"http://127.0.0.1:{port}", "--token-file", str(token_file),
                       "--interval", "0.2")

    # no control plane yet
    wait_until(lambda: "cannot reach the control plane" in log.read_text(), "the connection-refused line")
    assert proc.poll() is None

    # a control plane that refuses the token
    rx = receivers(port=port, status=401, body={"interval_s": 5})
    wait_until(lambda: len(rx.snapshot()) >= 3, "three rejected reports")
    wait_until(lambda: "admin token rejected" in log.read_text(), "the token-rejected line")
    assert proc.poll() is None
    assert rx.snapshot()[0]["auth"] == "Bearer wrong-token"
    assert log.read_text().count("admin token rejected") == 1

    # the operator fixes the token on the control plane's side: reports are accepted again
    rx.status = 200
    wait_until(lambda: [x for x in rx.snapshot() if x["status"] == 200][2:], "accepted reports")
    wait_until(lambda: "reporting to" in log.read_text(), "the recovery line")
    # --interval fixed it: the control plane's 5 s is not adopted
    assert all(x["json"]["agent"]["interval_s"] == 0.2 for x in rx.snapshot())

    proc.send_signal(signal.SIGINT)
    assert proc.wait(15) == 0
    assert "Traceback" not in log.read_text()


def test_agent_once_prints_a_report(start_sims):
    (sim,) = start_sims(1, prefix="once")
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
    res = subprocess.run([*kvgate_bin(), "agent", "--node-id", sim.node_id, "--engine-url", sim.url, "--once"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["node_id"] == sim.node_id
    assert report["gpu"]["status"] == "unavailable"
    assert report["engine"]["healthy"] is True and report["engine"]["kind"] == "vllm"
    assert report["engine"]["running"] == 0 and report["engine"]["waiting"] == 0
