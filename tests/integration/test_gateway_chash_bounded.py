"""chash_bounded in the real gateway (nginx + Lua, scriptable mock engines, Redis): with no
load every key lands where chash (the oracle tests/oracles/ring.py) puts it; a hot key (every
request one session) spreads with no node over 1.3 x the mean in-flight prefill, each spill
counted (kvgate_route_spill_total) and logged (`spill`); the load comes back to exactly 0 after
streams, client aborts, failovers and errors; an engine queue over saturated_queue sends the
node's keys on, a stale report counts as unknown. One stack for the module."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from gwfixtures import Gateway, _start_gateway, _start_redis, _wait, make_policy
from mockengine import Behaviour, start_mock_engines
from oracles.ring import key_point, pool_ring

from kvgate import keys

LOAD = keys.UPSTREAM_LOAD
SPILL = keys.ROUTE_SPILL


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("bounded")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        mocks = start_mock_engines(4, prefix="b")
        for m in mocks:
            stack.callback(m.stop)
        policy = make_policy(mocks, redis, balancer="chash_bounded",
                             pool={"bound_factor": 1.1, "saturated_queue": 4})
        gw = _start_gateway(base, policy, mocks, redis)
        stack.callback(gw.stop)
        yield gw


def _loads(gw: Gateway) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in gw.metrics().items():
        if key.startswith(LOAD + "{"):
            out[key.split('node="', 1)[1].split('"', 1)[0]] = value
    return out


def _zero(gw: Gateway, why: str) -> None:
    # released in the log phase, after the client has its answer (maybe in the other worker)
    _wait(lambda: all(v == 0 for v in _loads(gw).values()), 5, f"load back at 0 after {why}: {_loads(gw)}")


def _log(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange("kvgate:log")]


def _reset(gw: Gateway) -> None:
    assert gw.redis is not None
    gw.redis.client().flushdb()
    for m in gw.sims:
        m.clear()
        m.set(stall_s=0.0, status=200, chunk_delay_s=0.0)


def test_no_load_every_key_on_chash_node(bounded: Gateway) -> None:
    gw = bounded
    _reset(gw)
    ring = pool_ring(gw.policy, "default")
    wrong = {}
    for i in range(60):
        s = f"quiet-{i}"
        r = gw.chat("hello", max_tokens=1, headers={"X-Session-Id": s})
        assert r.status_code == 200, r.text
        if r.headers["X-Kvgate-Node"] != ring.home(key_point("s:" + s)):
            wrong[s] = r.headers["X-Kvgate-Node"]
        _zero(gw, "a request")  # no load left from the last one: nothing to spill for
    assert not wrong
    _wait(lambda: len(_log(gw)) >= 60, 5, "the request log")
    assert {e["spill"] for e in _log(gw)} == {""}
    assert gw.metric_sum(SPILL) == 0


def test_hot_key_spreads_within_the_bound_and_spills_are_counted(bounded: Gateway) -> None:
    gw = bounded
    _reset(gw)
    ring = pool_ring(gw.policy, "default")
    home = ring.home(key_point("s:hot"))
    for m in gw.sims:
        m.set(stall_s=3.0)  # every request held: the load is what is in flight
    n = 40
    results: list[requests.Response | None] = [None] * n

    def send(i: int) -> None:
        results[i] = gw.chat("the same system prompt " * 20, max_tokens=1, headers={"X-Session-Id": "hot"})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # one pick after the other (two picks at once may both see the old load)
    _wait(lambda: sum(m.inflight for m in gw.sims) == n, 5, "every request held by an engine")
    loads = _loads(gw)
    mean = sum(loads.values()) / len(loads)
    assert max(loads.values()) <= 1.3 * mean, loads
    for t in threads:
        t.join()
    assert all(r is not None and r.status_code == 200 for r in results)
    served = [r.headers["X-Kvgate-Node"] for r in results if r is not None]
    away = sum(1 for node in served if node != home)
    assert away > n // 2  # with chash every one would be on the home
    _zero(gw, "held requests")
    _wait(lambda: len(_log(gw)) >= n, 5, "the request log")
    log = _log(gw)
    assert sum(1 for e in log if e["spill"] == "bound") == away
    assert all(e["home"] == home for e in log)
    assert all((e["spill"] == "bound") == (e["node"] != home) for e in log)
    gw.wait_metric(SPILL, away, node=home)


def test_saturated_queue_skips_the_home_and_a_stale_report_is_unknown(bounded: Gateway) -> None:
    gw = bounded
    _reset(gw)
    ring = pool_ring(gw.policy, "default")
    s = "queued"
    walk = list(ring.walk(key_point("s:" + s)))
    home = walk[0]
    client = gw.redis.client() if gw.redis else None
    assert client is not None

    def report(waiting: int, age_s: float) -> None:
        # what the control plane writes at each agent report (interval 2 s)
        client.hset(keys.node_load_key("default"), home,
                    keys.node_load_value(time.time() - age_s, 2, waiting, 1, 0.5))

    def node() -> str:
        r = gw.chat("q", max_tokens=1, headers={"X-Session-Id": s})
        assert r.status_code == 200
        _zero(gw, "a request")
        return r.headers["X-Kvgate-Node"]

    assert node() == home
    report(9, 0)  # over saturated_queue 4
    _wait(lambda: node() == walk[1], 5, "the saturated home skipped")
    _wait(lambda: any(e["spill"] == "queue" and e["node"] == walk[1] and e["home"] == home for e in _log(gw)),
          5, "the spill logged")
    assert all(e["spill"] in ("", "queue") for e in _log(gw))
    report(9, 7)  # older than 3 intervals: unknown, not saturated
    _wait(lambda: node() == home, 5, "a stale report ignored")


def _abort(gw: Gateway, body: bytes) -> None:
    """Send a request and close the connection before the answer (a client abort)."""
    host, port = gw.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Session-Id: abort\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)


def test_load_released_exactly_on_every_path(bounded: Gateway) -> None:
    gw = bounded
    _reset(gw)
    # streams, to the end
    for i in range(6):
        r = requests.post(gw.url + "/v1/chat/completions", timeout=10, stream=True,
                          json={"model": "m", "stream": True, "messages": [{"role": "user", "content": f"s{i}"}]},
                          headers={"X-Session-Id": f"st{i}"})
        assert r.status_code == 200
        assert b"[DONE]" in b"".join(r.iter_content(None))
    _zero(gw, "streams")
    # client aborts while the engine holds the request
    for m in gw.sims:
        m.set(stall_s=1.0)
    for _ in range(4):
        _abort(gw, b'{"model": "m", "messages": [{"role": "user", "content": "bye"}]}')
    _zero(gw, "client aborts")
    for m in gw.sims:
        m.set(stall_s=0.0)
    # failovers: the key's home answers 503 once, the next node serves (3 keys of 3 homes: a
    # failed node is marked for 10 s and skipped, so each key's home must be a fresh one)
    ring = pool_ring(gw.policy, "default")
    sessions: dict[str, str] = {}
    for i in range(200):
        sessions.setdefault(ring.home(key_point(f"s:fo{i}")), f"fo{i}")
    for home, s in list(sessions.items())[:3]:
        first = next(m for m in gw.sims if m.node_id == home)
        first.script(Behaviour(status=503))
        r = gw.chat("failover", max_tokens=1, headers={"X-Session-Id": s})
        assert r.status_code == 200 and r.headers["X-Kvgate-Node"] != home
    _wait(lambda: gw.metric_sum("kvgate_failovers_total") >= 3, 5, "3 failovers counted")
    _zero(gw, "failovers")
    # errors: a 500 reaches the client; every node failing (nginx's own 502)
    for m in gw.sims:
        m.set(status=500)
    assert gw.chat("err", max_tokens=1, headers={"X-Session-Id": "e1"}).status_code == 500
    for m in gw.sims:
        m.set(status=503)
    assert gw.chat("err", max_tokens=1, headers={"X-Session-Id": "e2"}).status_code in (502, 503)
    _zero(gw, "errors")
