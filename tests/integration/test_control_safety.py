"""Safety rules of the control plane found by a new-user pass: a Redis outage is not a dead
fleet, the last serving node stays, an undrain during a manual warm-up still ramps, and a
leaked in-flight count does not hold a drain for its whole timeout. Real stack throughout."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import requests

from ctlfixtures import MODEL

pytestmark = pytest.mark.integration


def _chat(fleet, key: str = "k") -> requests.Response:
    return requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                         headers={"X-Session-Id": key, "Cache-Control": "no-store"},
                         json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})


def test_a_redis_outage_is_not_a_dead_fleet(control_fleet):
    fleet = control_fleet(n=2)
    fleet.wait_reports()
    os.kill(int((fleet.run_dir / "pids" / "redis.pid").read_text()), signal.SIGKILL)
    # far past missing_reports × interval (2 s) and eject_after × probe interval (1 s)
    time.sleep(5)
    assert fleet.states() == {"n1": "active", "n2": "active"}
    r = _chat(fleet)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "BYPASS"
    up = fleet.kvgate("up", str(fleet.policy_path))  # starts a new (empty) Redis
    assert up.returncode == 0, up.stdout + up.stderr
    time.sleep(2)
    assert fleet.states() == {"n1": "active", "n2": "active"}


def test_the_last_serving_node_is_never_ejected(control_fleet):
    fleet = control_fleet(n=2)
    fleet.wait_reports()
    assert fleet.kvgate("drain", "n2", "--wait").returncode == 0
    refused = fleet.kvgate("drain", "n1")
    assert refused.returncode == 2 and "last serving node" in refused.stderr
    os.kill(int((fleet.run_dir / "pids" / "sim-n1.pid").read_text()), signal.SIGSTOP)  # hangs: probes time out
    try:
        deadline = time.monotonic() + 20
        while not fleet.events(node="n1", kind="eject_skipped"):
            assert time.monotonic() < deadline, fleet.node("n1")
            time.sleep(0.2)
        assert fleet.node("n1")["state"] == "active"
        assert f"127.0.0.1:{fleet.node_ports['n1']} weight=" in (fleet.run_dir / "nginx/conf/nginx.conf").read_text()
    finally:
        os.kill(int((fleet.run_dir / "pids" / "sim-n1.pid").read_text()), signal.SIGCONT)
    assert _chat(fleet).status_code == 200


def test_undrain_during_a_manual_warmup_still_ramps_to_active(control_fleet):
    system = " ".join(f"w{i}" for i in range(4000))
    pool_extra = f"""    warmup:
      prompts:
        - {{name: big, messages: [{{role: system, content: "{system}"}}, {{role: user, content: hi}}]}}"""
    # 4000 tokens × 0.5 ms: each cold warm-up request takes 2 s, so the undrain lands inside it
    fleet = control_fleet(n=2, pool_extra=pool_extra, sim="time_scale: 1.0, prefill_s_per_token: 0.0005")
    assert fleet.kvgate("drain", "n2", "--wait").returncode == 0
    warm = fleet.kvgate("warm", "n2", "--no-wait")
    assert warm.returncode == 0, warm.stderr
    assert fleet.node("n2")["warmup"]["status"] == "running"
    assert fleet.kvgate("undrain", "n2").returncode == 0
    fleet.wait_state("n2", "active", timeout=40)


def test_a_leaked_gateway_count_does_not_hold_a_drain(control_fleet):
    fleet = control_fleet(n=2, sim="time_scale: 1.0, decode_s_per_token: 0.02", extra="weights: {dynamic: false}")
    key = next(f"k{i}" for i in range(100) if fleet.route(f"k{i}") == "n2")

    def stream() -> None:
        try:
            requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                          headers={"X-Session-Id": key, "Cache-Control": "no-store"},
                          json={"model": MODEL, "max_tokens": 100, "stream": True,
                                "messages": [{"role": "user", "content": "x"}]}).content
        except requests.RequestException:
            pass

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 10
    while fleet.node("n2")["inflight_gateway"] != 1:
        assert time.monotonic() < deadline, fleet.node("n2")
        time.sleep(0.1)
    # an nginx worker dies with the stream (the master starts a new one): its log phase never runs
    master = psutil.Process(int((fleet.run_dir / "nginx/logs/nginx.pid").read_text()))
    for worker in master.children():
        worker.kill()
    t.join()
    r = fleet.kvgate("drain", "n2", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    reason = fleet.node("n2")["reason"]
    assert "leaked" in reason and "timeout" not in reason, reason
