"""The admission queue (issue 12 item 4) at a real gateway over 4 real simulators: a burst of
400 requests into a 4-node pool with a queue of 100 keeps every engine's queue within the
pool's mark, and every request gets a completion or a 503 with Retry-After."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import ExitStack
from typing import Iterator

import aiohttp
import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _start_sims, _stop_all, make_policy
from kvgate.policy.loader import parse_policy

pytestmark = pytest.mark.integration

MAX_NUM_SEQS = 8
MARK = 2  # what the engines may queue beyond max_num_seqs


@pytest.fixture(scope="module")
def agw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("admission")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        # 40 output tokens at 10 ms: 0.4 s a request, so a burst queues
        sims = _start_sims(4, base, extra_args=("--max-num-seqs", str(MAX_NUM_SEQS)))
        stack.callback(_stop_all, sims)
        data = make_policy(sims, redis, balancer="least_conn").model_dump(mode="json")
        data["pools"][0]["admission"] = {"node_capacity": MAX_NUM_SEQS + MARK, "queue_length": 100,
                                         "queue_timeout_s": 20}
        data["gateway"]["auth"] = "optional"
        data["tenants"] = [{"id": "default"}, {"id": "bulk", "priority": "batch"}]
        gw = _start_gateway(base, parse_policy(data, "admission-policy"), sims, redis)
        stack.callback(gw.stop)
        yield gw


async def _burst(gw: Gateway, n: int, max_tokens: int) -> list[tuple[int, str | None, float]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int):
            t0 = time.monotonic()
            async with s.post(gw.url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"burst request {i}"}]}) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After"), time.monotonic() - t0
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_burst_waits_at_the_gateway_not_in_the_engines(agw: Gateway) -> None:
    peak = {"waiting": 0.0, "running": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for sim in agw.sims:
                m = sim.metrics()
                peak["waiting"] = max(peak["waiting"], m.get("vllm:num_requests_waiting", 0))
                peak["running"] = max(peak["running"], m.get("vllm:num_requests_running", 0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(_burst(agw, 400, 40))
    finally:
        stop.set()
        watcher.join()
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 503}, sorted(set(codes))
    assert all(ra for c, ra, _ in results if c == 503)
    # 40 slots + 100 waiting are served; the rest is told at once to come back
    assert codes.count(200) >= 140, codes.count(200)
    assert peak["running"] <= MAX_NUM_SEQS and peak["waiting"] <= MARK, peak
    assert max(t for _, _, t in results) < 30  # nobody waits for a client timeout
    text = requests.get(f"http://{agw.policy.gateway.internal_listen}/metrics", timeout=5).text
    assert 'kvgate_admission_rejected_total{pool="default",priority="interactive",reason="full"}' in text
    assert "kvgate_admission_wait_seconds_count" in text
    agw.wait_metric("kvgate_admission_inflight", 0, pool="default")
    agw.wait_metric("kvgate_admission_waiting", 0, pool="default")


def test_interactive_requests_go_before_batch(agw: Gateway) -> None:
    """Fill the slots, queue batch requests first and interactive ones after: the interactive
    ones are admitted first."""
    done: dict[str, list[float]] = {"batch": [], "interactive": []}

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def one(i: int, prio: str | None, max_tokens: int, label: str | None):
                body = {"model": MODEL, "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": f"prio {label} {i}"}]}
                headers = {"X-Kvgate-Priority": prio} if prio else {}
                async with s.post(agw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                    if label:
                        done[label].append(time.monotonic())

            fill = [asyncio.create_task(one(i, None, 60, None)) for i in range(40)]
            await asyncio.sleep(0.3)
            batch = [asyncio.create_task(one(i, "batch", 4, "batch")) for i in range(20)]
            await asyncio.sleep(0.2)
            inter = [asyncio.create_task(one(i, "interactive", 4, "interactive")) for i in range(20)]
            await asyncio.gather(*fill, *batch, *inter)

    asyncio.run(run())
    assert len(done["batch"]) == len(done["interactive"]) == 20
    # the median interactive request finished before the median batch one, though queued later
    assert sorted(done["interactive"])[10] < sorted(done["batch"])[10]


def test_a_bad_priority_is_refused(agw: Gateway) -> None:
    r = agw.chat("x", headers={"X-Kvgate-Priority": "urgent"}, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"


def test_a_client_that_leaves_the_queue_never_reaches_an_engine(agw: Gateway) -> None:
    """All 40 slots busy (2 s requests); a queued client closes its connection after 0.3 s: its
    place goes at the next poll (the waiting gauge is 0 long before a slot frees), it is counted
    `aborted`, logged 499, and no engine ever gets it."""
    def served() -> float:
        return sum(s.metrics().get("vllm:request_success_total", 0.0) for s in agw.sims)

    agw.wait_metric("kvgate_admission_inflight", 0, pool="default")
    before = served()

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def fill(i: int) -> None:
                async with s.post(agw.url + "/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 200,
                        "messages": [{"role": "user", "content": f"fill {i}"}]}) as r:
                    await r.read()
                    assert r.status == 200

            tasks = [asyncio.create_task(fill(i)) for i in range(40)]
            await asyncio.sleep(0.3)
            assert agw.metric_sum("kvgate_admission_inflight", pool="default") == 40

            def leave() -> None:
                with pytest.raises(requests.exceptions.ReadTimeout):
                    requests.post(agw.url + "/v1/chat/completions", timeout=(2, 0.3), json={
                        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "gone"}]})

            await asyncio.to_thread(leave)
            # gone from the queue at once, while every slot is still held by the fill
            await asyncio.to_thread(agw.wait_metric, "kvgate_admission_rejected_total", 1, 1.0, pool="default",
                                    priority="interactive", reason="aborted")
            assert agw.metric_sum("kvgate_admission_waiting", pool="default") == 0
            assert agw.metric_sum("kvgate_admission_inflight", pool="default") == 40
            await asyncio.gather(*tasks)

    asyncio.run(run())
    agw.wait_metric("kvgate_admission_inflight", 0, pool="default")
    time.sleep(0.3)
    assert served() == before + 40, "the request that left never reached an engine"
    assert agw.metric_sum("kvgate_requests_total", status="499") >= 1
