"""`kvgate up / status / replay / down` end to end, as a user runs them (real processes)."""

import json
from collections import defaultdict
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"

from gwfixtures import free_port
from gwfixtures import kvgate_cli as kvgate

pytestmark = pytest.mark.integration


def conversation_subset(path: Path, n: int) -> list[dict]:
    """~n requests of the real trace that belong to multi-turn conversations, in arrival order.

    Consecutive requests of the trace rarely share more than the common first block (turns of
    one conversation are minutes apart), so a short replay takes whole conversations: requests
    grouped by their second block id, groups of 3+ turns, arrivals re-spaced 40 ms apart.
    """
    groups = defaultdict(list)
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if len(rec["hash_ids"]) > 1:
                groups[rec["hash_ids"][1]].append(rec)
    picked = []
    for recs in groups.values():
        if len(recs) >= 3:
            picked.extend(recs[:5])
        if len(picked) >= n:
            break
    picked.sort(key=lambda r: r["timestamp"])
    for i, rec in enumerate(picked):
        rec["timestamp"] = i * 40
    return picked


@pytest.fixture
def stack(tmp_path):
    ports = [free_port() for _ in range(8)]
    policy = tmp_path / "policy.yaml"
    nodes = "\n".join(f'      - {{id: n{i + 1}, url: "http://127.0.0.1:{p}", simulate: true}}'
                      for i, p in enumerate(ports[2:6]))
    policy.write_text(f"""
version: 1
gateway: {{listen: "127.0.0.1:{ports[0]}", internal_listen: "127.0.0.1:{ports[7]}", worker_processes: 2, debug_headers: true}}
redis: {{url: "redis://127.0.0.1:{ports[1]}/0"}}
control: {{listen: "127.0.0.1:{ports[6]}"}}
pools:
  - name: default
    models: [demo-model]
    balancer: chash
    prefix_chars: 4096
    nodes:
{nodes}
simulator: {{model: demo-model, time_scale: 0.01, num_gpu_blocks: 65536, stream_interval: 4}}
""")
    run_dir = tmp_path / "run"
    yield run_dir, policy, ports
    kvgate(run_dir, "down")


@pytest.mark.skipif(not TRACE.exists(), reason="needs ../shared/traces (the project's shared folder)")
def test_up_status_replay_down(stack, tmp_path):
    run_dir, policy, ports = stack
    up = kvgate(run_dir, "up", str(policy))
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"http://127.0.0.1:{ports[0]}/v1" in up.stdout

    again = kvgate(run_dir, "up", str(policy))  # idempotent
    assert again.returncode == 0, again.stderr
    assert "running" in again.stdout and "control   running (policy version 1)" in again.stdout

    st = kvgate(run_dir, "status", "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    parts = {p["name"]: p for p in json.loads(st.stdout)}
    assert set(parts) == {"redis", "sim-n1", "sim-n2", "sim-n3", "sim-n4", "nginx", "control",
                          "agent-n1", "agent-n2", "agent-n3", "agent-n4", "batch-worker"}
    assert all(p["healthy"] for p in parts.values())

    trace = tmp_path / "conversations.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in conversation_subset(TRACE, 100)))
    report = tmp_path / "report.json"
    rp = kvgate(run_dir, "replay", str(trace), "--speedup", "2", "--max-tokens-cap", "8",
                "--policies", "round_robin,chash", "--json", str(report), timeout=300)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    data = json.loads(report.read_text())
    assert list(data) == ["round_robin", "chash"]
    for name, r in data.items():
        assert set(r) == {"requests_ok", "requests_failed", "hit_ratio", "ceiling", "ratio_to_ceiling",
                          "imbalance", "ttft_p50_s", "ttft_p99_s"}
        assert r["requests_failed"] == 0 and r["requests_ok"] >= 100
    assert data["chash"]["hit_ratio"] > 1.5 * data["round_robin"]["hit_ratio"], data
    assert data["chash"]["ratio_to_ceiling"] >= 0.9, data
    assert "prefill tokens saved vs round_robin" in rp.stdout

    # the policy's own balancer is back after the replay
    conf = (run_dir / "nginx" / "conf" / "nginx.conf").read_text()
    assert 'require("kvgate.balancer").balance(' in conf  # chash: the Lua ring

    down = kvgate(run_dir, "down")
    assert down.returncode == 0
    assert kvgate(run_dir, "status").returncode == 1
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{ports[0]}/kvgate/health", timeout=1)
