"""The admin page's pure helpers: the policy editor's annotated lines and diff, safe redirects."""

from __future__ import annotations

import pytest
from flask import Flask

from kvgate.web.admin.editor import annotate, diff_lines
from kvgate.web.admin.views import _safe_next

TEXT = "version: 1\npools:\n  - name: a\n    balancer: ketama\n"


def test_annotate_puts_each_issue_at_its_line_and_keeps_the_rest_apart():
    lines, unplaced = annotate(TEXT, [{"path": "pools[0].balancer", "reason": "bad"},
                                      {"path": "", "reason": "nginx refused it"}])
    assert [ln["no"] for ln in lines] == [1, 2, 3, 4]
    assert lines[3]["issues"] == [{"path": "pools[0].balancer", "reason": "bad", "line": 4}]
    assert all(not ln["issues"] for ln in lines[:3])
    assert unplaced == [{"path": "", "reason": "nginx refused it"}]


def test_annotate_empty_text():
    lines, unplaced = annotate("", [{"path": "line 1, column 1", "reason": "empty"}])
    assert len(lines) == 1 and lines[0]["issues"] and not unplaced


def test_diff_lines_kinds():
    d = diff_lines("a: 1\nb: 2\n", "a: 1\nb: 3\n", "running", "edit")
    kinds = [x["kind"] for x in d]
    assert kinds[:3] == ["file", "file", "hunk"]
    assert {"kind": "del", "text": "-b: 2"} in d and {"kind": "add", "text": "+b: 3"} in d
    assert diff_lines("same\n", "same\n", "x", "y") == []


@pytest.mark.parametrize("target, ok", [
    ("/admin/pools", True), ("/admin/events?node=n1", True),
    ("https://evil.example/", False), ("//evil.example/admin", False), ("/\\evil.example", False),
    ("javascript:alert(1)", False), ("/api/v1/nodes", False), (None, False), ("", False),
])
def test_safe_next(target, ok):
    app = Flask(__name__)
    app.add_url_rule("/admin/", "admin.fleet", lambda: "")
    with app.test_request_context():
        assert (_safe_next(target) == target) is ok
        if not ok:
            assert _safe_next(target) == "/admin/"


def test_gpu_cells_sum_memory_and_average_utilisation_over_devices():
    from kvgate.web.admin.fleet import _gpu_cells

    report = {"gpu": {"status": "ok", "devices": [
        {"name": "NVIDIA H200", "memory_used_bytes": 60 * 2**30, "memory_total_bytes": 141 * 2**30,
         "utilization_pct": 80},
        {"name": "NVIDIA H200", "memory_used_bytes": 40 * 2**30, "memory_total_bytes": 141 * 2**30,
         "utilization_pct": 40}]}}
    assert _gpu_cells(report) == ("100.0 / 282.0 GiB", "60%", "2 × NVIDIA H200")
    no_nvml = {"gpu": {"status": "unavailable", "reason": "NVML Shared Library Not Found"}}
    assert _gpu_cells(no_nvml) == ("no GPU", "no GPU", "no GPU figures: NVML Shared Library Not Found")
    assert _gpu_cells(None)[0] == "—"
