"""Gateways as members of one policy (issue 17 items 1 and 2, docs/scale-out.md), with the real
``kvgate up``: the control plane drives the first member's nginx, a ``kvgate gateway`` supervisor
the second's. Identical routing from both, before and after a drain, a weight change and an
undrain; one member killed and restarted (lost, then caught up before its first answer); the
response cache and a tenant's rpm shared by both.

The timing figures (how long the second member took to run what the first runs) are printed:
``pytest -s`` shows them.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import socket
import threading
import time
from contextlib import closing
from typing import Any

import psutil
import pytest
import requests

from ctlfixtures import MODEL, Fleet, default_template, wait_until
from kvgate.gateway import dynamic
from test_gateway_limits import post

pytestmark = pytest.mark.integration

KEYS = 1000


def port_in_range(lo: int = 29000, hi: int = 29999) -> int:
    """A free loopback port in the tests' own range (never one a demo uses)."""
    for port in random.Random(os.getpid() ^ time.monotonic_ns()).sample(range(lo, hi), 200):
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 29000-29999")


GW2_PORTS = (port_in_range(), port_in_range())


def two_gateways(fleet: Fleet, *, cache_off: bool = False, **kw: Any) -> str:
    """The control fleet's policy with a second member, auth optional and a limited tenant
    (``cache_off``: the response cache turned off, a static change every answer shows)."""
    text = default_template(fleet, gateway_extra=", auth: optional", **kw)
    # an apply waits 1.5 s for the members: less than the 3 s after which a silent one is lost
    text = text.replace("report_interval_s: 0.5}", "report_interval_s: 0.5, gateway_sync_timeout_s: 1.5}")
    assert "gateway_sync_timeout_s" in text
    if cache_off:
        text += "\ncache: {enabled: false}\n"
    p2, i2 = GW2_PORTS
    return text + f"""
gateways:
  - {{id: gw1, listen: "127.0.0.1:{fleet.gateway_port}", internal_listen: "127.0.0.1:{fleet.internal_port}"}}
  - {{id: gw2, listen: "127.0.0.1:{p2}", internal_listen: "127.0.0.1:{i2}"}}
tenants:
  - {{id: default}}
  - {{id: rpm60, limits: {{rpm: 60}}}}
"""


@pytest.fixture(scope="module")
def fleet(control_fleet_module) -> Fleet:
    f = control_fleet_module(n=3, template=two_gateways)
    f.wait_reports()
    return f


def gw2_url() -> str:
    return f"http://127.0.0.1:{GW2_PORTS[0]}"


def gw2_prefix(fleet: Fleet):
    return fleet.run_dir / "gateways" / "gw2" / "nginx"


def in_force(fleet: Fleet, member: str) -> dict[str, Any]:
    if member == "gw1":
        return fleet.in_force()
    secret = (gw2_prefix(fleet) / "conf/push.secret").read_text().strip()
    return dynamic.current(f"127.0.0.1:{GW2_PORTS[1]}", secret)


def same_runtime(fleet: Fleet) -> bool:
    try:
        return in_force(fleet, "gw1")["digest"] == in_force(fleet, "gw2")["digest"]
    except dynamic.PushError:
        return False


def route(base: str, key: str) -> requests.Response:
    return requests.post(base + "/v1/chat/completions", timeout=30,
                         headers={"X-Session-Id": key, "Cache-Control": "no-store"},
                         json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})


def cacheable(base: str) -> requests.Response:
    """A deterministic request (temperature 0): cached unless the cache is off (BYPASS)."""
    return requests.post(base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "temperature": 0, "max_tokens": 2, "messages": [{"role": "user", "content": "same"}]})


def routes(fleet: Fleet, keys: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """key → node from each member (8 clients at once)."""
    def both(key: str) -> tuple[str, str]:
        a, b = route(fleet.gateway, key), route(gw2_url(), key)
        assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
        return a.headers["X-Kvgate-Node"], b.headers["X-Kvgate-Node"]

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(both, keys))
    return {k: g[0] for k, g in zip(keys, got)}, {k: g[1] for k, g in zip(keys, got)}


def settled(fleet: Fleet) -> None:
    """Wait until both members run the same runtime and it stays so for a moment."""
    wait_until(lambda: same_runtime(fleet), "both members on one runtime", timeout=20)
    # every worker of a gateway takes a pushed runtime within its sync timer (0.2 s,
    # lua/kvgate/config.lua); the internal listener's worker may answer before the others have it
    time.sleep(0.5)


def propagation_s(fleet: Fleet, t0: float) -> float:
    """Seconds from ``t0`` (the first member runs the change) until the second runs it too."""
    target = in_force(fleet, "gw1")["digest"]
    wait_until(lambda: in_force(fleet, "gw2")["digest"] == target, "gw2 on gw1's runtime", timeout=10)
    return time.monotonic() - t0


def failovers(fleet: Fleet) -> float:
    """kvgate_failovers_total summed over both members (their internal listeners' /metrics)."""
    total = 0.0
    for port in (fleet.internal_port, GW2_PORTS[1]):
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("kvgate_failovers_total"))
    return total


def assert_same_routes(fleet: Fleet, keys: list[str], what: str) -> dict[str, int]:
    for attempt in range(3):
        settled(fleet)
        before = (in_force(fleet, "gw1")["digest"], in_force(fleet, "gw2")["digest"])
        failed_before = failovers(fleet)
        a, b = routes(fleet, keys)
        after = (in_force(fleet, "gw1")["digest"], in_force(fleet, "gw2")["digest"])
        if before[0] != before[1] or after != before:
            # the reconciler changed a weight meanwhile (a ramp step, a load-driven weight): the
            # second member follows ~0.1 s later, so measure again on one runtime at both
            continue
        differ = [k for k in keys if a[k] != b[k]]
        if differ and failovers(fleet) - failed_before >= len(differ):
            # a failover (a node's first answer after its undrain refused on a pooled connection)
            # sent these past their node at one gateway: not the ring's choice; measure again
            print(f"{what}: {len(differ)} key(s) failed over meanwhile, measured again")
            continue
        assert not differ, f"{what}: {len(differ)} of {len(keys)} keys on different nodes, e.g. " \
            f"{[(k, a[k], b[k]) for k in differ[:5]]}"
        counts: dict[str, int] = {}
        for n in a.values():
            counts[n] = counts.get(n, 0) + 1
        print(f"{what}: {len(keys)} keys, the same node from both gateways; per node {sorted(counts.items())}")
        return counts
    raise AssertionError(f"{what}: the runtime kept changing under the measurement")


def gateways_view(fleet: Fleet) -> dict[str, dict[str, Any]]:
    r = fleet.api("GET", "/api/v1/gateways")
    assert r.status_code == 200, r.text
    return {g["id"]: g for g in r.json()["gateways"]}


def test_both_members_run_the_policy_and_are_in_sync(fleet: Fleet) -> None:
    view = wait_until(lambda: (v := gateways_view(fleet)) and all(g["in_sync"] for g in v.values()) and v,
                      "both members in sync", timeout=20)
    assert set(view) == {"gw1", "gw2"}
    assert view["gw1"]["local"] and not view["gw2"]["local"]
    version = fleet.api("GET", "/api/v1/policy").json()["version"]
    assert view["gw2"]["version"] == version and view["gw2"]["state"] == "in sync"
    assert view["gw2"]["nginx_pid"] == int((gw2_prefix(fleet) / "logs/nginx.pid").read_text())
    status = fleet.kvgate("status")
    assert "gateway-gw2" in status.stdout and "gw2" in status.stdout and "in sync" in status.stdout, status.stdout
    print(status.stdout)
    page = fleet.api("GET", "/admin/").text
    assert 'id="gateway-table"' in page and 'data-gateway="gw2"' in page
    row = page[page.index('data-gateway="gw2"'):]
    assert f'data-field="version">{version}<' in row and ">in sync<" in row[:600], row[:600]


def test_the_same_key_goes_to_the_same_node_from_both(fleet: Fleet) -> None:
    rng = random.Random(17)
    keys = [f"s-{rng.getrandbits(64):016x}" for _ in range(KEYS)]
    counts = assert_same_routes(fleet, keys, "initial")
    assert len(counts) == 3  # every node has keys: the comparison means something

    # drain: the control plane pushes to gw1 before it answers; gw2 follows through its long poll
    r = fleet.api("POST", "/api/v1/nodes/n1/drain")
    assert r.status_code == 202, r.text
    took = propagation_s(fleet, time.monotonic())
    print(f"drain n1: gw2 ran gw1's runtime {took * 1000:.0f} ms after the drain was answered")
    assert took < 1.0  # the sync interval (control.gateway_sync_s: 1 s)
    drained = assert_same_routes(fleet, keys[:300], "after the drain")
    assert "n1" not in drained

    # a weight change: a new policy version, complete when both members run it
    t0 = time.monotonic()
    r = fleet.api("PUT", "/api/v1/policy", data=fleet.render(weights={"n2": 3}).encode(),
                  headers={"Content-Type": "application/yaml"})
    assert r.status_code == 200, r.text
    body = r.json()
    took = time.monotonic() - t0
    assert body["changed"] and body["gateways"]["complete"], body
    assert body["gateways"]["laggards"] == [] and body["gateways"]["lost"] == []
    print(f"weight change (version {body['version']}): the apply answered complete in {took * 1000:.0f} ms, "
          f"of which {body['gateways']['waited_s'] * 1000:.0f} ms waiting for gw2")
    assert gateways_view(fleet)["gw2"]["version"] == body["version"]
    assert_same_routes(fleet, keys[:300], "after the weight change")

    # undrain: warming, then ramp steps (each a push to gw1, followed by gw2)
    r = fleet.api("POST", "/api/v1/nodes/n1/undrain")
    assert r.status_code == 202, r.text
    fleet.wait_state("n1", "active", timeout=30)
    took = propagation_s(fleet, time.monotonic())
    print(f"undrain n1 (active): gw2 on gw1's runtime {took * 1000:.0f} ms later")
    final = assert_same_routes(fleet, keys, "after the undrain")
    assert "n1" in final


def test_cache_and_rpm_are_shared_by_both(fleet: Fleet) -> None:
    settled(fleet)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"cache me {time.time()}"}]}
    a = requests.post(fleet.gateway + "/v1/chat/completions", json=body, timeout=30)
    assert a.status_code == 200 and a.headers["X-Kvgate-Cache"] == "MISS", a.headers
    b = wait_until(lambda: (r := requests.post(gw2_url() + "/v1/chat/completions", json=body, timeout=30))
                   and r.headers.get("X-Kvgate-Cache") == "HIT" and r, "a HIT through gw2", timeout=5)
    assert b.json()["choices"][0]["message"]["content"] == a.json()["choices"][0]["message"]["content"]

    r = fleet.api("POST", "/api/v1/keys", json={"tenant": "rpm60", "name": "members"})
    assert r.status_code == 201, r.text
    secret = r.json()["secret"]

    class Gw:  # test_gateway_limits.post's view of a gateway
        def __init__(self, url: str):
            self.url = url

    gws = [Gw(fleet.gateway), Gw(gw2_url())]
    with cf.ThreadPoolExecutor(24) as pool:
        codes = [f.result().status_code for f in
                 [pool.submit(post, gws[i % 2], secret, f"burst {i}") for i in range(120)]]
    assert sorted(set(codes)) == [200, 429], codes
    assert 60 <= codes.count(200) <= 62, codes.count(200)
    print(f"rpm 60 across both members: {codes.count(200)} of 120 accepted")


def test_an_apply_names_a_live_member_that_did_not_catch_up(fleet: Fleet) -> None:
    wait_until(lambda: gateways_view(fleet)["gw2"]["in_sync"], "gw2 in sync", timeout=20)
    sup = psutil.Process(int((fleet.run_dir / "pids/gateway-gw2.pid").read_text()))
    sup.suspend()  # SIGSTOP: its nginx serves on, the supervisor neither applies nor reports
    try:
        r = fleet.api("PUT", "/api/v1/policy", data=fleet.render(weights={"n3": 2}).encode(),
                      headers={"Content-Type": "application/yaml"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["changed"] and body["gateways"]["laggards"] == ["gw2"], body
        assert not body["gateways"]["complete"] and body["gateways"]["lost"] == []
        assert 1.5 <= body["gateways"]["waited_s"] < 3, body
        assert gateways_view(fleet)["gw2"]["state"] == "behind"
    finally:
        sup.resume()
    view = wait_until(lambda: (g := gateways_view(fleet)["gw2"]) and g["in_sync"] and g, "gw2 caught up", 10)
    assert view["version"] == body["version"]
    print(f"gw2 suspended during an apply: named as the laggard after {body['gateways']['waited_s']:.2f}s; "
          "in sync again once resumed")


def _kill_member(fleet: Fleet) -> None:
    """SIGKILL gw2's supervisor and its nginx (master and workers): a host that died."""
    sup = int((fleet.run_dir / "pids/gateway-gw2.pid").read_text())
    master = int((gw2_prefix(fleet) / "logs/nginx.pid").read_text())
    procs = [psutil.Process(sup), psutil.Process(master), *psutil.Process(master).children()]
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def test_a_killed_member_is_lost_and_catches_up_before_its_first_answer(fleet: Fleet) -> None:
    wait_until(lambda: gateways_view(fleet)["gw2"]["in_sync"], "gw2 in sync", timeout=20)
    t_kill = time.monotonic()
    _kill_member(fleet)
    # the other keeps serving
    for i in range(20):
        assert route(fleet.gateway, f"k{i}").status_code == 200
    wait_until(lambda: gateways_view(fleet)["gw2"]["lost"], "gw2 lost", timeout=15)
    print(f"gw2 killed: marked lost {time.monotonic() - t_kill:.2f}s later")
    assert any(e["kind"] == "gateway_lost" for e in fleet.events(kind="gateway"))
    metrics = fleet.api("GET", "/metrics").text
    assert 'kvgate_control_gateway_up{gateway="gw2"} 0.0' in metrics, metrics[-2000:]

    # a new version while it is down (the response cache off: a reload): not waited for
    new_text = fleet.render(cache_off=True)
    fleet.policy_path.write_text(new_text)
    r = fleet.api("PUT", "/api/v1/policy", data=new_text.encode(), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["gateways"]["lost"] == ["gw2"] and body["gateways"]["complete"], body
    assert cacheable(fleet.gateway).headers["X-Kvgate-Cache"] == "BYPASS"

    # restarted (`kvgate up` starts its supervisor again): its first answer is already the new version's
    first: dict[str, Any] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                r = cacheable(gw2_url())
            except requests.ConnectionError:
                time.sleep(0.01)
                continue
            first.update(status=r.status_code, cache=r.headers.get("X-Kvgate-Cache"), body=r.text[:300],
                         at=time.monotonic())
            return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t_up = time.monotonic()
    up = fleet.kvgate("up", str(fleet.policy_path))
    assert up.returncode == 0, up.stdout + up.stderr
    assert "gateway-gw2 started" in up.stdout, up.stdout
    watcher.join(timeout=20)
    stop.set()
    # BYPASS: the new version's (the version it ran before answers MISS or HIT)
    assert first.get("status") == 200 and first.get("cache") == "BYPASS", first
    print(f"gw2 restarted: first answer {first['at'] - t_up:.2f}s after `kvgate up`, on version {body['version']}")
    view = wait_until(lambda: (g := gateways_view(fleet)["gw2"]) and g["in_sync"] and g, "gw2 back in sync", 20)
    assert view["version"] == body["version"] and not view["lost"]
    assert any(e["kind"] == "gateway_back" for e in fleet.events(kind="gateway"))


def test_two_gateways_yaml_starts_with_kvgate_up(tmp_path) -> None:
    """policies/two-gateways.yaml as shipped, its ports moved into the tests' range (a demo may run
    on the shipped ones): `kvgate up` starts both members, `kvgate down` stops both nginx."""
    import re
    from pathlib import Path

    from gwfixtures import kvgate_cli

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "policies" / "two-gateways.yaml").read_text()
    ports: dict[str, str] = {}
    taken: set[int] = set()

    def moved(match: re.Match) -> str:
        old = match.group(1)
        if old not in ports:
            while (new := port_in_range()) in taken:
                pass
            taken.add(new)
            ports[old] = str(new)
        return "127.0.0.1:" + ports[old]

    text = re.sub(r"127\.0\.0\.1:(\d+)", moved, text)
    text = text.replace("static_answers: demo-faq.yaml", f"static_answers: {repo / 'policies' / 'demo-faq.yaml'}")
    text += f"\nsemantic_service: {{listen: 127.0.0.1:{port_in_range()}}}\n"
    policy = tmp_path / "two-gateways.yaml"
    policy.write_text(text)
    run = tmp_path / "run"
    try:
        up = kvgate_cli(run, "up", str(policy), timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "gateway-gw2 started" in up.stdout
        for port in (ports["8080"], ports["8081"]):
            r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                              headers={"X-Session-Id": "two", "Cache-Control": "no-store"},
                              json={"model": "demo-model", "max_tokens": 1,
                                    "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.headers["X-Kvgate-Node"].startswith("n"), r.text
        status = kvgate_cli(run, "status")
        assert status.returncode == 0, status.stdout
        assert re.search(r"gw2\s+in sync", status.stdout), status.stdout
    finally:
        down = kvgate_cli(run, "down")
    assert "gateway-gw2 stopped" in down.stdout, down.stdout
    assert not (run / "gateways/gw2/nginx/logs/nginx.pid").exists()
