"""The labelled set of ``kvgate bench semantic``: pairs of questions (``a`` cached, ``b`` asked)
that must hit (paraphrases) or must not (negations, antonyms, other numbers, dates,
identifiers, entities, unrelated questions, the same follow-up in another conversation).

Three files, written separately: ``labelled/tune.tsv`` (the thresholds and guards were tuned on
it), ``labelled/test.tsv`` (test-only: never looked at while tuning; the acceptance figures
are this file's) and ``labelled/holdout.tsv`` (held out: written later, on new topics and
wordings, after the guards and the threshold were fixed; never to be used for tuning — a
change made because of its figures would make it one more tuning set). Columns: ``kind expect a b context_a context_b`` (tab-separated; ``expect``
``hit`` or ``miss``; a context is the conversation before the question, empty for a single turn).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

DIR = Path(__file__).parent / "labelled"
SETS = {"tune": DIR / "tune.tsv", "test": DIR / "test.tsv", "holdout": DIR / "holdout.tsv"}
PARTS = {"tune": "tuned on", "test": "test-only", "holdout": "held out"}
"""What each shipped set is for (the bench labels its rows with it)."""


@dataclass(frozen=True)
class Pair:
    kind: str
    hit: bool
    a: str
    b: str
    context_a: str
    context_b: str


def load_pairs(name_or_path: str | Path) -> list[Pair]:
    """The pairs of ``tune``, ``test``, ``holdout`` or a TSV file; raises ValueError naming a bad row."""
    path = SETS.get(str(name_or_path), Path(name_or_path))
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        if header[:4] != ["kind", "expect", "a", "b"]:
            raise ValueError(f"{path}: line 1: the header must start with kind, expect, a, b")
        for n, row in enumerate(rows, 2):
            if not row:
                continue
            row += [""] * (6 - len(row))
            kind, expect, a, b, ca, cb = row[:6]
            if expect not in ("hit", "miss") or not a or not b:
                raise ValueError(f"{path}: line {n}: expect must be hit or miss and a, b non-empty")
            out.append(Pair(kind, expect == "hit", a, b, ca, cb))
    return out
