"""`kvgate bench peers` end to end with kvgate rows only (the peer routers are never a test
dependency): its own stack on free ports, a row per balancer, the table and the JSON, and
nothing left running afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# 3 conversations of 5 turns, each turn the previous prompt plus two blocks, turns interleaved
# 80 ms apart: under chash a conversation stays on one engine and every turn reuses the last;
# round robin over 4 engines moves each conversation's next turn to another engine (3 mod 4)
CONVERSATIONS, TURNS = 3, 5


def _trace(path: Path) -> int:
    lines = []
    for turn in range(TURNS):
        for conv in range(CONVERSATIONS):
            ids = [0] + [1000 * (conv + 1) + i for i in range(2 + 2 * turn)]
            lines.append({"timestamp": 80 * len(lines), "input_length": 512 * len(ids), "output_length": 4,
                          "hash_ids": ids})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return len(lines)


POLICY = """
version: 1
gateway: {listen: "127.0.0.1:1", internal_listen: "127.0.0.1:2", worker_processes: 2}
redis: {url: "redis://127.0.0.1:3/0"}
control: {listen: "127.0.0.1:4"}
pools:
  - name: default
    models: [demo-model]
    balancer: chash
    prefix_chars: 4096
    nodes:
      - {id: n1, url: "http://127.0.0.1:5", simulate: true}
      - {id: n2, url: "http://127.0.0.1:6", simulate: true}
      - {id: n3, url: "http://127.0.0.1:7", simulate: true}
      - {id: n4, url: "http://127.0.0.1:8", simulate: true}
simulator: {model: demo-model, time_scale: 0.01, num_gpu_blocks: 65536, stream_interval: 4}
"""


def test_bench_peers_kvgate_rows(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    n = _trace(trace)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)  # ports 1-8: the bench moves every one to a free port
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "-m", "kvgate", "bench", "peers", str(trace), "--policy", str(policy),
                           "--balancers", "round_robin,chash", "--peers", "none", "--speedup", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {(r["router"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [("kvgate", "round_robin"), ("kvgate", "chash")]
    for r in rows.values():
        assert (r["requests_ok"], r["requests_failed"]) == (n, 0)
        assert 0 < r["hit_ratio"] < 1 and 0 < r["ceiling"] < 1 and r["imbalance"] >= 1
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < 5
        assert sorted(r["prefill_tokens"]) == ["n1", "n2", "n3", "n4"]
    rr, ch = rows[("kvgate", "round_robin")], rows[("kvgate", "chash")]
    # chash keeps every conversation on one engine: each turn reuses the whole previous prompt
    assert ch["hit_ratio"] > rr["hit_ratio"] + 0.15 and ch["ratio_to_ceiling"] > 0.9
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("│ kvgate")]
    assert [ln.split("│")[2].strip() for ln in table] == ["round_robin", "chash"]
    assert f"{ch['hit_ratio']:.1%}" in table[1] and f"0 / {n}" in table[1]
    # its stack is gone: the work dir (run dir, logs) is removed after a clean run
    work = re.search(r"work dir (\S+)", proc.stderr.replace("\n", " "))
    assert work and not Path(work.group(1)).exists()
