"""Gateway members in the policy (issue 17 item 1, docs/scale-out.md): validation, the effective
members, the per-member policy, what kvgate.json says about them, the runtime's wire form."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.control.gateways import runtime_digest, runtime_fields, runtime_from_fields
from kvgate.policy import PolicyError
from kvgate.policy.loader import load_policy, parse_policy_text
from kvgate.render import Runtime, data_config, default_lua_dir, render

REPO = Path(__file__).resolve().parents[2]

BASE = """
version: 1
pools:
  - name: p
    models: [m]
    nodes:
      - {id: n1, url: "http://127.0.0.1:29101"}
      - {id: n2, url: "http://127.0.0.1:29102"}
"""


def members(text: str) -> str:
    return BASE + "gateways:\n" + text


def issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        parse_policy_text(text)
    return [i.path for i in exc.value.issues]


def test_no_members_is_one_local_member_at_gateway_listen() -> None:
    p = parse_policy_text(BASE)
    (m,) = p.gateway_members()
    assert (m.id, m.listen, m.internal_listen) == ("local", p.gateway.listen, p.gateway.internal_listen)
    assert p.member_policy("local") is p
    assert data_config(p)["gateway"] == {"id": "local", "members": ["local"], "load_sync_s": 0.05}


def test_the_first_member_fills_gateway_listen_and_each_member_renders_its_own() -> None:
    p = parse_policy_text(members("""
  - {id: b, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
  - {id: a, listen: "127.0.0.1:29181", internal_listen: "127.0.0.1:29281"}
"""))
    assert (p.gateway.listen, p.gateway.internal_listen) == ("127.0.0.1:29180", "127.0.0.1:29280")
    second = p.member_policy("a")
    assert (second.gateway.listen, second.gateway.internal_listen) == ("127.0.0.1:29181", "127.0.0.1:29281")
    assert second.pools == p.pools and second.gateway.worker_processes == p.gateway.worker_processes
    assert data_config(p)["gateway"] == {"id": "b", "members": ["a", "b"], "load_sync_s": 0.05}
    assert data_config(second)["gateway"] == {"id": "a", "members": ["a", "b"], "load_sync_s": 0.05}
    conf = render(second, default_lua_dir())["conf/nginx.conf"]
    assert "127.0.0.1:29181" in conf and "127.0.0.1:29281" in conf and "127.0.0.1:29180" not in conf
    with pytest.raises(KeyError):
        p.member_policy("zz")


def test_member_errors_point_at_their_fields() -> None:
    assert issues(members("""
  - {id: a, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
  - {id: a, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
""")) == ["gateways[1].id", "gateways[1].listen", "gateways[1].internal_listen"]
    assert issues(BASE + """
gateway: {listen: "127.0.0.1:29170"}
gateways:
  - {id: a, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
""") == ["gateways[0].listen"]  # internal_listen not written: the first member's
    # another member on a node's address
    assert issues(members("""
  - {id: a, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
  - {id: b, listen: "127.0.0.1:29101", internal_listen: "127.0.0.1:29281"}
""")) == ["pools[0].nodes[0].url"]
    assert issues(members('  - {id: "A B", listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}\n')) \
        == ["gateways[0].id"]
    # the internal listener stays on loopback
    assert issues(members('  - {id: a, listen: "127.0.0.1:29180", internal_listen: "10.0.0.1:29280"}\n')) \
        == ["gateways[0].internal_listen"]
    # two hosts may use the same loopback internal port
    parse_policy_text(members("""
  - {id: a, listen: "10.0.0.1:29180", internal_listen: "127.0.0.1:29280"}
  - {id: b, listen: "10.0.0.2:29180", internal_listen: "127.0.0.1:29280"}
""").replace("pools:", 'gateway: {listen: "10.0.0.1:29180"}\npools:'))


def test_the_runtime_crosses_the_wire_unchanged() -> None:
    p = parse_policy_text(BASE)
    rt = Runtime(weights={"n1": 0, "n2": 250}, balancers={"p": "least_conn"}, namespace_version=3,
                 states={"n1": "draining"}, home_weights={"n1": 100}, knowledge={})
    back = runtime_from_fields(runtime_fields(rt))
    assert back == rt and runtime_digest(p, back) == runtime_digest(p, rt)
    assert runtime_from_fields({}) is None and runtime_fields(None) == {}
    with pytest.raises(ValueError):
        runtime_from_fields({"weights": {"n1": "heavy"}})


def test_two_gateways_policy() -> None:
    p = load_policy(REPO / "policies" / "two-gateways.yaml")
    assert [(m.id, m.listen, m.internal_listen) for m in p.gateway_members()] == [
        ("gw1", "127.0.0.1:8080", "127.0.0.1:9080"), ("gw2", "127.0.0.1:8081", "127.0.0.1:9081")]
    assert p.gateway.debug_headers
    demo = load_policy(REPO / "policies" / "demo.yaml")
    assert p.pools == demo.pools and p.tenants == demo.tenants


def test_a_member_sends_the_batch_api_to_the_control_plane_it_reaches() -> None:
    """/v1/files and /v1/batches are proxied to the control plane: on the plane's host at
    control.listen, on a member's host at its supervisor's --control URL (compose: gateway-b
    reaches the plane at http://gateway:9090, nothing listens on its own loopback)."""
    p = parse_policy_text(members('  - {id: a, listen: "127.0.0.1:29180", internal_listen: "127.0.0.1:29280"}\n'
                                  '  - {id: b, listen: "127.0.0.1:29181", internal_listen: "127.0.0.1:29281"}\n')
                          + "control: {listen: 0.0.0.0:9090}\n")
    own = render(p, default_lua_dir())["conf/nginx.conf"]
    assert own.count("proxy_pass http://127.0.0.1:9090;") == 2
    member = render(p.member_policy("b"), default_lua_dir(), control_url="http://gateway:9090")["conf/nginx.conf"]
    assert member.count("proxy_pass http://gateway:9090;") == 2 and "127.0.0.1:9090" not in member
    tls = render(p.member_policy("b"), default_lua_dir(), control_url="https://ctl.example:9443/")["conf/nginx.conf"]
    assert tls.count("proxy_pass https://ctl.example:9443;") == 2
