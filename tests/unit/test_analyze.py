"""kvgate analyze (issue 13 item 6): the seed's first-500-token measure against an independent
count, and the prefix-stability lint on a synthetic workload with a known answer."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from kvgate.analyze.lint import prefix_lint
from kvgate.analyze.stats import trace_stats
from kvgate.analyze.workload import load_workload

SYSTEM = " ".join(f"rule{i}" for i in range(3000))  # a long shared system prompt


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_first500_share_matches_an_independent_count(tmp_path: Path) -> None:
    # Mooncake lines: hash_ids are 512-token blocks; the first 500 tokens are the first block
    rows = [{"timestamp": i * 1000, "input_length": 1200, "output_length": 10, "hash_ids": ids}
            for i, ids in enumerate([[1, 2, 3], [1, 5, 6], [7, 8, 9], [1, 2, 10], [11, 12, 13]])]
    reqs = load_workload(_write(tmp_path / "t.jsonl", rows))
    firsts = Counter(r["hash_ids"][0] for r in rows)
    expected = sum(1 for r in rows if firsts[r["hash_ids"][0]] >= 2) / len(rows)
    assert trace_stats(reqs).first500_repeat_share == expected == 0.6


def _users(tmp_path: Path, id_first: bool) -> list:
    rows = []
    for u in range(20):
        system = f"user-{u}-id " + SYSTEM if id_first else SYSTEM + f" user-{u}-id"
        rows.append({"timestamp": u * 1000, "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": f"question {u}"}]})
    return load_workload(_write(tmp_path / f"u{id_first}.jsonl", rows))


def test_the_lint_flags_a_variable_id_before_the_shared_prompt(tmp_path: Path) -> None:
    bad = prefix_lint(_users(tmp_path, id_first=True))
    assert bad.applicable and bad.flagged >= 15, bad.as_json()
    assert bad.start_message == 0 and bad.start_mode is not None and bad.start_mode < 10
    assert bad.lost_tokens > 15 * 2000
    good = prefix_lint(_users(tmp_path, id_first=False))
    assert good.flagged == 0, good.as_json()
