"""Affinity routing through the real gateway: sessions, multi-turn prefixes, failover."""

from __future__ import annotations

import collections
import http.server
import threading
from dataclasses import dataclass
from typing import Iterator

import pytest
import requests

from gwfixtures import MODEL, Gateway, free_port


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
    # the balancer alone is the runtime's (pushed); with a static change it goes through a reload
    new_policy = gw.policy.with_balancer("round_robin")
    new_policy = new_policy.model_copy(update={"gateway": new_policy.gateway.model_copy(update={"read_timeout_s": 31})})
    assert gw.nginx.apply(new_policy) == "reloaded"
    assert gw.nginx.apply(new_policy) == "unchanged"
    assert (gw.nginx.prefix / "conf/nginx.conf.last-good").read_text().count('require("kvgate.balancer").balance(') == 1
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


@dataclass
class _Backend:
    """A node entry for make_policy: only ``node_id`` and ``url`` are read."""

    node_id: str
    url: str


class _Always503(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    posts = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).posts += 1
        body = b'{"error":{"message":"overloaded","type":"server_error","code":null,"param":null}}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def node_503() -> Iterator[_Backend]:
    """A node that reads each POST and answers 503 (an overloaded engine)."""
    handler = type("Handler", (_Always503,), {"posts": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    backend = _Backend("busy", f"http://127.0.0.1:{server.server_address[1]}")
    backend.handler = handler  # type: ignore[attr-defined]
    yield backend
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("balancer", ["chash", "round_robin"])
def test_node_answering_503_fails_over_after_the_post_was_sent(start_sims, start_gateway, node_503,
                                                                balancer: str) -> None:
    # nginx passes a POST on after it was sent to a node only with non_idempotent
    sims = start_sims(1, prefix="ok")
    gw = start_gateway([node_503, *sims], None, balancer=balancer)
    before = gw.metric_sum("kvgate_failovers_total", pool="default")
    for i in range(12):
        r = gw.chat(f"request {i}", headers={"X-Session-Id": f"s-{i}"}, max_tokens=1)
        assert r.status_code == 200, r.text
        assert _node(r) == sims[0].node_id
    # the busy node was tried (and then skipped for fail_timeout) and the retry counted
    assert node_503.handler.posts >= 1
    assert gw.metric_sum("kvgate_failovers_total", pool="default") >= before + node_503.handler.posts


def test_round_robin_pool_reports_the_kind_and_still_checks_the_session(start_sims, start_gateway) -> None:
    # the key is not hashed for a balancer that does not read it, but stays observable
    gw = start_gateway(start_sims(2, prefix="k"), None, balancer="round_robin")
    assert gw.chat("hello", max_tokens=1).headers["X-Kvgate-Route-Key-Kind"] == "prefix"
    assert gw.chat("hello", user="u1", max_tokens=1).headers["X-Kvgate-Route-Key-Kind"] == "user"
    r = gw.chat("hello", headers={"x-session-id": "s1"}, max_tokens=1)
    assert r.headers["X-Kvgate-Route-Key-Kind"] == "session"
    bad = gw.chat("hello", headers={"X-Session-Id": "a\x01b"}, max_tokens=1)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_session_id"
