"""Issue 9 item 6: drains are safe. A policy apply does not remove a node that still has work
(409 unless forced), a drain of an engine without vLLM/SGLang ``/metrics`` ends on the
gateway's own in-flight count, and ``kvgate drain --wait`` fails when the drain timed out
with requests in flight. Real ``kvgate up`` stacks (nginx, Redis, control plane, simulators
and agents) and, for the engine without figures, the mock engine as that engine."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import openai
import psutil
import pytest

from ctlfixtures import Fleet, stream_chat, wait_until

pytestmark = pytest.mark.integration


def key_on(fleet: Fleet, node_id: str) -> str:
    """A session key the gateway routes to ``node_id`` now."""
    for i in range(200):
        if fleet.route(f"key{i}") == node_id:
            return f"key{i}"
    raise AssertionError(f"no key of 200 routes to {node_id}")


def streams(fleet: Fleet, key: str, n: int, tokens: int) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """``n`` streams of session ``key`` started in a thread (join it; results fill the list)."""
    results: list[dict[str, Any]] = []

    async def load() -> None:
        client = openai.AsyncOpenAI(base_url=fleet.gateway + "/v1", api_key="x", max_retries=0, timeout=60)
        results.extend(await asyncio.gather(*[stream_chat(client, key, tokens) for _ in range(n)]))

    runner = threading.Thread(target=lambda: asyncio.run(load()))
    runner.start()
    return runner, results


def wait_inflight(fleet: Fleet, node_id: str, n: int) -> None:
    """Until the control plane sees ``n`` requests in flight on the node at the gateway."""
    wait_until(lambda: (fleet.node(node_id).get("inflight_gateway") or 0) >= n,
               f"{n} requests in flight on {node_id} at the gateway", timeout=20)


def versions(fleet: Fleet) -> int:
    return len(fleet.api("GET", "/api/v1/policy/versions").json()["versions"])


def test_apply_refuses_to_remove_a_node_with_streams_in_flight(control_fleet: Callable[..., Fleet],
                                                               tmp_path: Path) -> None:
    # 200 tokens × 0.1 s: each stream lasts 20 s, long enough for the refusals below (two CLI
    # runs and the API calls, on a loaded machine)
    fleet = control_fleet(n=3, sim="time_scale: 1.0, decode_s_per_token: 0.1", extra="weights: {dynamic: false}")
    victim = "n2"
    key = key_on(fleet, victim)
    others = [n for n in sorted(fleet.node_ports) if n != victim]
    smaller = fleet.write_policy(tmp_path / "without-n2.yaml", nodes=others)
    n_versions = versions(fleet)
    runner, results = streams(fleet, key, 10, tokens=200)
    wait_inflight(fleet, victim, 10)

    # an active node with requests in flight: 409 in the API's error shape, with the count
    r = fleet.api("PUT", "/api/v1/policy", data=smaller.read_text(), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["type"] == "conflict_error" and err["code"] == "node_has_work", err
    [node] = err["nodes"]
    assert node["id"] == victim and node["state"] == "active" and node["inflight"] >= 10, err
    assert "drain it first" in err["message"] and "force" in err["message"], err["message"]

    # draining with the streams still in flight: `kvgate apply` refuses too, non-zero and clear
    assert fleet.kvgate("drain", victim).returncode == 0
    res = fleet.kvgate("apply", str(smaller))
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(rf"error: {smaller} not applied: node {victim} still has work \(draining, \d+ request\(s\) "
                     r"in flight", res.stderr), res.stderr
    assert "--force" in res.stderr, res.stderr
    print(f"API: {err['message']}\nCLI (rc {res.returncode}):\n{res.stderr}")
    assert versions(fleet) == n_versions
    assert fleet.node(victim)["state"] == "draining"  # the running config keeps serving, the drain goes on

    # the drain finishes with every stream whole; then the node can go
    res = fleet.kvgate("drain", victim, "--wait", "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr
    runner.join(timeout=60)
    assert len(results) == 10 and all(not x["error"] and x["tokens"] == 200 for x in results), results[:3]
    res = fleet.kvgate("apply", str(smaller))
    assert res.returncode == 0, res.stdout + res.stderr
    assert fleet.api("GET", f"/api/v1/nodes/{victim}").status_code == 404
    assert versions(fleet) == n_versions + 1


def test_up_refuses_and_apply_force_removes_a_node_with_streams_in_flight(control_fleet: Callable[..., Fleet],
                                                                         tmp_path: Path) -> None:
    fleet = control_fleet(n=3, sim="time_scale: 1.0, decode_s_per_token: 0.1", extra="weights: {dynamic: false}")
    victim = "n3"
    key = key_on(fleet, victim)
    smaller = fleet.write_policy(tmp_path / "without-n3.yaml", nodes=["n1", "n2"])
    # 12 s streams: still in flight after `kvgate up`, the drain and the forced apply below
    runner, results = streams(fleet, key, 5, tokens=120)
    wait_inflight(fleet, victim, 5)
    sim_pid = int((fleet.run_dir / "pids" / f"sim-{victim}.pid").read_text())

    # `kvgate up` goes through the same refusal, and leaves the node's simulator serving
    res = fleet.kvgate("up", str(smaller))
    assert res.returncode != 0, res.stdout + res.stderr
    assert "HTTP 409" in res.stderr and f"node {victim} (active, " in res.stderr, res.stderr
    assert psutil.pid_exists(sim_pid) and fleet.node(victim)["state"] == "active"

    # forced while a `drain --wait` follows the node: the waiter says what happened (it was a bare 404)
    waiter = subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(fleet.run_dir), "drain", victim,
                               "--wait", "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: fleet.node(victim)["state"] == "draining", f"{victim} draining", timeout=20)
    res = fleet.kvgate("apply", "--force", str(smaller))
    assert res.returncode == 0, res.stdout + res.stderr
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 1, out + err
    assert re.match(rf"error: {victim} was removed from the policy while it was draining \(in flight when last "
                    r"seen: gateway (\d+|unknown), engine (\d+|unknown)\)", err), err
    assert fleet.api("GET", f"/api/v1/nodes/{victim}").status_code == 404
    removed = fleet.events(kind="node_removed", node=victim)
    assert removed and "forced" in removed[0]["message"] and "in flight" in removed[0]["message"], removed
    # forced: the node left the ring at once, but nginx let its streams end on it
    runner.join(timeout=60)
    assert len(results) == 5 and all(not x["error"] and x["tokens"] == 120 for x in results), results[:3]


def test_drain_of_an_engine_without_metrics_ends_on_the_gateway_count(control_fleet: Callable[..., Fleet],
                                                                      start_mocks) -> None:
    # n3 is a plain OpenAI server (the mock: /metrics answers 404), as TGI or llama.cpp would be
    [mock] = start_mocks(1, prefix="plain")
    mock.set(chunks=60, chunk_delay_s=0.1)  # 6 s streams: in flight long enough to be seen at 5
    fleet = control_fleet(n=3, external={"n3": mock.url}, extra="weights: {dynamic: false}")
    key = key_on(fleet, "n3")
    runner, results = streams(fleet, key, 5, tokens=20)
    wait_inflight(fleet, "n3", 5)
    t0 = time.monotonic()
    # before the fix this ran into drain.timeout_s (120 s here): the CLI's 20 s ran out first
    res = fleet.kvgate("drain", "n3", "--wait", "--timeout", "20")
    took = time.monotonic() - t0
    runner.join(timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    last = res.stdout.splitlines()[-1]
    assert last.startswith("n3: drained (") and "engine figures unavailable" in last \
        and "decided on the gateway's in-flight count" in last, res.stdout
    assert took < 15, took
    print(f"drain of an engine without /metrics took {took:.1f}s: {last}")
    # drained only once the streams were over: none was cut, nothing is left on the engine
    assert len(results) == 5 and all(not x["error"] and x["finish"] == "stop" for x in results), results[:3]
    assert mock.inflight == 0
    n3 = fleet.node("n3")
    assert n3["state"] == "drained" and n3["drain"]["decided_on"] == "gateway", n3["drain"]
    assert "HTTP 404" in n3["drain"]["engine_figures"], n3["drain"]
    event = fleet.events(node="n3", kind="state")[0]
    assert event["data"]["to_state"] == "drained" and "engine figures unavailable" in event["message"]


def test_drain_wait_fails_when_the_drain_timed_out_with_requests_in_flight(control_fleet: Callable[..., Fleet]
                                                                          ) -> None:
    # drain.timeout_s 2 s, streams of 6 s
    fleet = control_fleet(n=3, sim="time_scale: 1.0, decode_s_per_token: 0.1", extra="weights: {dynamic: false}",
                          drain_timeout_s=2)
    key = key_on(fleet, "n1")
    runner, results = streams(fleet, key, 6, tokens=60)
    wait_inflight(fleet, "n1", 6)
    res = fleet.kvgate("drain", "n1", "--wait", "--timeout", "30")
    runner.join(timeout=30)
    assert res.returncode == 1, res.stdout + res.stderr
    m = re.search(r"error: n1: the drain timed out after \d+s with (\d+) request\(s\) still in flight", res.stderr)
    assert m and int(m.group(1)) >= 1, res.stderr
    print(res.stderr)
    assert fleet.node("n1")["state"] == "drained"
    # the streams still ended on the node (down in nginx, not cut)
    assert all(not x["error"] and x["tokens"] == 60 for x in results), results[:3]


def test_an_agent_on_an_engine_without_metrics_keeps_it_serving(control_fleet: Callable[..., Fleet],
                                                                  start_mocks) -> None:
    # n3 is a plain OpenAI server with an agent beside it, as an operator would run one next
    # to TGI or llama.cpp: the agent must report it healthy with its figures unavailable
    # (before the fix: "agent: engine GET /metrics: HTTP 404" → ejected)
    [mock] = start_mocks(1, prefix="plain")
    fleet = control_fleet(n=3, external={"n3": mock.url}, extra="weights: {dynamic: false}")
    agent = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "agent", "--node-id", "n3", "--engine-url", mock.url,
         "--control-url", fleet.control, "--token", fleet.token, "--interval", "0.5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def reported() -> dict[str, Any] | None:
            engine = (fleet.node("n3").get("report") or {}).get("engine") or {}
            return engine if engine.get("url") == mock.url else None

        engine = wait_until(reported, "a report of n3's agent", 20)
        assert engine["healthy"] is True and engine["error"] is None, engine
        assert engine["figures_error"] == "GET /metrics: HTTP 404", engine
        # several report intervals and health rounds (eject_after 2 at 0.5 s): still serving
        time.sleep(3)
        assert fleet.node("n3")["state"] == "active"
        assert not [e for e in fleet.events(node="n3", kind="state") if e["data"].get("to_state") == "ejected"]
        key = key_on(fleet, "n3")
        r = fleet.session.post(fleet.gateway + "/v1/chat/completions", timeout=10, headers={"X-Session-Id": key},
                               json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and "from plain1" in r.text, r.text
    finally:
        agent.terminate()
        agent.wait(10)
