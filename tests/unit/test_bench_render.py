"""`kvgate bench render` (issue 17 item 4) at a small size: the output's shape, never a timing;
and the fixes it led to give what the code they replaced gave (the gateway's /metrics read,
the engine probe's reasons, the batched record saves, the policy's YAML loader)."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.render import APPLY_STEPS, EXTRA_STEPS, policy_data, render_command
from kvgate.bench.render_stub import metrics_text
from kvgate.control import effects
from kvgate.control.probes import _WANTED, gateway_samples, probe, probe_all
from kvgate.fleet.changes import Checked, Save, transition
from kvgate.fleet.records import node_records
from kvgate.policy.loader import parse_policy, parse_policy_text

REPO = Path(__file__).resolve().parents[2]
NEEDS = [t for t in ("luajit", "redis-server", "nginx") if not shutil.which(t)]


@pytest.mark.skipif(bool(NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_bench_render_small(tmp_path: Path) -> None:
    out = tmp_path / "render.json"
    res = CliRunner().invoke(render_command, ["--nodes", "40", "--pools", "4", "--rounds", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "total (target < 1000 ms)" in res.output and "share of one core" in res.output
    assert ("✓ apply total" in res.output) or ("✗ apply total" in res.output)
    rep = json.loads(out.read_text())
    app = rep["apply"]
    assert (app["nodes"], app["pools"], app["rounds"]) == (40, 4, 2)
    assert set(APPLY_STEPS) | set(EXTRA_STEPS) == set(app["steps"])
    for step in app["steps"].values():
        assert len(step["runs_ms"]) in (1, 2, 3) and 0 <= step["p50_ms"] <= step["max_ms"]
    assert app["total_steps"] == list(APPLY_STEPS)
    assert app["total_p50_ms"] == pytest.approx(sum(app["steps"][s]["p50_ms"] for s in APPLY_STEPS), abs=0.01)
    # 40 nodes at weight=100: 160 × 100 points each, a few lost to equal hashes at most
    assert 40 * 16000 - 20 <= app["ring_points"] <= 40 * 16000
    assert app["single_ring_points"] == app["ring_points"] or app["single_ring_points"] > 0
    rec = rep["reconcile"]
    assert (rec["nodes"], rec["rounds"], rec["interval_s"]) == (40, 2, 2.0)
    assert set(rec["cpu"]) == {"reports_cpu_ms", "tick_probe_cpu_ms", "tick_cpu_ms", "total_cpu_ms", "redis_cpu_ms"}
    assert rec["core_share_max"] == pytest.approx(rec["cpu"]["total_cpu_ms"]["max_ms"] / 2000, abs=1e-3)
    assert rec["states"] == {"active": 40}  # every stand-in engine answered its probes
    assert rep["ok"] == (app["ok"] and rec["ok"])


def test_policy_of_n_nodes_in_p_pools_is_valid() -> None:
    policy = parse_policy(policy_data(1000, 20))
    assert len(policy.pools) == 20 and len(policy.nodes()) == 1000
    assert {len(p.nodes) for p in policy.pools} == {50}
    assert len(parse_policy(policy_data(10, 3)).nodes()) == 10


@pytest.mark.parametrize("name", ["demo.yaml", "compose.yaml"])
def test_libyaml_loader_reads_the_policies_as_before(name: str) -> None:
    text = (REPO / "policies" / name).read_text()
    assert parse_policy_text(text, name) == parse_policy(yaml.safe_load(text), name)
    big = yaml.safe_dump(policy_data(200, 5), sort_keys=False)
    assert parse_policy_text(big) == parse_policy(yaml.safe_load(big))


def test_gateway_samples_match_prometheus_client() -> None:
    ids = [f"n{i:04d}" for i in range(30)]
    text = metrics_text(ids, {i: "pool00" for i in ids}).decode()
    text += ('# HELP kvgate_request_seconds x\n# TYPE kvgate_request_seconds histogram\n'
             'kvgate_request_seconds_bucket{pool="p",le="0.5"} 3\nkvgate_request_seconds_count{pool="p"} 3\n'
             'kvgate_requests_total{pool="p",node="n1",status="200",tenant="a\\"b\\\\c\\nd"} 12\n'
             'kvgate_requests_total{pool="p",node="n1",status="503",tenant="t\\x",} 3 1700000000000\n'
             'kvgate_ratelimited_total{tenant="t"} 1e3\nkvgate_failovers_total 4\n'
             'kvgate_upstream_inflight{node="n9"} +Inf\n')
    want = [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in _WANTED]
    assert list(gateway_samples(text)) == want and len(want) > 150


def test_probe_reasons() -> None:
    """The blocking probe and the aiohttp one (probe_all's path for http:// engines) give
    the reasons requests gave."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/slow"):
                time.sleep(1.0)
            self.send_response(200 if self.path == "/health" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    junk = socket.socket()
    junk.bind(("127.0.0.1", 0))
    junk.listen()

    def not_http() -> None:
        while True:
            try:
                conn, _ = junk.accept()
            except OSError:
                return
            conn.recv(1000)
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conn.close()

    threading.Thread(target=not_http, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    want = {
        "ok": (f"http://127.0.0.1:{port}", None),
        "name": (f"http://localhost:{port}", None),
        "v1": (f"http://127.0.0.1:{port}/v1", "health probe answered HTTP 503"),
        "slow": (f"http://127.0.0.1:{port}/slow", "health probe failed: ReadTimeout"),
        "dead": (f"http://127.0.0.1:{dead}", "health probe failed: ConnectionError"),
        "junk": (f"http://127.0.0.1:{junk.getsockname()[1]}", "health probe failed: ConnectionError"),
        "schema": ("127.0.0.1:8000", "health probe failed: MissingSchema"),
    }
    try:
        assert {k: probe(url, 0.5) for k, (url, _) in want.items()} == {k: w for k, (_, w) in want.items()}
        assert probe_all({k: url for k, (url, _) in want.items()}, 0.5) == {k: w for k, (_, w) in want.items()}
        assert list(probe_all({k: url for k, (url, _) in want.items()}, 0.5)) == list(want)  # in the given order
    finally:
        srv.shutdown()
        junk.close()


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.trips = 0

    def put_node(self, record: dict) -> None:
        self.trips += 1
        self.data[record["id"]] = json.dumps(record, sort_keys=True)

    def put_nodes(self, records: list[dict]) -> None:
        self.trips += 1
        for r in records:
            self.data[r["id"]] = json.dumps(r, sort_keys=True)



class _Plane:
    def __init__(self, records) -> None:
        from kvgate.control.metrics import ControlMetrics

        self.nodes = dict(records)
        self.store = _Store()
        self.metrics = ControlMetrics()
        self.policy = None

    def put_record(self, rec) -> None:
        self.store.put_node(rec.to_json())

    def put_records(self, recs) -> None:
        self.store.put_nodes([r.to_json() for r in recs])

    def event(self, *a, **kw) -> None:
        pass


def test_saves_are_stored_in_one_round_trip_with_the_same_result() -> None:
    recs = node_records({f"n{i}": {"id": f"n{i}", "pool": "p", "state": "active", "url": f"http://127.0.0.1:{9000 + i}"}
                         for i in range(5)})
    changes = []
    for i, rec in enumerate(recs.values()):
        changes += [Checked(rec.id, passed=True), Save(rec.evolve(reason=f"r{i}"))]
    changes.append(Save(recs["n1"].evolve(reason="later"), stored=False))  # memory only
    changes.append(Save(recs["n2"].evolve(reason="again")))  # the latest stored one wins
    changes.append(transition(recs["n3"].evolve(reason="r3"), "draining", "drain", 1.0, action="drain"))
    batched, one_by_one = _Plane(recs), _Plane(recs)
    effects.apply_changes(batched, changes)
    for c in changes:  # what apply_changes did before: every stored record written at once
        effects.apply_changes(one_by_one, [c])
    assert batched.store.data == one_by_one.store.data
    assert batched.nodes == one_by_one.nodes
    assert batched.store.trips == 2 < one_by_one.store.trips  # the saves before the transition, the transition
