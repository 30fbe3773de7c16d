"""kvgate bench peers: its arguments, the bench policy, the peers' command lines and the table
(the bench itself needs the peer routers and minutes: run it by hand, figures in
docs/benchmarks.md; tests/integration/test_stack_bench_peers.py runs it with kvgate rows only)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvgate.bench import peers as p
from kvgate.bench.replay import PolicyReport
from kvgate.bench.trace import TraceRequest
from kvgate.policy import model
from kvgate.policy.loader import parse_policy

REPO = Path(__file__).resolve().parents[2]


def test_balancers_are_read_from_the_schema_and_checked() -> None:
    known = p.balancers_of_schema()
    assert known == list(typing.get_args(model.Balancer)) and {"chash", "round_robin"} <= set(known)
    assert p.parse_balancers(None, known) == known
    assert p.parse_balancers("chash, round_robin", known) == ["chash", "round_robin"]
    assert p.parse_balancers("none", known) == []
    with pytest.raises(click.BadParameter, match="unknown balancer.*nope"):
        p.parse_balancers("chash,nope", known)
    with pytest.raises(click.BadParameter, match="twice"):
        p.parse_balancers("chash,chash", known)


def test_peer_rows_by_label_router_or_variant() -> None:
    assert p.parse_peers(None) == list(p.PEERS) and p.parse_peers("none") == []
    assert [x.label for x in p.parse_peers("smg")] == ["smg cache_aware", "smg prefix_hash"]
    assert [x.label for x in p.parse_peers("vllm-router:consistent_hash,smg:prefix_hash")] == \
        ["vllm-router consistent_hash", "smg prefix_hash"]
    with pytest.raises(click.BadParameter, match="unknown peer"):
        p.parse_peers("sglang-router:consistent_hash")  # sglang-router 0.3.2 has none
    v = p.parse_peer_variant("sglang-router:cache_aware --balance-abs-threshold 16")
    assert (v.router, v.policy, v.settings) == ("sglang-router", "cache_aware", ("--balance-abs-threshold", "16"))
    assert p.parse_peer_variant("vllm-router:consistent_hash").session_header  # keyed like its default row
    for bad in ("haproxy:roundrobin", "smg", "'unclosed"):
        with pytest.raises(click.BadParameter):
            p.parse_peer_variant(bad)


def test_only_vllm_routers_consistent_hash_gets_the_session_header() -> None:
    assert [x.label for x in p.PEERS if x.session_header] == ["vllm-router consistent_hash"]
    turn1 = TraceRequest(0, 0.0, 2000, 10, (0, 42, 43, 44))
    turn2 = TraceRequest(1, 5.0, 3000, 10, (0, 42, 43, 44, 45, 46))
    other = TraceRequest(2, 6.0, 2000, 10, (0, 77, 78, 79))
    assert p.conversation_id(turn1) == p.conversation_id(turn2) == "conv-42"
    assert p.conversation_id(other) != p.conversation_id(turn1)
    assert p.conversation_id(TraceRequest(3, 0.0, 100, 1, (5,))) == "conv-5"


def test_peer_command_lines_bind_loopback_and_carry_the_settings(tmp_path: Path) -> None:
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    by_router = {}
    for peer in p.PEERS:
        cmd = p.peer_command(tmp_path, peer, 5000, 5001, workers)
        by_router.setdefault(peer.router, cmd)
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
        assert cmd[cmd.index("--worker-urls") + 1:][:2] == workers
        assert cmd[cmd.index("--policy") + 1] == peer.policy and cmd[-len(peer.settings) or len(cmd):] == \
            (list(peer.settings) or [])
    assert by_router["sglang-router"][:2] == [str(tmp_path / "bin" / "sglang-router"), "launch"]
    # sglang-router 0.3.2 also installs a command named smg: smg runs as its module
    assert by_router["smg"][:4] == [str(tmp_path / "bin" / "python"), "-m", "smg", "launch"]
    assert by_router["vllm-router"][0] == str(tmp_path / "bin" / "vllm-router")
    assert not p.peer_available(tmp_path, "smg") and not p.peer_available(tmp_path, "vllm-router")
    (tmp_path / "lib" / "python3.11" / "site-packages" / "smg").mkdir(parents=True)
    (tmp_path / "lib" / "python3.11" / "site-packages" / "smg" / "__init__.py").write_text("")
    assert p.peer_available(tmp_path, "smg")


def test_bench_policy_moves_every_port_and_stays_valid() -> None:
    import yaml

    doc = yaml.safe_load((REPO / "policies" / "demo.yaml").read_text())
    out = p.bench_policy_doc(doc)
    policy = parse_policy(out, "bench")
    addrs = [policy.gateway.listen, policy.gateway.internal_listen, policy.control.listen, policy.redis.url,
             *(n.url for n in policy.nodes())]
    assert len(set(addrs)) == len(addrs) == 8
    for old in ("127.0.0.1:8080", "127.0.0.1:9080", "127.0.0.1:9090", "6390", "127.0.0.1:8101"):
        assert not any(old in a for a in addrs)
    assert doc["gateway"]["listen"] == "127.0.0.1:8080"  # the input is not changed
    assert policy.pools[0].prefix_chars == 4096 and policy.simulator == parse_policy(doc, "demo").simulator
    doc["pools"][0]["nodes"][1]["simulate"] = False
    with pytest.raises(click.UsageError, match="n2 is not `simulate: true`"):
        p.bench_policy_doc(doc)


def _report(hit: float, ceiling: float, failed: int = 0) -> PolicyReport:
    return PolicyReport(requests_ok=10 - failed, requests_failed=failed, hit_ratio=hit, ceiling=ceiling,
                        ratio_to_ceiling=round(hit / ceiling, 4), imbalance=1.1, ttft_p50_s=0.1234, ttft_p99_s=1.5,
                        prefill_tokens={"n1": 1.5e6, "n2": 0.5e6}, engine_ttft_mean_s=float("nan"))


def test_table_has_one_row_per_router_and_policy() -> None:
    from rich.console import Console

    res = p.BenchResult("trace.jsonl", 10, 10.0, 0.2, [
        p.Row("kvgate", "chash", "demo.yaml, balancer: chash", _report(0.19, 0.2)),
        p.Row("smg", "prefix_hash", "--policy prefix_hash --prefix-token-count 1024", _report(0.2, 0.2, failed=2)),
    ])
    console = Console(width=200, record=True)
    console.print(p.render_table(res))
    text = console.export_text()
    assert "pooled ceiling 20.0%" in text
    lines = [ln for ln in text.splitlines() if "kvgate" in ln and "chash" in ln]
    assert lines and all(s in lines[0] for s in ("19.0%", "0.95", "1.10", "123 ms", "1,500 ms", "2.00M", "0 / 10"))
    md = p.render_markdown(res).splitlines()
    assert md[2].startswith("| kvgate | chash | 19.0% | 0.95 | 1.10 | 123 ms | 1,500 ms | - | 2.00M | 0 / 10 |")
    assert md[3].endswith("| 2 / 10 |")
    doc = res.as_json()
    assert json.loads(json.dumps(doc))["rows"][1]["router"] == "smg"
    assert doc["rows"][0]["ratio_to_ceiling"] == 0.95 and doc["rows"][0]["settings"].endswith("chash")


def test_cli_refuses_bad_arguments_before_starting_anything(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n")
    policy = str(REPO / "policies" / "demo.yaml")
    run = CliRunner().invoke
    res = run(p.peers_command, [str(trace), "--policy", policy, "--balancers", "nope"])
    assert res.exit_code == 2 and "unknown balancer" in res.output
    res = run(p.peers_command, [str(trace), "--policy", policy, "--peers", "smg"], env={"KVGATE_PEERS_VENV": ""})
    assert res.exit_code == 2 and "--peers-venv" in res.output
    res = run(p.peers_command, [str(trace), "--policy", policy, "--balancers", "none", "--peers", "none"])
    assert res.exit_code == 2 and "nothing to run" in res.output
    res = run(p.peers_command, [str(trace), "--policy", policy, "--json", str(tmp_path / "no" / "x.json")])
    assert res.exit_code == 2 and "not a writable folder" in res.output


def test_cli_refuses_a_policy_with_an_engine_it_cannot_start(tmp_path: Path) -> None:
    import yaml

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n")
    doc = yaml.safe_load((REPO / "policies" / "demo.yaml").read_text())
    doc["pools"][0]["nodes"][0]["simulate"] = False
    policy = tmp_path / "real.yaml"
    policy.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(p.peers_command, [str(trace), "--policy", str(policy), "--peers", "none"])
    assert res.exit_code == 2 and "n1 is not `simulate: true`" in res.output


def test_comparison_takes_each_sides_best_by_ratio_then_p99() -> None:
    def row(router: str, policy: str, ratio: float, p99: float) -> p.Row:
        r = _report(0.2 * ratio, 0.2)
        r.ratio_to_ceiling, r.ttft_p99_s = ratio, p99
        return p.Row(router, policy, "", r)

    res = p.BenchResult("t", 10, 10.0, 0.2, [
        row("kvgate", "round_robin", 0.45, 0.7), row("kvgate", "chash", 1.035, 1.0),
        row("kvgate", "prefix", 1.03, 0.8),  # within 0.01 of chash: the lower p99 wins
        row("smg", "prefix_hash", 1.00, 0.816), row("sglang-router", "round_robin", 0.43, 0.6),
    ])
    assert p.best_row(res.rows[:3]).policy == "prefix" and p.best_row([]) is None
    line = p.comparison(res)
    assert line.startswith("kvgate's best, prefix: 1.03 of the ceiling, TTFT p99 800 ms; the best peer, smg "
                           "prefix_hash: 1.00, 816 ms") and "(kvgate +0.03 of the ceiling, -16 ms p99)" in line
    assert p.comparison(p.BenchResult("t", 10, 10.0, 0.2, res.rows[:3])) is None
