"""The policy editor's helpers: issues placed on their YAML lines, a line diff."""

from __future__ import annotations

import difflib
from typing import Any

from ...policy.locate import lines_of


def annotate(text: str, issues: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The policy text as numbered lines with each issue attached to the line of its field.

    Returns ``(lines, unplaced)``: ``lines`` = ``[{"no", "text", "issues": [...]}]``;
    issues whose line cannot be told (the whole document, nginx's own refusal) are in ``unplaced``."""
    lines = [{"no": i + 1, "text": t, "issues": []} for i, t in enumerate(text.splitlines() or [""])]
    unplaced = []
    for issue, no in zip(issues, lines_of(text, [i.get("path") or "" for i in issues])):
        if no is not None and 1 <= no <= len(lines):
            issue = {**issue, "line": no}
            lines[no - 1]["issues"].append(issue)
        else:
            unplaced.append(issue)
    return lines, unplaced


def diff_lines(old: str, new: str, old_name: str, new_name: str) -> list[dict[str, str]]:
    """A unified diff (difflib) as ``[{"kind": "add"|"del"|"hunk"|"file"|"ctx", "text"}]``."""
    out = []
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), old_name, new_name, lineterm="", n=3):
        if line.startswith(("+++", "---")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append({"kind": kind, "text": line})
    return out
