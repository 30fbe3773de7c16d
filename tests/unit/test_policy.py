"""Policy validation: good files load, bad ones name the field path and a one-line reason."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.policy import PolicyError, load_policy, parse_policy_text

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "policies" / "demo.yaml"

MINIMAL = """
pools:
  - name: p
    models: [m]
    nodes:
      - {id: a, url: "http://127.0.0.1:9001"}
"""


def issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy_text(text)
    return [str(i) for i in info.value.issues]


def test_demo_policy_loads():
    p = load_policy(DEMO)
    assert p.gateway.listen == "127.0.0.1:8080"
    assert [n.id for n in p.nodes()] == ["n1", "n2", "n3", "n4"]
    assert p.pools[0].balancer == "chash_bounded" and p.pools[0].bound_factor == 2.0
    assert p.pool_of_node("n3").name == "default"
    assert p.gateway.debug_headers is True


def test_defaults_fill_in():
    p = parse_policy_text(MINIMAL)
    pool = p.pools[0]
    assert pool.affinity == ["session", "user", "prefix"]
    assert pool.session_header == "X-Session-Id"
    assert p.cache.enabled and p.cache.namespace_version == 1
    assert p.cache.credential_headers == ["Authorization", "api-key", "x-api-key"]
    assert pool.nodes[0].weight == 1 and pool.nodes[0].address == "127.0.0.1:9001"
    passive = p.health.passive
    assert passive.enabled and (passive.max_5xx_ratio, passive.min_requests, passive.window_s) == (0.5, 20, 30.0)
    # a window that only needs to hold two reconciler rounds; off, it is not checked
    assert parse_policy_text(MINIMAL + "control: {tick_s: 0.2}\nhealth: {passive: {window_s: 0.4}}\n")
    assert parse_policy_text(MINIMAL + "health: {passive: {enabled: false, window_s: 1}}\n")


@pytest.mark.parametrize("bad, path, words", [
    (MINIMAL.replace("models: [m]", "models: [m]\n    balancer: ketama"), "pools[0].balancer", "chash"),
    (MINIMAL.replace('"http://127.0.0.1:9001"', '"ftp://x"'), "pools[0].nodes[0].url", "http://"),
    (MINIMAL.replace("{id: a,", "{id: A,"), "pools[0].nodes[0].id", "invalid node id"),
    (MINIMAL.replace("{id: a,", "{id: a, weight: 0,"), "pools[0].nodes[0].weight", "greater than"),
    (MINIMAL + "gateway: {listen: nowhere}\n", "gateway.listen", "HOST:PORT"),
    (MINIMAL + "redis: {url: 'http://x:1'}\n", "redis.url", "redis://"),
    (MINIMAL + "redis: {url: 'redis://:secret@127.0.0.1:6390/0'}\n", "redis.url", "not supported yet"),
    (MINIMAL + "cache: {ttl_s: -1}\n", "cache.ttl_s", "greater than"),
    (MINIMAL + "cache: {credential_headers: ['Authorization: Bearer']}\n", "cache.credential_headers", "header name"),
    (MINIMAL + "cache: {credential_headers: [api-key, '']}\n", "cache.credential_headers", "header name"),
    (MINIMAL + "cache: {credential_headers: []}\n", "cache.credential_headers", "at least 1"),
    (MINIMAL + "cache: {credential_headers: [X-Api-Key, Authorization, x-api-key]}\n", "cache.credential_headers",
     "'x-api-key' is listed twice"),
    (MINIMAL + "cache: {credential_headers: Authorization}\n", "cache.credential_headers", "list"),
    # renamed (it named one header); unknown now, so an old policy is refused rather than left narrower
    (MINIMAL + "cache: {credential_header: X-Api-Key}\n", "cache.credential_header", "unknown field"),
    (MINIMAL.replace("models: [m]", "models: [m]\n    affinty: [user]"), "pools[0].affinty", "unknown field"),
    (MINIMAL.replace("models: [m]", "models: [m]\n    affinity: [user, cookie]"), "pools[0].affinity[1]", "session"),
    (MINIMAL.replace("models: [m]", "models: [m]\n    session_header: 'X Bad'"), "pools[0].session_header", "header"),
    (MINIMAL + "gateway: {worker_shutdown_timeout_s: 300}\n", "gateway.worker_shutdown_timeout_s",
     "read_timeout_s + 1 = 601"),
    (MINIMAL + "gateway: {read_timeout_s: 30, worker_shutdown_timeout_s: 30}\n",
     "gateway.worker_shutdown_timeout_s", "read_timeout_s + 1 = 31"),
    (MINIMAL + "health: {passive: {max_5xx_ratio: 0}}\n", "health.passive.max_5xx_ratio", "greater than"),
    (MINIMAL + "health: {passive: {max_5xx_ratio: 1.5}}\n", "health.passive.max_5xx_ratio", "less than"),
    (MINIMAL + "health: {passive: {min_requests: 0}}\n", "health.passive.min_requests", "greater than"),
    (MINIMAL + "health: {passive: {window_s: 1}}\n", "health.passive.window_s", "2 × control.tick_s = 2s"),
    (MINIMAL + "health: {passive: {max_5xx: 0.5}}\n", "health.passive.max_5xx", "unknown field"),
    ("pools: []\n", "pools", "at least 1"),
    ("gateway: {}\n", "pools", "required"),
])
def test_bad_field_is_named(bad, path, words):
    found = issues(bad)
    assert any(i.startswith(path + ":") and words in i for i in found), found


def test_cross_checks():
    two = MINIMAL + """  - name: q
    models: [m]
    nodes:
      - {id: a, url: "http://127.0.0.1:9002"}
"""
    found = issues(two)
    assert "pools[1].models[0]: model 'm' is already served by pool 'p'" in found
    assert "pools[1].nodes[0].id: node id 'a' is already used by pools[0].nodes[0]" in found


def test_listener_collisions():
    clash = MINIMAL + 'gateway: {listen: "127.0.0.1:9001"}\n'
    assert "pools[0].nodes[0].url: 127.0.0.1:9001 is also gateway.listen" in issues(clash)
    clash = MINIMAL + 'redis: {url: "redis://127.0.0.1:9001/0"}\n'
    assert "pools[0].nodes[0].url: 127.0.0.1:9001 is also redis.url" in issues(clash)
    two = MINIMAL + """  - name: q
    models: [n]
    nodes:
      - {id: b, url: "http://127.0.0.1:9001"}
"""
    assert "pools[1].nodes[0].url: 127.0.0.1:9001 is also pools[0].nodes[0].url" in issues(two)


@pytest.mark.parametrize("listen, clashes", [
    ("localhost:9001", True), ("0.0.0.0:9001", True), ("127.0.0.1:9002", False), ("10.0.0.7:9001", False),
])
def test_listener_clash_across_spellings(listen, clashes):
    text = MINIMAL + f'gateway: {{listen: "{listen}"}}\n'
    if clashes:
        assert any(i.startswith("pools[0].nodes[0].url: 127.0.0.1:9001 is also gateway.listen") for i in issues(text))
    else:
        parse_policy_text(text)


def test_remote_node_does_not_clash_with_a_wildcard_gateway():
    parse_policy_text(MINIMAL.replace("127.0.0.1:9001", "10.0.0.5:8080") + 'gateway: {listen: "0.0.0.0:8080"}\n')


def test_yaml_syntax_error_has_position():
    found = issues("pools: [\n  - name: x\n")
    assert found and "YAML syntax error" in found[0] and "line" in found[0]


def test_not_a_mapping():
    assert issues("- a\n- b\n") == ["the policy must be a YAML mapping"]


def test_cli_validate_bad_policy_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL.replace('"http://127.0.0.1:9001"', '"nope"'))
    proc = subprocess.run([sys.executable, "-m", "kvgate", "validate", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "pools[0].nodes[0].url: expected http://HOST:PORT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_validate_good_policy():
    proc = subprocess.run([sys.executable, "-m", "kvgate", "validate", str(DEMO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ok (1 pool(s), 4 node(s))" in proc.stdout


def test_cli_up_with_bad_policy_changes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL.replace("models: [m]", "models: [m]\n    balancer: fastest"))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), "up", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "pools[0].balancer" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "nginx").exists()


def test_policy_reference_doc_is_current():
    from kvgate.policy.docs import markdown

    doc = (REPO / "docs" / "policy-reference.md").read_text()
    assert doc == markdown(), "docs/policy-reference.md is stale: run `python -m kvgate.policy.docs > docs/policy-reference.md`"


@pytest.mark.parametrize("gateway, grace", [
    ("{}", 900),
    ("{read_timeout_s: 1000}", 1300),  # follows the read timeout: streams still get 299 s past a reload
    ("{read_timeout_s: 2.5}", 303),
    ("{read_timeout_s: 30, worker_shutdown_timeout_s: 31}", 31),
])
def test_reload_grace_follows_the_read_timeout_unless_set(gateway, grace):
    from kvgate.render import stream_cut_after_s

    gw = parse_policy_text(MINIMAL + f"gateway: {gateway}\n").gateway
    assert gw.worker_shutdown_timeout_s == grace
    cut = stream_cut_after_s(gw.worker_shutdown_timeout_s, gw.read_timeout_s)
    assert cut == (299 if grace > 303 else grace - gw.read_timeout_s - 1)


@pytest.mark.parametrize("value", ["127.0.0.1:9080", "127.0.0.9:1", "[::1]:9080", "unix:/run/kvgate/internal.sock"])
def test_internal_listen_accepts_loopback_only_addresses(value):
    p = parse_policy_text(MINIMAL + f'gateway: {{internal_listen: "{value}"}}\n')
    assert p.gateway.internal_listen == value


def test_internal_listen_default():
    assert parse_policy_text(MINIMAL).gateway.internal_listen == "127.0.0.1:9080"


@pytest.mark.parametrize("value, why", [
    ("0.0.0.0:9080", "not a loopback address"), ("10.0.0.5:9080", "not a loopback address"),
    ("[::]:9080", "not a loopback address"), ("localhost:9080", "not an IP address"),
    ("127.0.0.1", "expected HOST:PORT"), ("unix:relative.sock", "unix:/absolute/path"),
])
def test_internal_listen_refuses_what_a_network_could_reach(value, why):
    found = issues(MINIMAL + f'gateway: {{internal_listen: "{value}"}}\n')
    assert any(i.startswith("gateway.internal_listen:") and why in i for i in found), found


def test_internal_listen_clashes_with_other_listeners():
    found = issues(MINIMAL + 'gateway: {listen: "127.0.0.1:9080"}\n')
    assert "gateway.internal_listen: 127.0.0.1:9080 is also gateway.listen" in found
    found = issues(MINIMAL + 'gateway: {internal_listen: "127.0.0.1:9001"}\n')
    assert any(i.startswith("pools[0].nodes[0].url: 127.0.0.1:9001 is also gateway.internal_listen") for i in found)
