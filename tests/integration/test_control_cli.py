"""The operator commands (``kvgate nodes``, ``drain``, ``undrain``, ``warm``, ``apply``, ``events``,
``token``) run as the real CLI (``python -m kvgate --run-dir ...``) against a real stack started by
``kvgate up``. One fleet serves the module; each test leaves the nodes active and the policy
as the fleet started it."""

from __future__ import annotations

import json
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from ctlfixtures import Fleet

pytestmark = pytest.mark.integration

WARMUP = ('    warmup: {hot_prefixes: 0, prompts: [{name: shared-system, messages: '
          '[{role: system, content: "You are a terse assistant for the kvgate tests."}, '
          '{role: user, content: "hello"}]}]}')


@pytest.fixture(scope="module")
def cf(control_fleet_module: Callable[..., Fleet]) -> Iterator[Fleet]:
    fleet = control_fleet_module(pool_extra=WARMUP)
    fleet.wait_reports(timeout=60)
    yield fleet


def versions(f: Fleet) -> list[dict[str, Any]]:
    r = f.api("GET", "/api/v1/policy/versions")
    assert r.status_code == 200, r.text
    return r.json()["versions"]


def eid(event_id: str) -> tuple[int, ...]:
    """A Redis stream id (``ms-seq``) as a comparable tuple."""
    return tuple(int(x) for x in event_id.split("-"))


def test_token_prints_the_token_file(cf: Fleet) -> None:
    path = cf.run_dir / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    res = cf.kvgate("token")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == path.read_text().strip() == cf.token
    assert len(cf.token) >= 32


def test_nodes_table_and_json(cf: Fleet) -> None:
    res = cf.kvgate("nodes")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["node", "pool", "state", "weight", "target", "gpu mem", "run/wait",
                                            "kv use", "prefix hit", "report"]
    rows = {r[0]: r for r in (re.split(r"\s{2,}", ln.strip()) for ln in lines[1:])}
    assert sorted(rows) == ["n1", "n2", "n3"], res.stdout
    for node_id, row in rows.items():
        assert row[1:4] == ["default", "active", "100"], row
        assert row[5] == "no GPU" and re.fullmatch(r"\d+/\d+", row[6]) and row[7].endswith("%"), row
        assert re.fullmatch(r"\d+s", row[9]), row

    res = cf.kvgate("nodes", "--json")
    assert res.returncode == 0, res.stderr
    nodes = json.loads(res.stdout)
    assert [n["id"] for n in nodes] == ["n1", "n2", "n3"]
    assert all(n["state"] == "active" and n["url"] == cf.node_url(n["id"]) and n["report"] for n in nodes)


def test_drain_wait_then_undrain_goes_through_warming_and_ramping(cf: Fleet) -> None:
    newest = cf.events(limit=1)[0]["id"]
    res = cf.kvgate("drain", "n2", "--wait", "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "n2: draining"
    assert lines[-1].startswith("n2: drained ("), res.stdout
    assert cf.node("n2")["state"] == "drained"
    assert cf.weight_in_force("n2") == 0

    res = cf.kvgate("undrain", "n2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("n2: warming"), res.stdout
    cf.wait_state("n2", "active", timeout=90)
    assert cf.weight_in_force("n2") == 100

    new = [e for e in reversed(cf.events(node="n2")) if eid(e["id"]) > eid(newest)]  # oldest first
    moves = [e["data"]["to_state"] for e in new if e["kind"] == "state"]
    assert moves == ["draining", "drained", "warming", "ramping", "active"], [e["message"] for e in new]
    warmups = [e["message"] for e in new if e["kind"] == "warmup"]
    assert any("warm-up ok" in m and "1 policy prompt(s)" in m for m in warmups), warmups
    ramps = [e for e in new if e["kind"] == "ramp"]
    assert [e["data"]["fraction"] for e in ramps] == [0.5], [e["message"] for e in new]

    res = cf.kvgate("events", "--node", "n2", "-n", "10")
    assert res.returncode == 0, res.stderr
    assert re.search(r"^\d\d:\d\d:\d\d  state\s+n2: ramping → active \(ramp complete\)$",
                     res.stdout, re.M), res.stdout


def test_warm_prints_the_result(cf: Fleet) -> None:
    before = cf.engine_counter("n1")
    res = cf.kvgate("warm", "n1")
    assert res.returncode == 0, res.stdout + res.stderr
    # the policy prompt before, then again after (cold and warm TTFT of the same prompt)
    assert re.fullmatch(r"n1: warm-up ok: 2 sent, 0 failed \(1 policy prompt\(s\), 0 hot prefix\(es\)\); "
                        r"TTFT \d+\.\d ms cold → \d+\.\d ms warm\n", res.stdout), res.stdout
    assert cf.engine_counter("n1") == before + 2  # sent straight to n1's engine
    n1 = cf.node("n1")
    assert n1["state"] == "active" and n1["warmup"]["status"] == "ok"


def test_apply_bad_then_good_policy(cf: Fleet, tmp_path: Path) -> None:
    n_versions = len(versions(cf))
    bad = tmp_path / "bad.yaml"
    bad.write_text(cf.render().replace(f'url: "{cf.node_url("n1")}"', 'url: "nope"'))
    res = cf.kvgate("apply", str(bad))
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"error: invalid policy {bad}:" in res.stderr
    assert re.search(r"^  pools\[0\]\.nodes\[0\]\.url: expected http://HOST:PORT", res.stderr, re.M), res.stderr
    assert len(versions(cf)) == n_versions

    good = tmp_path / "good.yaml"
    good.write_text(cf.render(weights={"n3": 2}))
    res = cf.kvgate("apply", str(good))
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.fullmatch(rf"{re.escape(str(good))}: applied as version (\d+) \(nginx pushed\)\n", res.stdout)
    assert m, res.stdout
    vs = versions(cf)
    assert int(m.group(1)) == vs[0]["version"] and len(vs) == n_versions + 1
    assert vs[0]["source"] == f"kvgate apply {good}"
    assert cf.weight_in_force("n3") == 200

    res = cf.kvgate("apply", str(good))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == f"{good}: unchanged, still version {m.group(1)} (nginx unchanged)\n"
    assert len(versions(cf)) == n_versions + 1

    # back to the fleet's own policy
    res = cf.kvgate("apply", str(cf.policy_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert cf.weight_in_force("n3") == 100

    res = cf.kvgate("apply", str(tmp_path / "missing.yaml"))
    assert res.returncode == 2 and "cannot read" in res.stderr, res.stderr


def test_errors_exit_2_with_a_clear_message(cf: Fleet) -> None:
    res = cf.kvgate("nodes", "--token", "wrong")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: HTTP 401: missing or wrong admin token"), res.stderr
    assert res.stdout == ""

    res = cf.kvgate("drain", "n1", "--token", "wrong")
    assert res.returncode == 2 and "HTTP 401" in res.stderr, res.stderr
    assert cf.node("n1")["state"] == "active"

    res = cf.kvgate("drain", "nosuch")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip() == "error: HTTP 404: no node 'nosuch' in the policy", res.stderr

    res = cf.kvgate("undrain", "n1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "HTTP 409: cannot undrain node 'n1': it is active" in res.stderr
    assert cf.node("n1")["state"] == "active"


def test_no_control_plane_is_exit_1(cf: Fleet, tmp_path: Path) -> None:
    # nothing listens on the URL: not a usage error, so 1 (and says what to check)
    from gwfixtures import free_port

    start = time.monotonic()
    res = cf.kvgate("nodes", "--control-url", f"http://127.0.0.1:{free_port()}")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "not reachable" in res.stderr and "kvgate status" in res.stderr
    assert time.monotonic() - start < 60


def test_invalidate_retires_the_cache_through_the_api_without_a_reload(cf: Fleet) -> None:
    import requests

    before = cf.api("GET", "/api/v1/policy").json()
    from ctlfixtures import MODEL

    body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "cache me for the CLI"}]}

    def cache_state() -> str:
        return requests.post(cf.gateway + "/v1/chat/completions", json=body, timeout=30).headers["X-Kvgate-Cache"]

    cache_state()
    deadline = time.monotonic() + 20
    while cache_state() != "HIT":
        assert time.monotonic() < deadline, "no cache HIT"
        time.sleep(0.2)
    res = cf.kvgate("invalidate")
    assert res.returncode == 0, res.stderr
    m = re.search(r"namespace v(\d+) -> v(\d+) \(policy version (\d+), nginx (\w+)\)", res.stdout)
    assert m, res.stdout
    assert int(m[2]) == int(m[1]) + 1 and int(m[3]) == before["version"] + 1
    assert m[4] == "pushed", res.stdout  # the namespace is runtime: no reload
    assert cache_state() == "MISS"
    # without a token the API refuses it
    r = requests.post(cf.control + "/api/v1/cache/invalidate", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"]
    # the module's other tests diff against the fleet's own text
    assert cf.api("PUT", "/api/v1/policy", data=before["yaml"]).status_code == 200
