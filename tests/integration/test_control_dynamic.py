"""Issue 10 acceptance: runtime changes are pushed to the gateway, never reloaded.

A drain, an undrain with its whole ramp, ten weight changes and a cache invalidation go from
the control plane to the gateway's internal listener (``POST /kvgate/config``) and take effect
within 2 s, with no nginx reload: the gateway's config ``loads`` (``init_by_lua`` runs, from
``GET /kvgate/config``), its ``/kvgate/health`` digest and nginx's own worker processes (a
reload replaces every worker) stay as they were. A pool added to the policy still reloads,
through the transaction. A storm of runtimes (a new one every 0.2 s for 30 s, alternating
weights and balancers) under 200 streams fails and truncates none of them.

Real nginx, Redis, simulators and the control plane (``kvgate up``); mock engines where a
stream's full content must be known.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import requests

from ctlfixtures import MODEL, Fleet, default_template, wait_until
from mockengine import Behaviour

from kvgate.gateway import dynamic

pytestmark = pytest.mark.integration

EFFECT_S = 2.0
"""The acceptance bound: a runtime change is in force in every worker within this many seconds."""


# --------------------------------------------------------------------------- helpers
def internal(fleet: Fleet) -> tuple[str, str]:
    """The gateway's internal listener and its push secret."""
    return f"127.0.0.1:{fleet.internal_port}", (fleet.run_dir / "nginx/conf/push.secret").read_text().strip()


def in_force(fleet: Fleet) -> dict[str, Any]:
    return dynamic.current(*internal(fleet))


def workers(prefix: Path) -> list[int]:
    """nginx's worker pids under ``prefix``: a reload (or a restart) replaces every one."""
    master = int((prefix / "logs/nginx.pid").read_text())
    return sorted(c.pid for c in psutil.Process(master).children())


def gateway_view(fleet: Fleet) -> dict[str, Any]:
    """What proves "no reload": config loads, the static digest and nginx's workers."""
    return {"loads": in_force(fleet)["loads"],
            "digest": requests.get(fleet.gateway + "/kvgate/health", timeout=5).json()["digest"],
            "workers": workers(fleet.run_dir / "nginx")}


def node_weight(doc: dict[str, Any], node_id: str) -> int:
    for pool in doc["runtime"]["pools"].values():
        if node_id in pool["nodes"]:
            return pool["nodes"][node_id]["weight"]
    raise KeyError(node_id)


def within(pred: Callable[[], Any], what: str, t0: float, limit: float = EFFECT_S) -> float:
    """Poll ``pred`` until truthy; assert it happened within ``limit`` s of ``t0``; return the delay."""
    while not (ok := pred()) and time.monotonic() - t0 <= limit + 3:
        time.sleep(0.02)
    took = time.monotonic() - t0
    assert ok and took <= limit, f"{what}: not in force after {took:.2f}s (limit {limit}s)"
    return took


def routes(fleet: Fleet, keys: list[str]) -> dict[str, str]:
    return {k: fleet.route(k) for k in keys}


def put_policy(fleet: Fleet, text: str) -> dict[str, Any]:
    r = fleet.api("PUT", "/api/v1/policy", data=text.encode(), headers={"Content-Type": "application/yaml"},
                  timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ask_cached(fleet: Fleet, content: str) -> str:
    r = requests.post(fleet.gateway + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "temperature": 0, "max_tokens": 3, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.headers["X-Kvgate-Cache"]


# --------------------------------------------------------------------------- no reloads
def test_drain_ramp_weights_and_invalidation_are_pushed_not_reloaded(control_fleet):
    fleet = control_fleet(n=3, extra="weights: {dynamic: false}")
    for n in ("n1", "n2", "n3"):
        fleet.wait_state(n, "active")
    keys = [f"k{i}" for i in range(24)]
    base = routes(fleet, keys)
    before = gateway_view(fleet)
    took: dict[str, float] = {}

    # drain: the node's weight goes to 0 in force, only its keys move, at once
    victim = base["k0"]
    on_victim = [k for k in keys if base[k] == victim]
    t0 = time.monotonic()
    r = fleet.api("POST", f"/api/v1/nodes/{victim}/drain")
    assert r.status_code == 202, r.text
    took["drain"] = within(lambda: node_weight(in_force(fleet), victim) == 0
                           and all(fleet.route(k) != victim for k in on_victim), "drain", t0)
    assert routes(fleet, [k for k in keys if k not in on_victim]) == {k: base[k] for k in keys if k not in on_victim}
    fleet.wait_state(victim, "drained")

    # undrain: warm-up, then every ramp step (0.25, 0.5, 1.0 of weight 100) is pushed
    seen: list[int] = []
    r = fleet.api("POST", f"/api/v1/nodes/{victim}/undrain")
    assert r.status_code == 202, r.text

    def ramped() -> bool:
        w = node_weight(in_force(fleet), victim)
        if not seen or seen[-1] != w:
            seen.append(w)
        return w == 100 and fleet.node(victim)["state"] == "active"

    wait_until(ramped, f"{victim} ramped back to active", timeout=60)
    assert [w for w in seen if w] == [25, 50, 100], seen
    t0 = time.monotonic()
    took["undrain"] = within(lambda: routes(fleet, on_victim) == {k: victim for k in on_victim}, "undrain", t0)

    # ten weight changes (policy edits of n2's base weight): each in force, in routing, within 2 s
    other = next(n for n in ("n1", "n2", "n3") if n != victim)
    results = []
    heavy: dict[str, str] = {}
    for i in range(10):
        w = 3 if i % 2 == 0 else 1
        t0 = time.monotonic()
        results.append(put_policy(fleet, fleet.render(weights={other: w}))["result"])
        if i == 0:
            # the first change calibrates: where the keys go at weight 3, once every worker has it
            took["weight 1"] = within(lambda: node_weight(in_force(fleet), other) == 300, "weight change 1", t0)
            time.sleep(0.5)  # > the workers' 0.2 s sync
            heavy = routes(fleet, keys)
            moved = [k for k in keys if heavy[k] != base[k]]
            # a heavier node only takes keys: every key that moved went to it
            assert moved and all(heavy[k] == other for k in moved), (base, heavy)
            continue
        expected = heavy if w == 3 else base
        took[f"weight {i + 1}"] = within(lambda: node_weight(in_force(fleet), other) == w * 100
                                         and routes(fleet, keys) == expected, f"weight change {i + 1}", t0)
    assert results == ["pushed"] * 10, results

    # cache invalidation: the namespace version is pushed; a cached answer is a MISS at once
    wait_until(lambda: ask_cached(fleet, "name three rivers") == "HIT", "a cached answer", 10)
    ns = in_force(fleet)["runtime"]["cache"]["namespace_version"]
    t0 = time.monotonic()
    r = requests.post(fleet.control + "/admin/cache/invalidate", headers={"Authorization": f"Bearer {fleet.token}"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["result"] == "pushed", r.json()
    took["invalidate"] = within(lambda: in_force(fleet)["runtime"]["cache"]["namespace_version"] == ns + 1
                                and ask_cached(fleet, "name three rivers") == "MISS", "invalidation", t0)

    after = gateway_view(fleet)
    assert after == before, "a runtime change reloaded nginx"
    print("in force after: " + ", ".join(f"{k} {v:.2f}s" for k, v in took.items()))


def two_pools(fleet: Fleet, *, second: str = "", **kw: Any) -> str:
    """The default template plus, when ``second`` is a URL, a pool ``second`` with node ``x1`` there."""
    text = default_template(fleet, **kw)
    if not second:
        return text
    pool = f"""  - name: second
    models: [m2]
    nodes:
      - {{id: x1, url: "{second}", simulate: false}}
"""
    return text.replace("simulator:", pool + "simulator:", 1)


def test_a_pool_added_reloads_through_the_transaction(control_fleet, start_mocks):
    mock = start_mocks(1, prefix="x")[0]
    fleet = control_fleet(n=2, template=two_pools)
    for n in ("n1", "n2"):
        fleet.wait_state(n, "active")
    before = gateway_view(fleet)
    out = put_policy(fleet, fleet.render(second=mock.url))
    assert out["result"] == "reloaded", out
    after = gateway_view(fleet)
    assert after["loads"] == before["loads"] + 1
    assert after["digest"] != before["digest"]
    assert not set(after["workers"]) & set(before["workers"]), "a reload replaces every worker"
    # the reloaded gateway runs the current runtime from its first request (runtime.json)
    runtime = in_force(fleet)["runtime"]
    assert sorted(runtime["pools"]) == ["default", "second"]
    assert runtime["pools"]["default"]["nodes"]["n1"]["weight"] == 100
    fleet.wait_state("x1", "active")
    wait_until(lambda: node_weight(in_force(fleet), "x1") == 100, "x1 in force", 10)
    r = requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                      json={"model": "m2", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "from x1" in r.json()["choices"][0]["message"]["content"], r.text
    # and the node's warm-up and ramp after the reload were pushes again
    assert gateway_view(fleet)["loads"] == after["loads"]


# --------------------------------------------------------------------------- storm
STORM_S = 30.0
STORM_EVERY_S = 0.2
STREAMS = 200
CLIENTS = 20
CHUNKS = 20
CONTENT = re.compile(r"^answer [0-9a-f]{32} from n\d( part\d+){%d}$" % (CHUNKS - 1))


def _stream(url: str) -> dict[str, Any]:
    """One streamed chat read to its end: status, content, finish reason, [DONE] seen, error."""
    out: dict[str, Any] = {"status": None, "content": "", "finish": None, "done": False, "error": None}
    try:
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=60,
                           headers={"X-Session-Id": uuid.uuid4().hex, "Cache-Control": "no-store"},
                           json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "storm"}]}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    out["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]
                for choice in event.get("choices", []):
                    out["content"] += (choice.get("delta") or {}).get("content") or ""
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    except Exception as exc:  # counted as a failure below
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _storm_doc(i: int, node_ids: list[str]) -> dict[str, Any]:
    """Runtime number ``i`` of the storm: balancers in turn, weights cycling through 0..300 (never all 0)."""
    levels = [0, 50, 100, 300]
    weights = [levels[(i * 3 + j * 5) % len(levels)] for j in range(len(node_ids))]
    if not any(weights):
        weights[i % len(weights)] = 100
    balancer = ("chash", "round_robin", "least_conn")[i % 3]
    return {"pools": {"default": {"balancer": balancer, "nodes": {
                n: {"weight": w, "state": "active" if w else "down"} for n, w in zip(node_ids, weights)}}},
            "cache": {"namespace_version": 1}}


def test_dynamic_update_storm_under_streams(start_mocks, start_redis, start_gateway):
    # 20 pieces 0.1 s apart: each stream lasts ~2 s; 20 clients × 10 streams span the storm
    mocks = start_mocks(3, default=Behaviour(chunks=CHUNKS, chunk_delay_s=0.1))
    gw = start_gateway(mocks, start_redis())
    listen, secret = gw.policy.gateway.internal_listen, gw.nginx.push_secret()
    ids = [m.node_id for m in mocks]
    start = dynamic.current(listen, secret)
    digest = requests.get(gw.url + "/kvgate/health", timeout=5).json()["digest"]
    nginx_workers = workers(gw.nginx.prefix)

    pushed: list[int] = []
    push_errors: list[str] = []

    def storm() -> None:
        i, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < STORM_S:
            try:
                version, _ = dynamic.push(listen, secret, _storm_doc(i, ids))
                pushed.append(version)
            except dynamic.PushError as exc:
                push_errors.append(str(exc))
            i += 1
            time.sleep(STORM_EVERY_S)

    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        for _ in range(n):
            res = _stream(gw.url)
            with lock:
                results.append(res)

    pusher = threading.Thread(target=storm)
    clients = [threading.Thread(target=client, args=(STREAMS // CLIENTS,)) for _ in range(CLIENTS)]
    pusher.start()
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=STORM_S + 90)
    pusher.join(timeout=STORM_S + 10)

    assert not push_errors, push_errors[:3]
    assert len(pushed) >= STORM_S / STORM_EVERY_S * 0.8, len(pushed)
    assert pushed == sorted(pushed) and pushed[0] > start["version"]
    failed = [r for r in results if r["status"] != 200 or r["error"]]
    truncated = [r for r in results if r not in failed and not (r["done"] and r["finish"] == "stop"
                                                                and CONTENT.match(r["content"]))]
    assert len(results) == STREAMS
    assert not failed, failed[:3]
    assert not truncated, truncated[:3]
    # every stream ran while runtimes changed, and none of it reloaded nginx
    end = dynamic.current(listen, secret)
    assert end["loads"] == start["loads"] and end["version"] == pushed[-1]
    assert requests.get(gw.url + "/kvgate/health", timeout=5).json()["digest"] == digest
    assert workers(gw.nginx.prefix) == nginx_workers
    served = {m.node_id: len(m.completions()) for m in mocks}
    print(f"storm: {len(pushed)} runtimes in {STORM_S:.0f}s under {len(results)} streams; 0 failed, 0 truncated; "
          f"served {served}")


# --------------------------------------------------------------------------- Nginx.apply
def test_apply_pushes_refusals_keep_the_runtime_and_the_secret_stays(start_sims, start_gateway):
    from kvgate.nginxctl import NginxError
    from kvgate.render import Runtime

    sims = start_sims(2, prefix="a")
    gw = start_gateway(sims, None)
    listen, secret = gw.policy.gateway.internal_listen, gw.nginx.push_secret()
    secret_file = gw.nginx.prefix / "conf/push.secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    start = dynamic.current(listen, secret)
    a, b = (s.node_id for s in sims)

    # a runtime-only change is pushed: version + 1, no load, runtime.json is the one in force
    assert gw.nginx.apply(gw.policy, Runtime(weights={a: 0})) == "pushed"
    now = dynamic.current(listen, secret)
    assert now["version"] == start["version"] + 1 and now["loads"] == start["loads"]
    assert now["runtime"]["pools"]["default"]["nodes"][a] == {"weight": 0, "state": "down", "home_weight": 100}
    assert json.loads((gw.nginx.prefix / "conf/runtime.json").read_text()) == now["runtime"]
    assert all(gw.chat("where to?", max_tokens=1, headers={"X-Session-Id": f"s{i}"}).headers["X-Kvgate-Node"] == b
               for i in range(6))
    assert gw.nginx.apply(gw.policy, Runtime(weights={a: 0})) == "unchanged"

    # a runtime the gateway refuses: NginxError with its message and field; nothing changes
    with pytest.raises(NginxError, match=r"pools\.default\.nodes\.%s\.weight" % b):
        gw.nginx.apply(gw.policy, Runtime(weights={a: 0, b: 10**6}))
    assert dynamic.current(listen, secret)["version"] == now["version"]
    assert json.loads((gw.nginx.prefix / "conf/runtime.json").read_text()) == now["runtime"]

    # a static change reloads (loads + 1) with the runtime in force kept, and the same secret
    slower = gw.policy.model_copy(update={"gateway": gw.policy.gateway.model_copy(update={"read_timeout_s": 31})})
    assert gw.nginx.apply(slower, Runtime(weights={a: 0})) == "reloaded"
    after = dynamic.current(listen, secret)
    assert after["loads"] == start["loads"] + 1 and after["runtime"] == now["runtime"]
    assert gw.nginx.push_secret() == secret
    # without the secret the internal listener answers nothing
    with pytest.raises(dynamic.PushRefused, match="401"):
        dynamic.current(listen, "not-the-secret")
