"""Issue 3 acceptance: an engine killed under load, warm-up of a joining node, the agent
without a GPU, and a bad policy through the API — real nginx, Redis, simulators, agents,
control plane, the `openai` client and the `kvgate` CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import openai
import pytest
import requests

from ctlfixtures import MODEL, stream_chat

pytestmark = pytest.mark.integration


def _keys_by_node(fleet, n: int = 60) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for i in range(n):
        key = f"key-{i}"
        out.setdefault(fleet.route(key), []).append(key)
    return out


def test_engine_killed_under_load(control_fleet):
    fleet = control_fleet(n=3, sim="time_scale: 0.5", extra="weights: {dynamic: false}")
    by_node = _keys_by_node(fleet)
    victim = "n2"
    others = [k for n, ks in by_node.items() if n != victim for k in ks]
    assert by_node.get(victim) and others

    client = openai.AsyncOpenAI(base_url=fleet.gateway + "/v1", api_key="x", max_retries=0, timeout=60)
    doomed: list[dict] = []

    async def long_streams() -> None:
        # 400 tokens × 20 ms × 0.5 = 4 s each: still streaming when the engine dies
        doomed.extend(await asyncio.gather(*[stream_chat(client, k, 400) for k in by_node[victim][:8]]))

    runner = threading.Thread(target=lambda: asyncio.run(long_streams()))
    runner.start()
    deadline = time.monotonic() + 20
    while fleet.engine_counter(victim, "vllm:num_requests_running") < len(by_node[victim][:8]):
        assert time.monotonic() < deadline, "the streams never started on the victim"
        time.sleep(0.05)
    time.sleep(0.3)  # first tokens are out: the response headers reached the clients

    pid = int((fleet.run_dir / "pids" / f"sim-{victim}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # new requests keep succeeding, the victim's keys included (failover to the next node)
    fresh = [requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                           headers={"X-Session-Id": k, "Cache-Control": "no-store"},
                           json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
             for k in by_node[victim][:5] + others[:10]]
    assert [r.status_code for r in fresh] == [200] * len(fresh), [r.text for r in fresh if r.status_code != 200]
    assert all(r.headers["X-Kvgate-Node"] != victim for r in fresh)

    runner.join(timeout=30)
    assert not runner.is_alive(), "a stream on the dead node hangs"
    assert len(doomed) == 8
    for r in doomed:
        assert r["error"] and "failed mid-stream" in r["error"], r
        assert r["finish"] is None and r["tokens"] < 400
        assert r["seconds"] < 15

    ejected = fleet.wait_state(victim, "ejected", timeout=15)
    took = time.monotonic() - killed_at
    # eject_after 2 × probe_interval_s 0.5, plus a tick and a probe timeout
    assert took <= 2 * 0.5 + 2.5, f"ejected after {took:.1f}s"
    assert "failed health checks" in ejected["reason"]
    assert fleet.weight_in_force(victim) == 0
    print(f"ejected {took:.1f}s after the kill: {ejected['reason']}")

    # restarted (kvgate up starts the missing simulator): warming → ramping → active
    up = fleet.kvgate("up", str(fleet.policy_path))
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"sim-{victim}    started" in up.stdout
    fleet.wait_state(victim, "active", timeout=40)
    moves = [(e["data"]["from_state"], e["data"]["to_state"]) for e in reversed(fleet.events(node=victim, kind="state"))]
    assert moves == [("active", "ejected"), ("ejected", "warming"), ("warming", "ramping"), ("ramping", "active")], moves
    warm_reason = next(e for e in fleet.events(node=victim, kind="state") if e["data"]["to_state"] == "warming")
    # the agent's first report of the new engine may come after the recovery: either way the
    # node goes through warming (an unknown cache counts as empty)
    assert "engine restarted" in warm_reason["message"] or "cannot tell" in warm_reason["message"]
    assert {k: fleet.route(k) for k in by_node[victim]} == {k: victim for k in by_node[victim]}


SYSTEM = " ".join(f"rule{i}" for i in range(3000))  # ~3000 tokens of shared system prompt


def test_warmup_halves_ttft_of_a_joining_node(control_fleet):
    pool_extra = f"""    warmup:
      prompts:
        - name: support-system-prompt
          messages: [{{role: system, content: "{SYSTEM}"}}, {{role: user, content: "hello"}}]
      hot_prefixes: 4
      capture_prefix_text: true"""
    fleet = control_fleet(n=3, start=2, pool_extra=pool_extra,
                          sim="time_scale: 1.0, prefill_s_per_token: 0.0001, decode_s_per_token: 0.001")
    fleet.wait_reports()
    # traffic with three hot conversation prefixes: the gateway logs and (opt-in) captures them
    tenants = [" ".join(f"t{t}w{i}" for i in range(600)) for t in range(3)]
    # 6, 5 and 4 turns: with 2 nginx workers, each prefix is seen twice by one of them (captured)
    for t, text in enumerate(tenants):
        for turn in range(6 - t):
            r = requests.post(fleet.gateway + "/v1/chat/completions", timeout=30, headers={"Cache-Control": "no-store"},
                              json={"model": MODEL, "max_tokens": 1, "messages": [
                                  {"role": "system", "content": text}, {"role": "user", "content": f"q{turn}"}]})
            assert r.status_code == 200, r.text
    time.sleep(1.5)  # the gateway flushes its request log every 0.5 s

    fleet.write_policy(nodes=["n1", "n2", "n3"])
    applied = fleet.kvgate("apply", str(fleet.policy_path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # `kvgate apply` does not start engines: the simulator of the new node comes from `kvgate up`
    up = fleet.kvgate("up", str(fleet.policy_path))
    assert up.returncode == 0, up.stdout + up.stderr
    node = fleet.wait_state("n3", "active", timeout=60)

    moves = [(e["data"]["from_state"], e["data"]["to_state"]) for e in reversed(fleet.events(node="n3", kind="state"))]
    assert moves == [("joining", "warming"), ("warming", "ramping"), ("ramping", "active")], moves
    result = node["warmup"]["result"]
    assert node["warmup"]["status"] == "ok", node["warmup"]
    assert result["from_policy"] == 1 and result["from_hot_prefixes"] == 3, result
    assert result["failed"] == 0 and result["sent"] == 1 + 3 + 1
    before_ms, after_ms = result["ttft_before_ms"], result["ttft_after_ms"]
    print(f"warm-up of n3: TTFT {before_ms} ms cold → {after_ms} ms warm ({before_ms / after_ms:.1f}x)")
    assert after_ms <= before_ms / 2
    # the fresh engine saw the warm-up prompts (sent directly, not through the gateway)
    assert fleet.engine_counter("n3", "vllm:prompt_tokens_total") >= 3000 + 3 * 600


def test_agent_reports_no_gpu_and_the_engine_figures(control_fleet):
    fleet = control_fleet(n=2)
    fleet.wait_reports()
    for n in fleet.api("GET", "/api/v1/nodes").json()["nodes"]:
        gpu = n["report"]["gpu"]
        assert gpu["status"] == "unavailable" and "NVML" in gpu["reason"], gpu
        engine = n["report"]["engine"]
        assert engine["healthy"] and engine["kind"] == "vllm" and engine["running"] == 0
        assert n["report_age_s"] < 5
    table = fleet.kvgate("nodes")
    assert table.returncode == 0 and table.stdout.count("no GPU") == 2, table.stdout


def test_bad_policy_through_the_api_keeps_the_running_config(control_fleet):
    fleet = control_fleet(n=2)
    conf = fleet.run_dir / "nginx" / "conf" / "nginx.conf"
    before = conf.read_bytes()
    bad = fleet.render().replace(f'url: "{fleet.node_url("n2")}"', 'url: "ftp://nowhere"')
    r = fleet.api("PUT", "/api/v1/policy", data=bad, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_policy"
    assert [i["path"] for i in err["issues"]] == ["pools[0].nodes[1].url"]
    assert conf.read_bytes() == before
    ok = requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "still up"}]})
    assert ok.status_code == 200
    assert fleet.api("GET", "/api/v1/policy").json()["version"] == 1


def test_overload_degrades_to_least_conn_and_back_and_weights_follow_load(control_fleet):
    pool_extra = "    overload: {high_queue: 3, low_queue: 0.5, for_s: 1.0}"
    fleet = control_fleet(n=3, pool_extra=pool_extra, sim="time_scale: 1.0, max_num_seqs: 2, decode_s_per_token: 0.02",
                          extra="weights: {queue_high: 4, min_factor: 0.25, change_threshold: 0.2, min_interval_s: 0}")
    fleet.wait_reports()
    conf = fleet.run_dir / "nginx" / "conf" / "nginx.conf"
    assert 'require("kvgate.balancer").balance("default")' in conf.read_text()

    client = openai.AsyncOpenAI(base_url=fleet.gateway + "/v1", api_key="x", max_retries=0, timeout=120)

    async def load() -> list[dict]:
        # 60 requests of 0.4 s on 3 engines of 2 slots: each engine queues ~8 for several seconds
        return await asyncio.gather(*[stream_chat(client, f"ov-{i}", 20) for i in range(60)])

    results: list[dict] = []
    runner = threading.Thread(target=lambda: results.extend(asyncio.run(load())))
    runner.start()
    def balancer_in_force() -> str:  # the runtime's (pushed, no reload)
        return fleet.in_force()["runtime"]["pools"]["default"]["balancer"]

    deadline = time.monotonic() + 20
    while balancer_in_force() != "least_conn":
        assert time.monotonic() < deadline, fleet.api("GET", "/api/v1/pools").json()
        time.sleep(0.1)
    assert "least_conn;" not in conf.read_text()  # every balancer runs in Lua
    # the API's snapshot is published when the tick's change is complete (the push and its
    # settle time): it may lag the gateway by that, never lead it
    deadline = time.monotonic() + 5
    while not (pools := fleet.api("GET", "/api/v1/pools").json()["pools"])[0]["degraded"]:
        assert time.monotonic() < deadline, pools
        time.sleep(0.05)
    assert pools[0]["degraded"] and pools[0]["balancer_in_force"] == "least_conn"
    runner.join(timeout=120)
    assert len(results) == 60 and not [r for r in results if r["error"]]

    deadline = time.monotonic() + 20
    while balancer_in_force() != "chash":
        assert time.monotonic() < deadline, "the pool never returned to chash"
        time.sleep(0.1)
    assert 'require("kvgate.balancer").balance("default")' in conf.read_text()
    switches = [e["data"]["to"] for e in reversed(fleet.events(kind="degrade"))]
    assert switches == ["least_conn", "chash"], switches
    metrics = fleet.api("GET", "/metrics").text
    assert 'kvgate_control_degrade_switches_total{pool="default",to="least_conn"} 1.0' in metrics

    # under the queue the load factor cut the target weights; idle again, they came back
    weight_events = [e for e in reversed(fleet.events(kind="weight"))]
    assert any(e["data"]["new"] < e["data"]["old"] for e in weight_events), weight_events
    deadline = time.monotonic() + 20
    while any(n["target_weight"] != 100 for n in fleet.api("GET", "/api/v1/nodes").json()["nodes"]):
        assert time.monotonic() < deadline, fleet.api("GET", "/api/v1/nodes").json()
        time.sleep(0.2)


def test_ramp_holds_while_the_node_queues_and_then_completes(control_fleet):
    fleet = control_fleet(n=2, sim="time_scale: 1.0, max_num_seqs: 1, decode_s_per_token: 0.02",
                          extra="weights: {dynamic: false}\n" + "ramp: {steps: [0.25, 0.5, 1.0], step_interval_s: 1.0, max_queue: 2}")
    fleet.wait_reports()
    assert fleet.kvgate("drain", "n2", "--wait").returncode == 0
    # a queue on n2's engine (straight to it: 16 requests of 0.8 s, one at a time)
    flood = [threading.Thread(target=requests.post, args=(fleet.node_url("n2") + "/v1/completions",),
                              kwargs={"json": {"model": MODEL, "prompt": "q", "max_tokens": 40}, "timeout": 60})
             for _ in range(16)]
    for t in flood:
        t.start()
    time.sleep(1.2)  # the agent reports the queue (every 0.5 s)
    assert fleet.kvgate("undrain", "n2").returncode == 0
    held = None
    deadline = time.monotonic() + 20
    while held is None:
        assert time.monotonic() < deadline, (fleet.node("n2")["state"], fleet.node("n2")["reason"],
                                             [e["message"] for e in fleet.events(node="n2")][:8])
        held = next(iter(fleet.events(node="n2", kind="ramp_held")), None)
        time.sleep(0.1)
    assert "waiting > 2" in held["message"] and "ramp held at 25%" in held["message"]
    assert fleet.node("n2")["state"] == "ramping"
    for t in flood:
        t.join()
    fleet.wait_state("n2", "active", timeout=30)


# ------------------------------------------------------------------ passive health (issue 9, item 9)
def _chat_key(fleet, key: str) -> requests.Response:
    return requests.post(fleet.gateway + "/v1/chat/completions", timeout=30,
                         headers={"X-Session-Id": key, "Cache-Control": "no-store"},
                         json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})


def _until_state(fleet, node_id: str, state: str, keys: list[str], timeout: float = 30) -> list[int]:
    """Send requests with ``keys`` (round robin) until ``node_id`` is in ``state``; their statuses."""
    statuses: list[int] = []
    deadline = time.monotonic() + timeout
    i = 0
    while fleet.node(node_id)["state"] != state:
        assert time.monotonic() < deadline, (fleet.node(node_id), statuses[-20:])
        for _ in range(5):
            statuses.append(_chat_key(fleet, keys[i % len(keys)]).status_code)
            i += 1
    return statuses


def test_a_node_answering_500_to_everything_is_ejected_and_comes_back(control_fleet, start_mocks):
    # n3 is an engine whose /health is fine but which answers 500 to every completion: probes
    # never fail it and 500 does not fail over, so before passive health it kept its keys forever
    [mock] = start_mocks(1, prefix="bad")
    fleet = control_fleet(n=3, external={"n3": mock.url}, extra="weights: {dynamic: false}")
    every = [f"p{i}" for i in range(80)]
    keys = [k for k in every if fleet.route(k) == "n3"][:8]
    assert keys
    mock.set(status=500)
    seen = _until_state(fleet, "n3", "ejected", keys)
    # health.passive defaults: min_requests 20, max_5xx_ratio 0.5 (judged every probe round)
    assert seen.count(500) >= 20, seen
    n3 = fleet.node("n3")
    assert "5xx" in n3["reason"] and "gateway" in n3["reason"], n3["reason"]
    # its keys now go to the other nodes and succeed
    after = [_chat_key(fleet, k) for k in keys]
    assert [r.status_code for r in after] == [200] * len(keys) and all(r.headers["X-Kvgate-Node"] != "n3" for r in after)

    # no traffic reaches it while ejected: it returns after recover_after good probes and is
    # judged again on fresh traffic (a ramp step's share of the keys); still answering 500, it
    # is ejected again
    fleet.wait_state("n3", "ramping", timeout=15)
    _until_state(fleet, "n3", "ejected", every)
    moves = [(e["data"]["from_state"], e["data"]["to_state"]) for e in reversed(fleet.events(node="n3", kind="state"))]
    assert moves.count(("active", "ejected")) + moves.count(("ramping", "ejected")) == 2, moves

    # fixed: it comes back, takes its keys again and stays
    mock.set(status=200)
    fleet.wait_state("n3", "ramping", timeout=15)
    served = _until_state(fleet, "n3", "active", every)
    assert 500 not in served[-10:], served
    more = [_chat_key(fleet, k).status_code for k in keys * 4]
    assert more == [200] * len(more)
    time.sleep(1.2)  # two more probe rounds on that fresh traffic
    assert fleet.node("n3")["state"] == "active"
    assert 'kvgate_control_health_checks_total{node="n3",result="fail"}' in fleet.api("GET", "/metrics").text
    for e in reversed(fleet.events(node="n3", kind="state")):
        print(f"{e['ts']:.1f} {e['message']}")


def test_passive_health_keeps_the_last_serving_node(control_fleet, start_mocks):
    [mock] = start_mocks(1, prefix="only")
    fleet = control_fleet(n=1, external={"n1": mock.url})
    mock.set(status=500)
    deadline = time.monotonic() + 20
    sent = 0
    while not fleet.events(node="n1", kind="eject_skipped"):
        assert time.monotonic() < deadline, fleet.node("n1")
        for _ in range(5):
            assert _chat_key(fleet, f"k{sent}").status_code == 500
            sent += 1
    skipped = fleet.events(node="n1", kind="eject_skipped")[0]
    assert "last serving node" in skipped["message"] and "5xx" in skipped["message"], skipped
    assert fleet.node("n1")["state"] == "active"


def test_passive_health_ejects_at_most_its_share_of_a_pool(control_fleet, start_mocks):
    # a request that fails on every engine (a poison prompt retried in a loop) follows its key
    # from node to node: passive health must not eject the pool away. Two of three nodes
    # answer 500; health.passive.max_ejected_share 0.5 of 3 nodes → at most 1 ejected at once
    bad = start_mocks(2, prefix="bad")
    fleet = control_fleet(n=3, external={"n2": bad[0].url, "n3": bad[1].url}, extra="weights: {dynamic: false}")
    every = [f"p{i}" for i in range(90)]
    keys = [k for k in every if fleet.route(k) in ("n2", "n3")][:16]
    for m in bad:
        m.set(status=500)
    seen_ejected: list[list[str]] = []
    deadline = time.monotonic() + 30
    i = 0
    while not fleet.events(kind="eject_skipped"):
        assert time.monotonic() < deadline, (fleet.states(), [e["message"] for e in fleet.events()][:5])
        for _ in range(6):
            _chat_key(fleet, keys[i % len(keys)])
            i += 1
        states = fleet.states()
        seen_ejected.append(sorted(n for n, s in states.items() if s == "ejected"))
    skipped = fleet.events(kind="eject_skipped")[0]
    assert "max_ejected_share" in skipped["message"] and "5xx" in skipped["message"], skipped
    # The eject and the skip can land in one reconciler tick, between two looks at the states:
    # the event log, in order, is the record of which nodes were ejected at the same time.
    ejected_now: set[str] = set()
    most = 0
    for e in reversed(fleet.events(kind="state")):  # newest first → oldest first
        if e["data"].get("to_state") == "ejected":
            ejected_now.add(e["node"])
        elif e["data"].get("from_state") == "ejected":
            ejected_now.discard(e["node"])
        most = max(most, len(ejected_now))
    seen_ejected.append(sorted(ejected_now))
    assert most >= 1 or any(seen_ejected), seen_ejected  # one of them was ejected ...
    assert most <= 1 and all(len(e) <= 1 for e in seen_ejected), (most, seen_ejected)  # ... never both
    assert fleet.states()["n1"] == "active"
