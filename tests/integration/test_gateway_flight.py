"""Single flight of the exact cache (lua/kvgate/flight.lua) through the real gateway, Redis and
simulators: identical cacheable misses sent at once reach one engine once."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from gwfixtures import MODEL, Gateway, sims_total

SUCCESS = "vllm:request_success_total"


def _body(content: str, **params) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 30, **params}


def _post(gw: Gateway, body: dict) -> requests.Response:
    return requests.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def _burst(gw: Gateway, body: dict, n: int) -> list[requests.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _post(gw, body), range(n)))


def test_fifty_identical_requests_one_engine_request(fleet_clean: Gateway) -> None:
    gw = fleet_clean
    before = sims_total(gw.sims, SUCCESS)
    flights = gw.metric_sum("kvgate_cache_flight_total", result="hit")
    answers = _burst(gw, _body("Single flight: fifty at once"), 50)
    assert [r.status_code for r in answers] == [200] * 50
    bodies = {r.content for r in answers}
    assert len(bodies) == 1, "50 identical answers"
    outcomes = sorted(r.headers["X-Kvgate-Cache"] for r in answers)
    assert outcomes.count("MISS") == 1, outcomes
    time.sleep(0.2)
    assert sims_total(gw.sims, SUCCESS) - before == 1, "exactly one engine request"
    # the 49 others: served the leader's answer after waiting (or found the entry stored already)
    reasons = [r.headers.get("X-Kvgate-Cache-Reason") for r in answers if r.headers["X-Kvgate-Cache"] == "HIT"]
    assert len(reasons) == 49
    assert gw.metric_sum("kvgate_cache_flight_total", result="hit") - flights == reasons.count("flight") > 0
    # the lock went with the stored entry
    assert not list(gw.redis.client().scan_iter("kvgate:flight:*"))


def test_stream_duplicates_get_the_answer_as_sse(fleet_clean: Gateway) -> None:
    gw = fleet_clean
    before = sims_total(gw.sims, SUCCESS)
    # (a stream is stored with its usage only: one without include_usage is not single-flighted)
    body = _body("Single flight: streams", stream=True, stream_options={"include_usage": True})
    answers = _burst(gw, body, 10)
    assert all(r.status_code == 200 for r in answers)
    assert all(r.headers["Content-Type"].startswith("text/event-stream") for r in answers)

    def text(r: requests.Response) -> str:
        out = ""
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices") or []:
                    out += (ch.get("delta") or {}).get("content") or ""
        return out

    assert len({text(r) for r in answers}) == 1
    time.sleep(0.2)
    assert sims_total(gw.sims, SUCCESS) - before == 1


def test_different_requests_do_not_wait_for_each_other(fleet_clean: Gateway) -> None:
    gw = fleet_clean
    before = sims_total(gw.sims, SUCCESS)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _post(gw, _body(f"Single flight: distinct {i}")), range(8)))
    assert all(r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "MISS" for r in answers)
    time.sleep(0.2)
    assert sims_total(gw.sims, SUCCESS) - before == 8


def test_a_failed_leader_hands_over_and_the_bound_holds(start_sims, start_redis, start_gateway) -> None:
    """The leader's lock is released when it stores nothing (here: a stream without usage is
    not stored … the engine's 400 is): duplicates go on without waiting the whole bound; and past
    the bound a duplicate goes to an engine itself."""
    sims = start_sims(1)
    redis = start_redis()
    gw = start_gateway(sims, redis, cache={"single_flight_wait_s": 0.3})
    # an engine error (max_tokens past the model length): nothing stored, the lock goes at once
    bad = _body("Single flight: refused", max_tokens=10_000_000)
    t0 = time.monotonic()
    answers = _burst(gw, bad, 5)
    assert all(r.status_code == 400 for r in answers), [r.status_code for r in answers]
    assert not list(redis.client().scan_iter("kvgate:flight:*"))
    assert time.monotonic() - t0 < 5
    # a generation longer than the bound: the duplicates stop waiting after 0.3 s
    before = sims_total(gw.sims, SUCCESS)
    slow = _body("Single flight: slow", max_tokens=80)  # 80 x 10 ms = 0.8 s
    answers = _burst(gw, slow, 4)
    assert all(r.status_code == 200 for r in answers)
    reasons = [r.headers.get("X-Kvgate-Cache-Reason") for r in answers]
    assert reasons.count("flight-timeout") >= 1, reasons
    time.sleep(0.2)
    assert sims_total(gw.sims, SUCCESS) - before >= 2
    assert gw.metric_sum("kvgate_cache_flight_total", result="timeout") >= 1
