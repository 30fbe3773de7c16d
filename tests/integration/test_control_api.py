"""The control plane's admin API against a real stack (``kvgate up``: Redis, simulators, nginx,
control plane, agents): authentication, errors, node actions, policy apply/validate/rollback
(and what a refused policy leaves running), events, ``/metrics``, and a restart of the
control plane process.

One fleet serves the whole module; tests put back what they change, except that ``n3`` is
drained (and stays drained) from the first test that needs it on."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
import redis as redis_lib
import requests
from prometheus_client.parser import text_string_to_metric_families

from ctlfixtures import MODEL, Fleet, wait_until
from kvgate.control.plane import ControlPlane
from kvgate.control.store import Store
from kvgate.nginxctl import Nginx

pytestmark = pytest.mark.integration

POLICY_HEADERS = {"Content-Type": "application/yaml"}


@pytest.fixture(scope="module")
def cf(control_fleet_module: Callable[..., Fleet]) -> Iterator[Fleet]:
    fleet = control_fleet_module()
    fleet.wait_reports(timeout=60)
    yield fleet


# ------------------------------------------------------------------ helpers

def eid(event_id: str) -> tuple[int, ...]:
    """A Redis stream id (``ms-seq``) as a comparable tuple."""
    return tuple(int(x) for x in event_id.split("-"))


def conf_file(f: Fleet) -> Path:
    return f.run_dir / "nginx" / "conf" / "nginx.conf"


def metrics(f: Fleet, token: bool = True) -> dict[str, float]:
    """``name{sorted labels}`` → value from the control plane's /metrics (parsed by prometheus_client)."""
    r = f.api("GET", "/metrics") if token else requests.get(f.control + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def chat_ok(f: Fleet) -> None:
    r = requests.post(f.gateway + "/v1/chat/completions", timeout=30, headers={"Cache-Control": "no-store"},
                      json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"]


def put_policy(f: Fleet, text: str, **kw: Any) -> requests.Response:
    return f.api("PUT", "/api/v1/policy", data=text.encode(), headers=POLICY_HEADERS, timeout=120, **kw)


def versions(f: Fleet) -> list[dict[str, Any]]:
    r = f.api("GET", "/api/v1/policy/versions")
    assert r.status_code == 200, r.text
    return r.json()["versions"]


def assert_error(r: requests.Response, status: int, type_: str, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def ensure_drained(f: Fleet, node_id: str = "n3") -> None:
    if f.node(node_id)["state"] != "drained":
        r = f.api("POST", f"/api/v1/nodes/{node_id}/drain")
        assert r.status_code == 202, r.text
        f.wait_state(node_id, "drained", timeout=60)


def with_url(f: Fleet, node_id: str, url: str) -> str:
    """The fleet's policy text with ``node_id``'s URL replaced."""
    text = f.render()
    old = f'url: "{f.node_url(node_id)}"'
    assert text.count(old) == 1
    return text.replace(old, f'url: "{url}"')


# ------------------------------------------------------------------ auth
ENDPOINTS = [
    ("GET", "/api/v1/nodes"), ("GET", "/api/v1/nodes/n1"), ("GET", "/api/v1/pools"), ("GET", "/api/v1/policy"),
    ("GET", "/api/v1/policy/versions"), ("GET", "/api/v1/events"), ("GET", "/metrics"),
    ("POST", "/api/v1/nodes/n1/drain"), ("POST", "/api/v1/nodes/n1/undrain"), ("POST", "/api/v1/nodes/n1/warm"),
    ("POST", "/api/v1/nodes/n1/report"), ("PUT", "/api/v1/policy"), ("POST", "/api/v1/policy/validate"),
    ("POST", "/api/v1/policy/versions/1/rollback"),
]


def test_healthz_needs_no_token(cf: Fleet) -> None:
    r = requests.get(cf.control + "/healthz", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["redis"] is True and isinstance(body["policy_version"], int)


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", "Basic {token}", "Bearer {token}x", "{token}", "Bearer "])
def test_missing_or_wrong_token_is_401_everywhere(cf: Fleet, auth: str | None) -> None:
    n_versions = len(versions(cf))
    headers = {} if auth is None else {"Authorization": auth.format(token=cf.token)}
    for method, path in ENDPOINTS:
        body = cf.render().encode() if method == "PUT" or path.endswith("validate") else None
        r = requests.request(method, cf.control + path, headers=headers, data=body, timeout=30)
        err = assert_error(r, 401, "authentication_error", "invalid_token")
        assert "kvgate token" in err["message"], (method, path)
    # nothing happened
    assert cf.node("n1")["state"] == "active"
    assert len(versions(cf)) == n_versions


def test_public_reads_open_gets_but_not_mutations(cf: Fleet) -> None:
    original = cf.render()
    public = original.replace("report_interval_s: 0.5}", "report_interval_s: 0.5, public_reads: true}")
    assert public != original
    r = put_policy(cf, public)
    assert r.status_code == 200, r.text
    try:
        for path in ("/api/v1/nodes", "/api/v1/nodes/n1", "/api/v1/events", "/api/v1/policy", "/metrics"):
            assert requests.get(cf.control + path, timeout=10).status_code == 200, path
        assert "public_reads: true" in requests.get(cf.control + "/api/v1/policy", timeout=10).json()["yaml"]
        for method, path in [m for m in ENDPOINTS if m[0] != "GET"]:
            r = requests.request(method, cf.control + path, data=b"x: 1", timeout=30)
            assert_error(r, 401, "authentication_error", "invalid_token")
        # a wrong token on a read is not an error when reads are public
        assert requests.get(cf.control + "/api/v1/nodes", headers={"Authorization": "Bearer nope"},
                            timeout=10).status_code == 200
    finally:
        r = put_policy(cf, original)
        assert r.status_code == 200, r.text
    assert_error(requests.get(cf.control + "/api/v1/nodes", timeout=10), 401, "authentication_error", "invalid_token")
    assert cf.node("n1")["state"] == "active"


# ------------------------------------------------------------------ nodes
def test_unknown_node_is_404(cf: Fleet) -> None:
    assert_error(cf.api("GET", "/api/v1/nodes/nosuch"), 404, "not_found_error", "not_found")
    for action in ("drain", "undrain", "warm"):
        err = assert_error(cf.api("POST", f"/api/v1/nodes/nosuch/{action}"), 404, "not_found_error", "not_found")
        assert "nosuch" in err["message"]
    err = assert_error(cf.api("POST", "/api/v1/nodes/nosuch/report", json={"engine": {}}), 404,
                       "not_found_error", "not_found")
    assert "nosuch" in err["message"]
    assert_error(cf.api("GET", "/api/v1/nope"), 404, "not_found_error", "not_found")
    assert_error(cf.api("DELETE", "/api/v1/nodes/n1"), 405, "invalid_request_error", "method_not_allowed")
    # a report that is not a JSON object is a 400, not a 500
    assert_error(cf.api("POST", "/api/v1/nodes/n1/report", data=b"[1, 2]",
                        headers={"Content-Type": "application/json"}), 400, "invalid_request_error", "bad_request")


def test_a_report_of_the_wrong_shape_is_refused_and_never_reaches_the_reconciler(cf: Fleet) -> None:
    for body, path in (({"engine": "broken"}, "engine"), ({"engine": {"waiting": "abc"}}, "engine.waiting"),
                       ({"gpu": "zz"}, "gpu"), ({"gpu": {"status": "ok", "devices": [{"memory_total_bytes": -1}]}},
                                                "gpu.devices[0].memory_total_bytes")):
        err = assert_error(cf.api("POST", "/api/v1/nodes/n1/report", json=body), 422, "invalid_request_error",
                           "invalid_report")
        assert [i["path"] for i in err["issues"]] == [path], err
    # the agent's next good report is still the node's last one; the fixture's teardown checks that
    # no reconciler round failed
    time.sleep(1.0)
    assert cf.node("n1")["report"]["engine"]["healthy"] is True


def test_node_view(cf: Fleet) -> None:
    nodes = cf.api("GET", "/api/v1/nodes").json()["nodes"]
    assert [n["id"] for n in nodes] == ["n1", "n2", "n3"]
    n1 = nodes[0]
    assert n1["url"] == cf.node_url("n1") and n1["pool"] == "default"
    assert n1["report"]["engine"]["healthy"] is True and n1["report_age_s"] is not None
    pools = cf.api("GET", "/api/v1/pools").json()["pools"]
    assert pools[0]["name"] == "default" and pools[0]["nodes"] == ["n1", "n2", "n3"]
    assert pools[0]["balancer_in_force"] == "chash" and pools[0]["degraded"] is False


def test_drain_conflicts_name_the_state(cf: Fleet) -> None:
    ensure_drained(cf, "n3")
    assert cf.weight_in_force("n3") == 0, cf.in_force()
    # draining a drained node changes nothing (scripts may repeat it)
    r = cf.api("POST", "/api/v1/nodes/n3/drain")
    assert r.status_code == 202 and r.json()["state"] == "drained"
    err = assert_error(cf.api("POST", "/api/v1/nodes/n1/undrain"), 409, "conflict_error", "invalid_transition")
    assert "cannot undrain node 'n1': it is active" in err["message"]
    assert err["state"] == "active"
    assert cf.node("n3")["state"] == "drained" and cf.node("n1")["state"] == "active"
    chat_ok(cf)


def test_the_last_serving_node_is_not_drained_without_force(cf: Fleet) -> None:
    ensure_drained(cf, "n3")
    ensure_drained(cf, "n2")
    try:
        err = assert_error(cf.api("POST", "/api/v1/nodes/n1/drain"), 409, "conflict_error", "conflict")
        assert "last serving node of pool 'default'" in err["message"]
        assert cf.node("n1")["state"] == "active"
        chat_ok(cf)
        r = cf.api("POST", "/api/v1/nodes/n1/drain", params={"force": "true"})
        assert r.status_code == 202 and r.json()["state"] == "draining"
        cf.wait_state("n1", "drained", timeout=30)
    finally:
        for node in ("n1", "n2", "n3"):
            cf.api("POST", f"/api/v1/nodes/{node}/undrain")
        for node in ("n1", "n2", "n3"):
            cf.wait_state(node, "active", timeout=60)


# ------------------------------------------------------------------ policy
def test_bad_policy_is_422_and_changes_nothing(cf: Fleet) -> None:
    conf_before = conf_file(cf).read_bytes()
    data_before = (cf.run_dir / "nginx" / "conf" / "kvgate.json").read_bytes()
    n_versions = len(versions(cf))
    invalid_before = metrics(cf).get('kvgate_control_policy_applies_total{result="invalid"}', 0.0)

    r = put_policy(cf, with_url(cf, "n1", "nope"))
    err = assert_error(r, 422, "invalid_request_error", "invalid_policy")
    paths = [i["path"] for i in err["issues"]]
    assert "pools[0].nodes[0].url" in paths, err
    assert "http://HOST:PORT" in next(i["reason"] for i in err["issues"] if i["path"] == "pools[0].nodes[0].url")

    assert conf_file(cf).read_bytes() == conf_before
    assert (cf.run_dir / "nginx" / "conf" / "kvgate.json").read_bytes() == data_before
    assert len(versions(cf)) == n_versions
    assert metrics(cf)['kvgate_control_policy_applies_total{result="invalid"}'] == invalid_before + 1
    assert cf.node("n1")["url"] == cf.node_url("n1")
    chat_ok(cf)


def test_yaml_syntax_error_is_422_with_line_and_column(cf: Fleet) -> None:
    r = put_policy(cf, "version: 1\npools:\n  - name: [default\n    models: [m]\n")
    err = assert_error(r, 422, "invalid_request_error", "invalid_policy")
    assert re.fullmatch(r"line \d+, column \d+", err["issues"][0]["path"]), err
    assert err["issues"][0]["reason"].startswith("YAML syntax error")
    # the same through the JSON body form
    r = cf.api("PUT", "/api/v1/policy", json={"yaml": "pools: {"})
    assert re.fullmatch(r"line \d+, column \d+", assert_error(r, 422, "invalid_request_error",
                                                              "invalid_policy")["issues"][0]["path"])
    assert_error(cf.api("PUT", "/api/v1/policy", json={"policy": "x"}), 400, "invalid_request_error", "bad_request")
    # an empty policy is a bad policy, said the way `kvgate validate` says it
    err = assert_error(cf.api("PUT", "/api/v1/policy", data=b"  \n", headers=POLICY_HEADERS), 422,
                       "invalid_request_error", "invalid_policy")
    assert "the policy must be a YAML mapping" in err["message"]
    assert_error(put_policy(cf, "- just\n- a list\n"), 422, "invalid_request_error", "invalid_policy")


def test_validate(cf: Fleet) -> None:
    n_versions = len(versions(cf))
    r = cf.api("POST", "/api/v1/policy/validate", data=cf.render(weights={"n2": 3}).encode(), headers=POLICY_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json() == {"valid": True, "pools": 1, "nodes": 3}
    r = cf.api("POST", "/api/v1/policy/validate", data=with_url(cf, "n1", "nope").encode(), headers=POLICY_HEADERS)
    err = assert_error(r, 422, "invalid_request_error", "invalid_policy")
    assert [i["path"] for i in err["issues"]] == ["pools[0].nodes[0].url"]
    # validating applies nothing
    assert len(versions(cf)) == n_versions
    assert "weight=300" not in conf_file(cf).read_text()
    assert cf.weight_in_force("n2") == 100


def test_policy_nginx_rejects_is_500_and_keeps_everything(cf: Fleet) -> None:
    """A node URL whose host does not resolve passes the model but not ``nginx -t``
    ("host not found in upstream")."""
    conf_before = conf_file(cf).read_bytes()
    n_versions = len(versions(cf))
    before = metrics(cf)
    failed_reloads = before.get('kvgate_control_reloads_total{result="failed"}', 0.0)
    failed_applies = before.get('kvgate_control_policy_applies_total{result="failed"}', 0.0)
    newest = cf.events(limit=1)[0]["id"]
    n1_before = cf.node("n1")
    bad = with_url(cf, "n1", f"http://nosuchhost.invalid:{cf.node_ports['n1']}")

    # validate runs nginx -t too: an invalid policy (422), nothing applied
    r = cf.api("POST", "/api/v1/policy/validate", data=bad.encode(), headers=POLICY_HEADERS)
    err = assert_error(r, 422, "invalid_request_error", "invalid_policy")
    assert "host not found in upstream" in err["issues"][0]["reason"], err

    err = assert_error(put_policy(cf, bad), 500, "server_error", "apply_failed")
    assert "host not found" in err["message"] and "keeps serving" in err["message"]

    assert conf_file(cf).read_bytes() == conf_before
    assert len(versions(cf)) == n_versions
    after = metrics(cf)
    assert after['kvgate_control_reloads_total{result="failed"}'] == failed_reloads + 1
    assert after['kvgate_control_policy_applies_total{result="failed"}'] == failed_applies + 1
    new_events = [e for e in cf.events() if eid(e["id"]) > eid(newest)]
    kinds = {e["kind"] for e in new_events}
    assert {"reload_failed", "policy_rejected"} <= kinds, new_events
    assert not any(e["kind"] == "policy_applied" for e in new_events)
    # the running policy and node records are the old ones: n1 keeps its URL (its probes keep
    # passing, it is not ejected) and the policy text is unchanged
    assert "nosuchhost" not in cf.api("GET", "/api/v1/policy").json()["yaml"]
    n1 = cf.node("n1")
    assert n1["url"] == cf.node_url("n1") and n1["state"] == "active"
    checked = n1_before["health"]["last_check"]
    wait_until(lambda: cf.node("n1")["health"]["passes"] >= n1_before["health"]["passes"] + 4
               and cf.node("n1")["health"]["last_check"] > checked, "four more health checks of n1")
    n1 = cf.node("n1")
    assert n1["state"] == "active" and n1["health"]["fails"] == 0, n1
    assert "nosuchhost" not in (cf.run_dir / "policy.yaml").read_text()
    chat_ok(cf)


def test_refused_policy_adding_a_node_leaves_no_record(cf: Fleet) -> None:
    text = cf.render()
    n3_line = next(ln for ln in text.splitlines() if "{id: n3," in ln)
    bad = text.replace(n3_line, n3_line + '\n      - {id: n4, url: "http://nosuchhost.invalid:8000"}')
    assert_error(put_policy(cf, bad), 500, "server_error", "apply_failed")
    assert [n["id"] for n in cf.api("GET", "/api/v1/nodes").json()["nodes"]] == ["n1", "n2", "n3"]
    r = redis_lib.Redis(host="127.0.0.1", port=cf.redis_port)
    assert sorted(k.decode() for k in r.scan_iter("kvgate:control:node:*")) == \
        [f"kvgate:control:node:n{i}" for i in (1, 2, 3)]


def test_versions_grow_on_change_only_and_rollback(cf: Fleet) -> None:
    current = cf.api("GET", "/api/v1/policy").json()
    vs = versions(cf)
    assert vs[0]["version"] == current["version"] == max(v["version"] for v in vs)
    assert [v["version"] for v in vs] == sorted((v["version"] for v in vs), reverse=True)

    # the same text again: no new version
    r = put_policy(cf, current["yaml"])
    assert r.status_code == 200, r.text
    assert r.json()["changed"] is False and r.json()["version"] == current["version"]
    assert len(versions(cf)) == len(vs)

    # a change: a new version, in force in nginx
    r = put_policy(cf, cf.render(weights={"n1": 2}))
    assert r.status_code == 200, r.text
    changed = r.json()
    assert changed["changed"] is True and changed["version"] == current["version"] + 1
    assert changed["result"] == "pushed"  # a weight is the runtime's: no reload
    assert cf.weight_in_force("n1") == 200
    assert len(versions(cf)) == len(vs) + 1
    applied = cf.events(kind="policy_applied", limit=1)[0]
    assert applied["data"]["version"] == changed["version"]

    # rollback to version 1: applied as a new version with version 1's text
    v1 = next(v for v in versions(cf) if v["version"] == 1)
    r = cf.api("POST", "/api/v1/policy/versions/1/rollback", timeout=120)
    assert r.status_code == 200, r.text
    rolled = r.json()
    assert rolled["changed"] is True and rolled["version"] == changed["version"] + 1
    now = cf.api("GET", "/api/v1/policy").json()
    assert now["version"] == rolled["version"] and now["yaml"] == v1["yaml"]
    assert now["source"] == "rollback to version 1 by API"
    assert cf.weight_in_force("n1") == 100
    newest = versions(cf)
    assert newest[0]["version"] == rolled["version"] and newest[0]["yaml"] == v1["yaml"]
    assert len(newest) == len(vs) + 2
    assert (cf.run_dir / "policy.yaml").read_text() == v1["yaml"]

    assert_error(cf.api("POST", "/api/v1/policy/versions/9999/rollback"), 404, "not_found_error", "not_found")
    assert len(versions(cf)) == len(vs) + 2


# ------------------------------------------------------------------ events and metrics
def test_events_filters_and_paging(cf: Fleet) -> None:
    ensure_drained(cf, "n3")
    n3 = cf.events(node="n3")
    assert n3 and all(e["node"] == "n3" for e in n3)
    assert any(e["kind"] == "state" and e["data"]["to_state"] == "drained" for e in n3)
    states = cf.events(node="n3", kind="state")
    assert states and all(e["kind"] == "state" and e["node"] == "n3" for e in states)
    assert [e["data"]["to_state"] for e in states][:2] == ["drained", "draining"]
    assert all(e["kind"].startswith("reload") for e in cf.events(kind="reload"))
    assert cf.events(node="nosuch") == []

    page1 = cf.events(limit=3)
    page2 = cf.events(limit=3, before=page1[-1]["id"])
    assert len(page1) == len(page2) == 3
    ids = [e["id"] for e in page1 + page2]
    assert ids == sorted(ids, key=eid, reverse=True)
    assert len(set(ids)) == 6
    assert_error(cf.api("GET", "/api/v1/events", params={"limit": "many"}), 400, "invalid_request_error",
                 "bad_request")
    # a malformed event id is the caller's mistake (400), not "Redis unavailable" (503)
    for before in ("abc", "1-x", "9" * 25):
        err = assert_error(cf.api("GET", "/api/v1/events", params={"before": before}), 400,
                           "invalid_request_error", "bad_request")
        assert "before" in err["message"]


def test_metrics_parse_and_match_the_nodes(cf: Fleet) -> None:
    ensure_drained(cf, "n3")
    r = cf.api("GET", "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("kvgate_control_reloads", "kvgate_control_policy_applies", "kvgate_control_node_transitions",
                 "kvgate_control_node_state", "kvgate_control_node_weight", "kvgate_control_node_target_weight",
                 "kvgate_control_reports", "kvgate_control_report_age_seconds", "kvgate_control_health_checks",
                 "kvgate_control_ticks", "kvgate_control_pool_degraded"):
        assert name in families, sorted(families)
    assert all(n.startswith("kvgate_control_") for n in families)
    m = metrics(cf)
    states = cf.states()
    for node, state in states.items():
        on = [k for k, v in m.items()
              if k.startswith("kvgate_control_node_state{") and f'node="{node}"' in k and v == 1]
        assert on == [f'kvgate_control_node_state{{node="{node}",state="{state}"}}'], on
        assert m[f'kvgate_control_reports_total{{node="{node}"}}'] > 0
        assert m[f'kvgate_control_health_checks_total{{node="{node}",result="pass"}}'] > 0
    assert m['kvgate_control_node_weight{node="n3"}'] == 0
    assert m['kvgate_control_node_weight{node="n1"}'] == 100
    assert m['kvgate_control_pool_degraded{pool="default"}'] == 0
    assert m["kvgate_control_ticks_total{}"] > 0
    assert m['kvgate_control_node_transitions_total{from_state="draining",node="n3",to_state="drained"}'] >= 1


# ------------------------------------------------------------------ restart
def test_stale_reports_at_start_eject_only_after_agents_could_report(cf: Fleet) -> None:
    """A starting plane finds its predecessor's last reports in Redis, all old: agents could
    not report while no plane ran. It must give them time to report (the missing-report
    window plus the agents' retry backoff) before it counts them missing, and then it must.

    A second, in-process plane on its own Redis database, next to the fleet's; it probes the
    fleet's engines and writes (never runs) its own nginx config."""
    store = Store(f"redis://127.0.0.1:{cf.redis_port}/7")
    store.r.flushdb()
    plane = ControlPlane(store, Nginx(cf.tmp / "second-plane-nginx"), external_gateway=True)
    report = {"engine": {"healthy": True, "waiting": 0, "running": 0, "kv_cache_usage": 0.0}}
    try:
        plane.start(cf.render(), "test")
        started = time.time()
        for node_id in ("n1", "n2", "n3"):
            plane.report(node_id, report)  # the nodes have agents...
            store.put_report(node_id, report, received_at=started - 100)  # ...whose last report is old
        ejected = wait_until(lambda: [e for e in store.events(kind="state") if e["data"]["to_state"] == "ejected"],
                             "the missing reports to eject the nodes")
        # policy: 4 missing reports × 0.5 s + the agents' longest retry wait (5 × 0.5 s)
        assert min(e["ts"] for e in ejected) - started >= 4.5, [e["message"] for e in ejected]
        messages = [e["message"] for e in ejected]
        assert all(re.search(r"no agent report for 1\d\ds", m) for m in messages), messages
    finally:
        plane.stop()
        store.r.flushdb()


def test_restart_keeps_node_states_versions_and_events(cf: Fleet) -> None:
    ensure_drained(cf, "n3")
    vs_before = versions(cf)
    events_before = [e["id"] for e in cf.events(limit=50)]
    policy_before = cf.api("GET", "/api/v1/policy").json()
    pid_file = cf.run_dir / "pids" / "control.pid"
    pid = int(pid_file.read_text())
    proc = psutil.Process(pid)
    os.kill(pid, signal.SIGTERM)
    proc.wait(30)  # it exits on SIGTERM, even with the test's keep-alive connection open
    with pytest.raises(requests.ConnectionError):
        requests.get(cf.control + "/healthz", timeout=5)

    up = cf.kvgate("up", str(cf.policy_path))
    assert up.returncode == 0, up.stdout + up.stderr
    assert re.search(r"^control\s+started", up.stdout, re.M), up.stdout
    restarted_at = time.time()
    assert int(pid_file.read_text()) != pid
    token = (cf.run_dir / "admin.token").read_text().strip()
    assert token == cf.token  # same run dir, same token

    states = cf.states()
    assert states["n3"] == "drained", states
    assert cf.weight_in_force("n3") == 0
    vs_after = versions(cf)
    assert vs_after[len(vs_after) - len(vs_before):] == vs_before  # nothing lost (a new one may be on top)
    after_ids = {e["id"] for e in cf.events()}
    assert set(events_before) <= after_ids
    now = cf.api("GET", "/api/v1/policy").json()
    assert now["yaml"] == policy_before["yaml"] and now["version"] == policy_before["version"]

    # The agents could not report while the plane was down: that must not eject their nodes.
    # Wait until every agent reported to the new process and a health round judged it since.
    def reported_and_checked() -> bool:
        nodes = cf.api("GET", "/api/v1/nodes").json()["nodes"]
        newest = max((n.get("report") or {}).get("ts", 0) for n in nodes)
        return all((n.get("report") or {}).get("ts", 0) > restarted_at for n in nodes) and \
            all((n["health"]["last_check"] or 0) > newest for n in nodes)

    wait_until(reported_and_checked, "reports from every agent to the restarted control plane")
    ejected = [e["message"] for e in cf.events(kind="state") if eid(e["id"]) > eid(events_before[0])
               and e["data"]["to_state"] == "ejected"]
    assert ejected == [], ejected
    states = cf.states()
    assert states == {"n1": "active", "n2": "active", "n3": "drained"}, states

    # the restarted plane keeps working: n3 comes back through the normal path
    r = cf.api("POST", "/api/v1/nodes/n3/undrain")
    assert r.status_code == 202, r.text
    cf.wait_state("n3", "active", timeout=60)
    assert cf.weight_in_force("n3") == 100
    chat_ok(cf)
