"""kvgate.policy.locate: the line of a policy issue's field, for the admin page's inline errors."""

from __future__ import annotations

import pytest

from kvgate.policy import PolicyError, parse_policy_text
from kvgate.policy.locate import line_of, path_tokens

TEXT = """\
version: 1
gateway:
  listen: 127.0.0.1:8080
pools:
  - name: a
    models: [m]
    balancer: ketama
    nodes:
      - {id: n1, url: "http://127.0.0.1:8101"}
      - id: n2
        url: "not a url"
        wieght: 3
simulator: {model: m}
"""


def test_path_tokens():
    assert path_tokens("pools[0].nodes[1].url") == ["pools", 0, "nodes", 1, "url"]
    assert path_tokens("gateway.listen") == ["gateway", "listen"]


@pytest.mark.parametrize("path, line", [
    ("gateway.listen", 3),
    ("pools[0].balancer", 7),
    ("pools[0].nodes[0].url", 9),      # a flow mapping: the item's line
    ("pools[0].nodes[1].url", 11),
    ("pools[0].nodes[1].wieght", 12),  # an unknown field: its own key
    ("pools[0].nodes[1].weight_x", 10),  # missing: the mapping that should hold it
    ("pools[3].name", 4),               # no such item: the list's key
    ("redis.url", 1),                   # no redis section at all: the document's first line
    ("line 7, column 3", 7),            # a YAML syntax error
    ("", None),
])
def test_line_of(path, line):
    assert line_of(TEXT, path) == line


def test_every_issue_of_a_real_validation_is_placed():
    with pytest.raises(PolicyError) as exc:
        parse_policy_text(TEXT)
    for issue in exc.value.issues:
        assert line_of(TEXT, issue.path) is not None, issue


def test_broken_yaml_gives_none_for_a_field_path():
    assert line_of("a: [1, 2\n", "a") is None
