"""kvgate.policy.edit: bumping cache.namespace_version keeps the operator's YAML as written."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from kvgate.policy import parse_policy_text
from kvgate.policy.edit import bump_namespace_version

REPO = Path(__file__).resolve().parents[2]
DEMO = (REPO / "policies" / "demo.yaml").read_text()


def _changed(old: str, new: str) -> list[str]:
    return [d for d in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
            if d[:1] in "+-" and not d.startswith(("+++", "---"))]


@pytest.mark.parametrize("name", ["demo.yaml", "compose.yaml"])
def test_only_the_version_line_changes(name: str) -> None:
    text = (REPO / "policies" / name).read_text()
    before = parse_policy_text(text)
    new, version = bump_namespace_version(text)
    assert version == before.cache.namespace_version + 1
    assert _changed(text, new) == [f"-  namespace_version: {version - 1}", f"+  namespace_version: {version}"]
    after = parse_policy_text(new)
    assert after.cache.namespace_version == version
    assert after.model_dump(exclude={"cache"}) == before.model_dump(exclude={"cache"})
    again, v2 = bump_namespace_version(new)
    assert v2 == version + 1 and parse_policy_text(again).cache.namespace_version == v2


def test_comments_order_and_flow_style_kept() -> None:
    text = """\
# top comment
version: 1
cache:
  enabled: true          # eol comment
  namespace_version: 7   # bump me from the admin page
  ttl_s: 60
# between sections
pools:
- name: p                # the pool
  models: ['m']
  nodes:
  - {id: n1, url: "http://127.0.0.1:9001", weight: 2}
"""
    new, v = bump_namespace_version(text)
    assert v == 8
    assert new == text.replace("namespace_version: 7 ", "namespace_version: 8 ")
    assert parse_policy_text(new).cache.namespace_version == 8


def test_missing_version_and_missing_cache_section() -> None:
    no_version = "\n".join(line for line in DEMO.splitlines() if "namespace_version" not in line) + "\n"
    new, v = bump_namespace_version(no_version)
    assert v == 2  # absent means 1
    assert _changed(no_version, new) == ["+  namespace_version: 2"]
    assert new.index("max_entry_bytes") < new.index("namespace_version: 2") < new.index("\npools:")
    assert parse_policy_text(new).cache.namespace_version == 2

    no_cache = re.sub(r"\ncache:\n(?:  .*\n)+\n", "\n", DEMO)
    assert "cache:" not in no_cache
    new, v = bump_namespace_version(no_cache)
    assert v == 2
    assert sorted(_changed(no_cache, new)) == ["+", "+  namespace_version: 2", "+cache:"]
    # a section of its own, before pools, set off by blank lines like the others
    assert "  timeout_ms: 200\n\ncache:\n  namespace_version: 2\n\npools:\n" in new
    policy = parse_policy_text(new)
    assert policy.cache.namespace_version == 2 and policy.cache.enabled is True  # defaults otherwise

    new, v = bump_namespace_version("version: 1\ncache:\npools: []\n")
    assert v == 2 and "cache:\n  namespace_version: 2\npools: []" in new

    new, v = bump_namespace_version("version: 1  # v\n")
    assert (new, v) == ("version: 1  # v\ncache:\n  namespace_version: 2\n", 2)


@pytest.mark.parametrize("text,message", [
    ("", "must be a YAML mapping"),
    ("- a\n- b\n", "must be a YAML mapping"),
    ("just a string\n", "must be a YAML mapping"),
    ("version: [1\n", "not valid YAML"),
    ("cache: [1, 2]\n", "cache must be a mapping"),
    ("cache: {namespace_version: two}\n", "namespace_version must be an integer"),
    ("cache: {namespace_version: true}\n", "namespace_version must be an integer"),
])
def test_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bump_namespace_version(text)
