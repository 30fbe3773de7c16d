"""Issue 3 acceptance: drain under load and a reload storm, with real nginx, Redis,
simulators, agents and the control plane, driven by the real `openai` client and CLI."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest

from ctlfixtures import stream_chat

pytestmark = pytest.mark.integration

STREAM_TOKENS = 30


def test_drain_under_load_loses_nothing_and_moves_only_its_keys(control_fleet):
    # 30 tokens × 0.1 s: each stream lasts 3 s at a pace one Python client can read for 200 streams,
    # and the engine runs all 200 at once (max_num_seqs 256): the drain starts with all in flight
    fleet = control_fleet(n=3, sim="time_scale: 1.0, max_num_seqs: 256, decode_s_per_token: 0.1",
                          extra="weights: {dynamic: false}")
    keys = [f"k{i}" for i in range(150)]
    before = {k: fleet.route(k) for k in keys}
    victim = before["k0"]
    hot_key = "k0"
    on_victim = [k for k in keys if before[k] == victim]
    assert on_victim and len(on_victim) < len(keys)

    results: list[dict] = []

    async def load(n: int) -> None:
        client = openai.AsyncOpenAI(base_url=fleet.gateway + "/v1", api_key="x", max_retries=0, timeout=120)
        results.extend(await asyncio.gather(*[stream_chat(client, hot_key, STREAM_TOKENS) for _ in range(n)]))

    # 4 clients of 50 streams, each on its own event loop: one loop alone cannot open 200 streams
    # before the first ones end on this 2-core machine
    runners = [threading.Thread(target=lambda: asyncio.run(load(50))) for _ in range(4)]
    served_at_start = fleet.engine_counter(victim)  # the route() requests above
    for runner in runners:
        runner.start()
    # (nearly) all 200 are in flight on the victim (running or waiting) before the drain starts
    deadline = time.monotonic() + 30
    peak = 0.0
    while time.monotonic() < deadline:
        eng = fleet.engine_counter(victim, "vllm:num_requests_running") + \
            fleet.engine_counter(victim, "vllm:num_requests_waiting")
        peak = max(peak, eng)
        if eng >= 180:
            break
        time.sleep(0.05)
    served_before = fleet.engine_counter(victim) - served_at_start
    t0 = time.monotonic()
    drain = fleet.kvgate("drain", victim, "--wait", "--timeout", "120")
    drain_s = time.monotonic() - t0
    for runner in runners:
        runner.join(timeout=120)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert "drained" in drain.stdout
    assert served_before < 20, f"{served_before:.0f} streams finished before the drain started (peak {peak})"

    failed = [r for r in results if r["error"]]
    truncated = [r for r in results if not r["error"] and (r["finish"] != "length" or r["tokens"] != STREAM_TOKENS)]
    assert len(results) == 200
    assert not failed, failed[:3]
    assert not truncated, truncated[:3]
    assert fleet.node(victim)["state"] == "drained"
    # drained means nothing was left in flight: every stream had ended when the CLI returned
    print(f"drain took {drain_s:.1f}s with {200 - served_before:.0f} of 200 streams still in flight; "
          "0 failed, 0 truncated")

    # no new request reaches the drained node; only its keys moved
    flat = fleet.engine_counter(victim)
    after = {k: fleet.route(k) for k in keys}
    assert fleet.engine_counter(victim) == flat
    moved = [k for k in keys if after[k] != before[k]]
    assert sorted(moved) == sorted(on_victim)
    assert all(after[k] != victim for k in keys)

    # undrain: warming → ramping → active, and its keys come back at full weight
    assert fleet.kvgate("undrain", victim).returncode == 0
    fleet.wait_state(victim, "active", timeout=30)
    moves = [(e["data"].get("from_state"), e["data"].get("to_state"))
             for e in reversed(fleet.events(node=victim, kind="state"))]
    assert moves == [("active", "draining"), ("draining", "drained"), ("drained", "warming"),
                     ("warming", "ramping"), ("ramping", "active")], moves
    assert {k: fleet.route(k) for k in keys} == before


@pytest.mark.parametrize("keepalive", [0, 75])
def test_reload_storm_under_streaming_load_fails_nothing(control_fleet, keepalive):
    """Weights and a timeout change every 0.5 s for 30 s while 12 clients stream without pause.

    A weight alone is pushed without a reload (tests/integration/test_control_dynamic.py): the
    connect timeout, a static setting, alternates too, so every apply reloads nginx.

    With client keep-alive off, the strict client (no retries) sees 0 failures. With keep-alive
    on, an old worker closing an idle connection at the instant a client reuses it resets that
    request before nginx read it: the OpenAI SDK's default retries (2) absorb it, so the test
    runs the SDK as users do and reports how many retries happened."""
    fleet = control_fleet(n=3, sim="time_scale: 0.2", extra="weights: {dynamic: false}",
                          gateway_extra=f", client_keepalive_timeout_s: {keepalive}")
    stop = threading.Event()
    results: list[dict] = []
    retries = 0

    async def on_request(request) -> None:
        nonlocal retries
        retries += bool(request.headers.get("x-stainless-retry-count", "0") != "0")

    # the SDK's own HTTP client class (openai 3 ships httpx2, older ones httpx), with a hook
    client = openai.AsyncOpenAI(base_url=fleet.gateway + "/v1", api_key="x", timeout=60,
                                max_retries=0 if keepalive == 0 else 2,
                                http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request]}))

    async def worker(i: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(await stream_chat(client, f"storm-{i}-{n % 7}", tokens=16))
            n += 1

    async def load() -> None:
        await asyncio.gather(*[worker(i) for i in range(12)])

    runner = threading.Thread(target=lambda: asyncio.run(load()))
    runner.start()
    applied = 0
    reloads_before = _metric(fleet, 'kvgate_control_reloads_total{result="reloaded"}')
    t_end = time.monotonic() + 30
    i = 0
    try:
        while time.monotonic() < t_end:
            t = time.monotonic()
            weights = {"n1": 1 + i % 3, "n2": 1 + (i + 1) % 4, "n3": 1 + (i * 2) % 5}
            timeout = f", connect_timeout_s: {1.0 + i % 2}"  # structural: a reload
            r = fleet.api("PUT", "/api/v1/policy", data=fleet.render(
                weights=weights, gateway_extra=f", client_keepalive_timeout_s: {keepalive}{timeout}"),
                headers={"Content-Type": "application/yaml"})
            assert r.status_code == 200, r.text
            applied += r.json()["changed"]
            i += 1
            time.sleep(max(0.0, 0.5 - (time.monotonic() - t)))
    finally:
        stop.set()
        runner.join(timeout=60)
    reloads = _metric(fleet, 'kvgate_control_reloads_total{result="reloaded"}') - reloads_before
    failed = [r for r in results if r["error"] or r["finish"] != "length" or r["tokens"] != 16]
    print(f"reload storm (client keep-alive {keepalive}s): {i} applies ({applied} changed, {reloads:.0f} nginx "
          f"reloads) in 30 s; {len(results)} streams, {len(failed)} failed, {retries} SDK retries")
    assert i >= 40 and reloads >= 30
    assert len(results) >= 100
    assert not failed, failed[:3]


def _metric(fleet, series: str) -> float:
    text = fleet.api("GET", "/metrics").text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
