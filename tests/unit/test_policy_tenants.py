"""The policy's tenants and gateway.auth: bad ones are refused at the field's path."""

import json

import pytest

from kvgate.policy import PolicyError, parse_policy_text
from kvgate.render import data_config

BASE = """
gateway: {{auth: {auth}}}
pools:
  - name: p
    models: [m, m2]
    nodes:
      - {{id: a, url: "http://127.0.0.1:9001"}}
tenants:
{tenants}
"""


def policy(auth: str, tenants: str):
    return parse_policy_text(BASE.format(auth=auth, tenants=tenants or "  []"))


def issues(auth: str, tenants: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        policy(auth, tenants)
    return [str(i) for i in info.value.issues]


def test_tenants_render_into_the_gateway_config():
    p = policy("optional", """
  - {id: default, name: Everyone, models: [m]}
  - {id: team-a, cache: shared, cache_group: research}
""")
    cfg = json.loads(json.dumps(data_config(p)))
    assert cfg["auth"] == {"mode": "optional", "cache_ttl_s": 5.0, "stale_s": 300.0, "default_tenant": "default"}
    assert cfg["tenants"]["default"] == {"name": "Everyone", "scope": "t.default", "models": {"m": True},
                                         "priority": "interactive"}
    # no `models`: every model (the key is absent, not null)
    assert cfg["tenants"]["team-a"] == {"name": "team-a", "scope": "g.research", "priority": "interactive"}
    assert cfg["tenant_ids"] == ["default", "team-a"]


def test_auth_off_is_the_default_and_has_no_tenants():
    p = parse_policy_text("""
pools:
  - {name: p, models: [m], nodes: [{id: a, url: "http://127.0.0.1:9001"}]}
""")
    assert p.gateway.auth == "off" and p.tenants == []
    assert data_config(p)["tenants"] == {}


@pytest.mark.parametrize("auth, tenants, expected", [
    ("optional", "  - {id: team-a}", "tenants: gateway.auth: optional maps keyless requests to the tenant 'default': define it"),
    ("required", "", "tenants: gateway.auth: required needs at least one tenant"),
    ("off", "  - {id: default}", "gateway.auth: tenants are defined but gateway.auth is off"),
    ("required", "  - {id: a}\n  - {id: a}", "tenants[1].id: tenant id 'a' is already used by tenants[0]"),
    ("required", "  - {id: a, models: [m, nope]}", "tenants[0].models[1]: model 'nope' is served by no pool"),
    ("required", "  - {id: Bad}", "tenants[0].id: invalid id 'Bad'"),
    ("required", "  - {id: a, cache: shared}", "tenants[0]: cache: shared needs a cache_group"),
    ("required", "  - {id: a, cache_group: g}", "tenants[0]: cache_group is only for cache: shared"),
    ("required", "  - {id: a, limit: 3}", "tenants[0].limit: unknown field"),
    ("sometimes", "  - {id: a}", "gateway.auth: Input should be 'off', 'optional' or 'required'"),
])
def test_bad_tenants_are_refused_at_the_field(auth, tenants, expected):
    found = issues(auth, tenants)
    assert any(i.startswith(expected) for i in found), found


@pytest.mark.parametrize("value", ["-5", "0", "ten", "true", "1.5", '"60"'])
def test_a_bad_limit_is_refused_at_its_path(value):
    found = issues("required", f"  - {{id: a, limits: {{rpm: {value}}}}}")
    assert any(i.startswith("tenants[0].limits.rpm:") for i in found), found


def test_limits_render_only_what_is_set():
    p = policy("required", """
  - {id: a, limits: {rpm: 60, tpm: 1000, concurrency: 4, session_rpm: 120, per_key: {rpm: 10}}}
  - {id: b}
""")
    cfg = data_config(p)
    assert cfg["tenants"]["a"]["limits"] == {"rpm": 60, "tpm": 1000, "concurrency": 4, "session_rpm": 120,
                                             "key_rpm": 10}
    assert "limits" not in cfg["tenants"]["b"]
    assert cfg["limits"]["on_redis_error"] == "allow" and cfg["limits"]["default_max_tokens"] == 1024
    with pytest.raises(PolicyError) as info:
        parse_policy_text(BASE.format(auth="required", tenants="  - {id: a}") + "limits: {on_redis_error: maybe}\n")
    assert any(str(i).startswith("limits.on_redis_error:") for i in info.value.issues)


def test_admission_renders_per_pool_and_is_checked():
    p = parse_policy_text("""
pools:
  - {name: p, models: [m], nodes: [{id: a, url: "http://127.0.0.1:9001"}],
     admission: {node_capacity: 8, queue_length: 50}}
""")
    assert data_config(p)["pools"]["p"]["admission"] == {"node_capacity": 8, "queue_length": 50, "queue_timeout_s": 30.0}
    with pytest.raises(PolicyError) as info:
        parse_policy_text("""
pools:
  - {name: p, models: [m], nodes: [{id: a, url: "http://127.0.0.1:9001"}], admission: {node_capacity: 0}}
""")
    assert [str(i) for i in info.value.issues][0].startswith("pools[0].admission.node_capacity:")
