"""Dynamic config (issue 10 items 1-2), pushed straight to the gateway's internal listener with
``requests`` (the control plane's push client is tested elsewhere): a real nginx with 2 workers
takes a new runtime in every worker within 2 s without a reload; a bad document is refused at its
field and the runtime in force keeps serving; a wrong or missing push secret is 401; the
round_robin and least_conn balancers route as they should (mock engines)."""

from __future__ import annotations

import copy
import hashlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from gwfixtures import MODEL, Gateway, _wait, wait_cached
from oracles.ring import key_point, pool_ring
from mockengine import MockEngine

POOL = "default"


# ---------------------------------------------------------------- helpers
def _secret(gw: Gateway) -> str:
    return (Path(gw.nginx.prefix) / "conf" / "push.secret").read_text().strip()


def _internal(gw: Gateway) -> str:
    return "http://" + gw.policy.gateway.internal_listen


def _auth(gw: Gateway) -> dict[str, str]:
    return {"Authorization": f"Bearer {_secret(gw)}"}


def _get(gw: Gateway) -> dict[str, Any]:
    # a new connection each time: either worker may answer
    r = requests.get(_internal(gw) + "/kvgate/config", headers={**_auth(gw), "Connection": "close"}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def _post(gw: Gateway, doc: Any, headers: dict[str, str] | None = None) -> requests.Response:
    body = doc if isinstance(doc, (bytes, str)) else json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return requests.post(_internal(gw) + "/kvgate/config", data=body, timeout=5,
                         headers=_auth(gw) if headers is None else headers)


def _doc(nodes: list[MockEngine], weights: dict[str, int] | None = None, balancer: str = "chash",
         namespace: int = 1, home: bool = False) -> dict[str, Any]:
    """A runtime document; ``home``: with each node's home_weight and the pool's chash_bounded
    fields at their defaults (the control plane's documents carry them since issues 10 and 11;
    without them, as an older control plane's, the gateway takes the weight and the defaults)."""
    weights = weights or {}
    doc: dict[str, Any] = {
        "pools": {POOL: {"balancer": balancer, "nodes": {
            m.node_id: {"weight": weights.get(m.node_id, 100),
                        "state": "active" if weights.get(m.node_id, 100) > 0 else "drained"}
            for m in nodes}}},
        "cache": {"namespace_version": namespace},
    }
    if home:
        for n in doc["pools"][POOL]["nodes"].values():
            n["home_weight"] = n["weight"] or 100
        doc["pools"][POOL].update({"bound_factor": 1.25, "bound_load": "prefill_tokens", "saturated_queue": 16})
    return doc


def _workers(gw: Gateway) -> set[int]:
    """Pids of the nginx master's children (its workers)."""
    master = gw.nginx.pid()
    assert master
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master:
            out.add(int(stat.parent.name))
    return out


def _every_worker_at(gw: Gateway, version: int, timeout: float = 2.0) -> float:
    """Seconds until every worker answered GET /kvgate/config routing with ``version``."""
    workers = _workers(gw)
    assert len(workers) == gw.policy.gateway.worker_processes
    t0 = time.monotonic()
    seen: set[int] = set()
    while seen != workers:
        assert time.monotonic() - t0 < timeout, f"workers at version {version} after {timeout}s: {seen} of {workers}"
        w = _get(gw)["worker"]
        if w["version"] == version:
            seen.add(w["pid"])
    return time.monotonic() - t0


def _served(gw: Gateway, session: str) -> str:
    r = requests.post(gw.url + "/v1/chat/completions", timeout=30,
                      headers={"X-Session-Id": session, "Connection": "close"},
                      json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {session}"}]})
    assert r.status_code == 200, r.text
    return r.headers["X-Kvgate-Node"]


def _health(gw: Gateway) -> dict[str, Any]:
    return requests.get(gw.url + "/kvgate/health", timeout=5).json()


# ---------------------------------------------------------------- tests
def test_a_push_takes_effect_in_every_worker_without_a_reload(start_mocks, start_gateway) -> None:
    mocks = start_mocks(3)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _get(gw)
    digest, pids, loads = _health(gw)["digest"], _workers(gw), before["loads"]
    assert before["runtime"] == _doc(mocks, home=True)  # the policy as written: chash, weight 100 each
    ring = pool_ring(gw.policy, POOL, {})
    sessions = [f"dyn-{i}" for i in range(120)]
    homed_n2 = [s for s in sessions if ring.home(key_point("s:" + s)) == "n2"]
    assert len(homed_n2) > 10
    assert {_served(gw, s) for s in homed_n2} == {"n2"}

    doc = _doc(mocks, {"n2": 0})
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    r = _post(gw, body)
    assert r.status_code == 200, r.text
    assert r.json() == {"version": before["version"] + 1, "digest": hashlib.sha256(body.encode()).hexdigest()}
    took = _every_worker_at(gw, before["version"] + 1)
    assert took < 2.0
    # n2's keys go to their next node on the ring; every other key stays
    down = pool_ring(gw.policy, POOL, {"n2": 0})
    for s in sessions[:60] + homed_n2:
        assert _served(gw, s) == down.route(key_point("s:" + s)) != "n2", s

    # no reload: same workers, same config load count, same static digest
    after = _get(gw)
    assert after["loads"] == loads and after["runtime"] == doc
    assert _health(gw)["digest"] == digest
    assert _workers(gw) == pids
    assert gw.metric_sum("kvgate_gateway_config_loads") == loads
    assert gw.metric_sum("kvgate_config_version") == before["version"] + 1
    assert gw.metric_sum("kvgate_config_pushes_total", result="ok") == 1

    # back in service: its keys come home
    r = _post(gw, _doc(mocks))
    assert r.status_code == 200, r.text
    _every_worker_at(gw, before["version"] + 2)
    assert {_served(gw, s) for s in homed_n2} == {"n2"}
    assert _workers(gw) == pids and _get(gw)["loads"] == loads


@pytest.mark.parametrize("change, param", [
    (lambda d: d["pools"][POOL]["nodes"]["n1"].update(weight=-1), f"pools.{POOL}.nodes.n1.weight"),
    (lambda d: d["pools"][POOL]["nodes"]["n1"].update(weight=1.5), f"pools.{POOL}.nodes.n1.weight"),
    (lambda d: d["pools"][POOL]["nodes"]["n1"].update(weight="100"), f"pools.{POOL}.nodes.n1.weight"),
    (lambda d: d["pools"][POOL]["nodes"].pop("n2"), f"pools.{POOL}.nodes.n2"),
    (lambda d: d["pools"][POOL]["nodes"].update(n9={"weight": 1, "state": "active"}), f"pools.{POOL}.nodes.n9"),
    (lambda d: d["pools"][POOL].update(balancer="random"), f"pools.{POOL}.balancer"),
    (lambda d: d["pools"].update(other=d["pools"][POOL]), "pools.other"),
    (lambda d: d["pools"].pop(POOL), f"pools.{POOL}"),
    (lambda d: d["cache"].update(namespace_version="2"), "cache.namespace_version"),
    (lambda d: d.update(tenants={}), "tenants"),
], ids=["negative", "fraction", "string", "node-missing", "node-unknown", "balancer", "pool-unknown",
        "pool-missing", "namespace", "unknown-field"])
def test_a_bad_document_is_refused_at_its_field_and_the_runtime_in_force_stays(
        start_mocks, start_gateway, change, param) -> None:
    mocks = start_mocks(2)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _get(gw)
    doc = copy.deepcopy(_doc(mocks, {"n2": 0}))
    change(doc)
    r = _post(gw, doc)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"]
    # not JSON, or not an object
    for body, p in ((b"{nope", None), (b"[1, 2]", None), (b'{"pools": [1]}', "pools"), (b"", None)):
        r = _post(gw, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == p, (body, r.text)
    after = _get(gw)
    assert (after["version"], after["digest"], after["runtime"]) == (before["version"], before["digest"],
                                                                      before["runtime"])
    # still routing with it: both nodes serve (the refused document had n2 down)
    assert {_served(gw, f"bad-{i}") for i in range(30)} == {"n1", "n2"}
    assert gw.metric_sum("kvgate_config_pushes_total", result="invalid") == 5
    assert gw.metric_sum("kvgate_config_pushes_total", result="ok") == 0


def test_a_wrong_or_missing_secret_is_401_and_never_logged(start_mocks, start_gateway) -> None:
    mocks = start_mocks(2)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _get(gw)
    doc = _doc(mocks, {"n2": 0})
    wrong = "wrong-" + _secret(gw)
    for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": _secret(gw)},
                    {"Authorization": "Basic " + _secret(gw)}):
        r = _post(gw, doc, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        r = requests.get(_internal(gw) + "/kvgate/config", headers=headers, timeout=5)
        assert r.status_code == 401, r.text
    assert _get(gw)["version"] == before["version"]
    assert gw.metric_sum("kvgate_config_pushes_total", result="unauthorized") == 8
    # the internal server also serves health and metrics (no secret needed there)
    assert requests.get(_internal(gw) + "/kvgate/health", timeout=5).json()["digest"] == _health(gw)["digest"]
    assert "kvgate_config_version" in requests.get(_internal(gw) + "/metrics", timeout=5).text
    assert requests.get(_internal(gw) + "/v1/models", timeout=5).status_code == 404
    # the client listener has no /kvgate/config
    r = requests.post(gw.url + "/kvgate/config", json=doc, headers=_auth(gw), timeout=5)
    assert r.status_code == 404
    logs = Path(gw.nginx.prefix) / "logs"
    for f in logs.glob("*.log"):
        text = f.read_text(errors="replace")
        assert wrong not in text and _secret(gw) not in text, f


def test_round_robin_spreads_by_weight_and_skips_weight_0(start_mocks, start_gateway) -> None:
    mocks = start_mocks(3)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    v = _get(gw)["version"]
    assert _post(gw, _doc(mocks, {"n1": 300, "n2": 100, "n3": 0}, balancer="round_robin")).status_code == 200
    _every_worker_at(gw, v + 1)
    # one session: chash would keep it on one node; round robin spreads it
    counts: dict[str, int] = {}
    for _ in range(80):
        node = _served(gw, "one-session")
        counts[node] = counts.get(node, 0) + 1
    assert set(counts) == {"n1", "n2"}, counts
    # smooth weighted round robin per worker (2 workers): 3 to 1, off by at most one turn each
    assert abs(counts["n1"] - 60) <= 4, counts
    r = gw.chat("kind?", headers={"X-Session-Id": "s1"})
    assert r.headers["X-Kvgate-Route-Key-Kind"] == "session"


def test_least_conn_sends_to_the_node_with_fewer_in_flight(start_mocks, start_gateway) -> None:
    n1, n2 = start_mocks(2)
    gw = start_gateway([n1, n2], None, cache={"enabled": False})
    v = _get(gw)["version"]
    assert _post(gw, _doc([n1, n2], {"n2": 0}, balancer="least_conn")).status_code == 200
    _every_worker_at(gw, v + 1)
    n1.set(stall_s=60)
    # a request held at n1 (no answer yet) on a raw connection, closed by the test when done
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "held"}]}).encode()
    host, port = gw.listen.rsplit(":", 1)
    held = socket.create_connection((host, int(port)), timeout=10)
    try:
        held.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Session-Id: h\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # the held request counts on n1 from the balancer's pick (before any answer)
        _wait(lambda: gw.metric_sum("kvgate_upstream_inflight", node="n1") == 1, 3, "n1 in flight")
        # and n1 holds it: the request reached the engine before the test goes on
        _wait(lambda: n1.inflight == 1, 5, "the held request at n1")
        assert _post(gw, _doc([n1, n2], {"n1": 300, "n2": 100}, balancer="least_conn")).status_code == 200
        _every_worker_at(gw, v + 2)
        # 1 in flight on n1 (1/300) against 0 on n2: every new request goes to n2, whichever worker
        assert {_served(gw, f"lc-{i}") for i in range(20)} == {"n2"}
    finally:
        held.close()
    n1.set(stall_s=0)
    # the client went away: the log phase released its count
    _wait(lambda: gw.metric_sum("kvgate_upstream_inflight") == 0, 5, "nothing in flight")


def test_least_conn_ties_share_by_weight(start_mocks, start_gateway) -> None:
    # nothing in flight: ties share by weight. (This ran at the end of the test above; under load
    # a request there found a node still counted by the request before it, because in-flight
    # counts ended in the log phase, after a lingering close. They end at the answer's last byte
    # since 85688fd: tests/integration/test_gateway_inflight_release.py.)
    n1, n2 = start_mocks(2)
    gw = start_gateway([n1, n2], None, cache={"enabled": False})
    v = _get(gw)["version"]
    assert _post(gw, _doc([n1, n2], {"n1": 300, "n2": 100}, balancer="least_conn")).status_code == 200
    _every_worker_at(gw, v + 1)
    counts: dict[str, int] = {}
    for i in range(40):
        node = _served(gw, f"tie-{i}")
        counts[node] = counts.get(node, 0) + 1
    assert counts.get("n1", 0) > counts.get("n2", 0) > 0, (counts, gw.nginx.error_log_tail(40))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_pool_with_one_node_taking_traffic_passes_its_503_on(start_mocks, start_gateway, host) -> None:
    # the server lines carry no `down` any more: the balancer takes the retry away itself (one
    # server line per node, the resolved peer, also for a name with IPv4 and IPv6 addresses)
    n1, n2 = start_mocks(2)
    gw = start_gateway([n1, n2], None, cache={"enabled": False},
                       pool={"nodes": [{"id": m.node_id, "url": f"http://{host}:{m.port}"} for m in (n1, n2)]})
    v = _get(gw)["version"]
    for balancer in ("chash", "round_robin", "least_conn"):
        assert _post(gw, _doc([n1, n2], {"n2": 0}, balancer=balancer)).status_code == 200
        v += 1
        _every_worker_at(gw, v)
        n1.clear()
        n1.set(status=503)
        r = gw.chat("busy?", headers={"X-Session-Id": "s1"})
        assert r.status_code == 503, (balancer, r.text)
        assert r.json()["error"]["message"] == "mock n1 answers 503", r.text
        assert len(n1.completions()) == 1 and not n2.completions()
        n1.set(status=200)
        assert gw.chat("fine", headers={"X-Session-Id": "s1"}).status_code == 200


def test_a_node_failing_fails_over_once_and_is_skipped_by_every_balancer(start_mocks, start_gateway) -> None:
    n1, n2, n3 = start_mocks(3)
    gw = start_gateway([n1, n2, n3], None, cache={"enabled": False})
    v = _get(gw)["version"]
    for balancer in ("round_robin", "least_conn"):
        assert _post(gw, _doc([n1, n2, n3], balancer=balancer)).status_code == 200
        v += 1
        _every_worker_at(gw, v)
        n2.set(status=502)
        n2.clear()
        served = [_served(gw, f"{balancer}-{i}") for i in range(30)]
        assert "n2" not in served
        # n2 tried at most once per worker, then marked failed for every worker (kvgate_state)
        assert 1 <= len(n2.completions()) <= gw.policy.gateway.worker_processes, balancer
        n2.set(status=200)
        # a node back in service (weight 0 -> > 0) forgets its mark
        assert _post(gw, _doc([n1, n2, n3], {"n2": 0}, balancer=balancer)).status_code == 200
        assert _post(gw, _doc([n1, n2, n3], balancer=balancer)).status_code == 200
        v += 2
        _every_worker_at(gw, v)
        _wait(lambda: "n2" in {_served(gw, f"back-{balancer}-{i}") for i in range(6)}, 3, "n2 back")
    assert gw.metric_sum("kvgate_upstream_inflight") == 0


def test_a_reload_keeps_the_pushed_runtime_from_runtime_json(start_mocks, start_gateway) -> None:
    # config.init seeds a (re)loading gateway from conf/runtime.json: no window with stale weights
    mocks = start_mocks(2)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _get(gw)
    doc = _doc(mocks, {"n2": 0}, balancer="round_robin", namespace=7)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    (Path(gw.nginx.prefix) / "conf" / "runtime.json").write_text(body)
    gw.nginx.reload()
    _wait(lambda: _get(gw)["loads"] == before["loads"] + 1, 10, "the reload's config load")
    after = _get(gw)
    assert after["runtime"] == doc and after["digest"] == hashlib.sha256(body.encode()).hexdigest()
    assert after["version"] > before["version"]
    # the old workers leave once idle; the new ones run the runtime.json's runtime from the start
    _wait(lambda: len(_workers(gw)) == gw.policy.gateway.worker_processes, 10, "the old workers to exit")
    _every_worker_at(gw, after["version"], timeout=10)
    assert {_served(gw, f"r-{i}") for i in range(10)} == {"n1"}


def test_a_pushed_namespace_version_invalidates_the_cache_without_a_reload(start_mocks, start_redis,
                                                                          start_gateway) -> None:
    mocks = start_mocks(2)
    gw = start_gateway(mocks, start_redis())
    before = _get(gw)
    ns = before["runtime"]["cache"]["namespace_version"]

    def ask() -> requests.Response:
        r = gw.chat("Name three rivers.", temperature=0, headers={"Connection": "close"})
        assert r.status_code == 200, r.text
        return r

    assert ask().headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    assert ask().headers["X-Kvgate-Cache"] == "HIT"
    assert _post(gw, _doc(mocks, namespace=ns + 1)).status_code == 200
    _every_worker_at(gw, before["version"] + 1)
    # the old entries are out of reach in every worker: a miss, then the new namespace's hit
    assert ask().headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 2)
    for _ in range(4):
        assert ask().headers["X-Kvgate-Cache"] == "HIT"
    assert _get(gw)["loads"] == before["loads"]


def test_pushes_every_100ms_under_streams_fail_and_truncate_nothing(start_mocks, start_gateway) -> None:
    # the balancer layer under a storm of runtimes (balancer and weights changing under requests
    # between their tries); the control plane's own storm test drives it through Nginx.apply
    mocks = start_mocks(3)
    for m in mocks:
        m.set(chunks=8, chunk_delay_s=0.1)
    # a Python mock on a loaded machine may accept late: no failover for a slow accept
    gw = start_gateway(mocks, None, cache={"enabled": False}, gateway={"connect_timeout_s": 5})
    v0 = _get(gw)["version"]
    stop = threading.Event()
    pushed: list[int] = []

    def storm() -> None:
        balancers = ("chash", "round_robin", "least_conn")
        i = 0
        while not stop.is_set():
            i += 1
            weights = {m.node_id: (i * 37 + k * 50) % 300 + 1 for k, m in enumerate(mocks)}
            weights[mocks[i % 3].node_id] = 0  # one node out at a time
            r = _post(gw, _doc(mocks, weights, balancer=balancers[i % 3]))
            assert r.status_code == 200, r.text
            pushed.append(r.json()["version"])
            time.sleep(0.1)

    def stream(i: int) -> tuple[int, bool]:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"storm {i}"}]}
        with requests.post(gw.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"st-{i}"},
                           stream=True, timeout=30) as r:
            raw = b"".join(r.iter_content(None))
        return r.status_code, raw.rstrip().endswith(b"data: [DONE]")

    pusher = threading.Thread(target=storm)
    pusher.start()
    try:
        # 12 at a time: the mock engine's listen backlog is socketserver's 5
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(stream, range(60)))
    finally:
        stop.set()
        pusher.join(10)
    assert len(pushed) >= 10 and pushed == list(range(v0 + 1, v0 + 1 + len(pushed)))
    assert [s for s, _ in results].count(200) == len(results), results
    assert all(done for _, done in results), "a stream ended without [DONE]"
    _every_worker_at(gw, pushed[-1])
    _wait(lambda: gw.metric_sum("kvgate_upstream_inflight") == 0, 5, "nothing in flight")
    assert gw.metric_sum("kvgate_failovers_total") == 0


def test_a_document_larger_than_the_dict_holds_is_refused_and_the_runtime_in_force_stays(
        start_mocks, start_gateway) -> None:
    """Review of issue 10: a node state is a free string, so a document near the body limit
    (4 MiB) passed check_runtime, and storing it in the 4m kvgate_config dict evicted the runtime
    in force, its version and the load count (shared-dict set() evicts to make room, then fails):
    GET answered 503 and the reload proof was gone. A state is a short name now, and the store
    never evicts (safe_set): the document is refused and the runtime in force stays."""
    mocks = start_mocks(2)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _get(gw)
    doc = _doc(mocks)
    doc["pools"][POOL]["nodes"]["n1"]["state"] = "x" * (4 * 1024 * 1024 - 8192)
    r = _post(gw, doc)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == f"pools.{POOL}.nodes.n1.state", r.text[:300]
    after = _get(gw)
    assert (after["version"], after["digest"], after["loads"], after["runtime"]) == (
        before["version"], before["digest"], before["loads"], before["runtime"])
    assert {_served(gw, f"big-{i}") for i in range(30)} == {"n1", "n2"}
    # a valid document padded past what the dict holds: refused by the store, nothing evicted
    body = json.dumps(_doc(mocks, {"n2": 0}))[:-1] + " " * (4 * 1024 * 1024 - 8192) + "}"
    r = _post(gw, body)
    assert r.status_code == 500 and r.json()["error"]["code"] == "store_failed", r.text[:300]
    after = _get(gw)
    assert (after["version"], after["digest"], after["loads"]) == (before["version"], before["digest"],
                                                                   before["loads"])
    # and the next push is a new version every worker takes (it once reused the lost version 1)
    r = _post(gw, _doc(mocks, {"n2": 0}))
    assert r.status_code == 200 and r.json()["version"] == before["version"] + 1, r.text
    _every_worker_at(gw, before["version"] + 1)
    assert {_served(gw, f"big-after-{i}") for i in range(20)} == {"n1"}
