"""Affinity routing through the real gateway: sessions, multi-turn prefixes, failover."""

from __future__ import annotations

import collections

import requests

from gwfixtures import MODEL, Gateway


def _node(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text
    sim_node = resp.headers["X-Kvgate-Sim-Node"]
    # the gateway's debug header names the same node the engine says it is
    assert resp.headers["X-Kvgate-Node"] == sim_node
    return sim_node


def test_health_models_and_workers_in_private_prefix(fleet: Gateway) -> None:
    r = requests.get(fleet.url + "/kvgate/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["digest"] == fleet.nginx.digest
    models = requests.get(fleet.url + "/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # apply() again with the same policy is a no-op
    assert fleet.nginx.apply(fleet.policy) == "unchanged"


def test_same_session_same_node(fleet_clean: Gateway) -> None:
    nodes = set()
    for i in range(50):
        r = fleet_clean.chat(f"question {i}", headers={"X-Session-Id": "session-42"}, max_tokens=1)
        assert r.headers["X-Kvgate-Route-Key-Kind"] == "session"
        nodes.add(_node(r))
    assert len(nodes) == 1


def test_sessions_spread_over_nodes(fleet_clean: Gateway) -> None:
    counts = collections.Counter(
        _node(fleet_clean.chat("hello", headers={"X-Session-Id": f"s-{i}"}, max_tokens=1)) for i in range(30)
    )
    assert len(counts) >= 2, counts


def test_turns_of_one_chat_share_a_node_without_session(fleet_clean: Gateway) -> None:
    for conversation in range(3):
        messages = [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"Conversation {conversation}: plan a trip to Lisbon."},
        ]
        nodes = []
        for turn in range(5):
            r = fleet_clean.chat(messages, max_tokens=2)
            assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix"
            nodes.append(_node(r))
            messages = messages + [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and then step {turn + 2}?"},
            ]
        assert len(set(nodes)) == 1, nodes


def test_user_field_is_a_route_key(fleet_clean: Gateway) -> None:
    nodes = {_node(fleet_clean.chat(f"q{i}", user="alice", max_tokens=1)) for i in range(10)}
    assert len(nodes) == 1
    r = fleet_clean.chat("x", user="alice", max_tokens=1)
    assert r.headers["X-Kvgate-Route-Key-Kind"] == "user"


def test_completions_endpoint_is_routed(fleet_clean: Gateway) -> None:
    r = requests.post(fleet_clean.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix"


def test_keyed_node_killed_fails_over(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(3, prefix="f")
    gw = start_gateway(sims, start_redis())
    headers = {"X-Session-Id": "failover-session"}
    first = _node(gw.chat("hi", headers=headers, max_tokens=1))
    before = gw.metric_sum("kvgate_failovers_total")
    victim = next(s for s in sims if s.node_id == first)
    victim.stop()
    served = []
    for i in range(10):
        r = gw.chat(f"after kill {i}", headers=headers, max_tokens=1)
        assert r.status_code == 200, r.text
        served.append(_node(r))
    assert first not in served
    # the key moves to one other node (the next one on the ring), not all over
    assert len(set(served)) == 1, served
    assert gw.metric_sum("kvgate_failovers_total") > before


def test_all_nodes_down_gives_openai_error(start_sims, start_gateway) -> None:
    sims = start_sims(1, prefix="d")
    gw = start_gateway(sims, None)
    sims[0].stop()
    r = gw.chat("anyone?", max_tokens=1)
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "server_error"


def test_reload_keeps_serving(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(2, prefix="r")
    gw = start_gateway(sims, start_redis())
    assert _node(gw.chat("x", max_tokens=1))
    new_policy = gw.policy.with_balancer("round_robin")
    assert gw.nginx.apply(new_policy) == "reloaded"
    assert gw.nginx.apply(new_policy) == "unchanged"
    assert (gw.nginx.prefix / "conf/nginx.conf.last-good").read_text().count("hash $kvgate_route_key") == 1
    nodes = collections.Counter(_node(gw.chat("same prompt", max_tokens=1)) for _ in range(6))
    assert len(nodes) == 2, nodes


def test_shared_system_prompt_hot_key_is_visible(start_sims, start_gateway) -> None:
    # prefix_chars smaller than the common system prompt: every conversation gets one key
    gw = start_gateway(start_sims(2, prefix="h"), None, pool={"prefix_chars": 64})
    system = {"role": "system", "content": "You are the support bot of ACME Corp. " * 5}
    nodes = {_node(gw.chat([system, {"role": "user", "content": f"ticket {i}"}], max_tokens=1)) for i in range(8)}
    assert len(nodes) == 1
    assert gw.metric_sum("kvgate_route_key_shared_prefix_total", pool="default") == 8
    assert "prefix route keys cover only the system prompt" in (gw.nginx.prefix / "logs/error.log").read_text()
