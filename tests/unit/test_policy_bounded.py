"""chash_bounded's policy fields: defaults, and a bad value refused at its field's path."""

from __future__ import annotations

import pytest

from kvgate.policy import PolicyError, parse_policy_text

POOL = """
pools:
  - name: p
    models: [m]
    balancer: chash_bounded
{extra}    nodes:
      - {{id: a, url: "http://127.0.0.1:9001"}}
"""


def test_defaults() -> None:
    pool = parse_policy_text(POOL.format(extra="")).pools[0]
    assert (pool.balancer, pool.bound_factor, pool.bound_load, pool.saturated_queue) == \
        ("chash_bounded", 1.25, "prefill_tokens", 16)
    pool = parse_policy_text(POOL.format(extra="    saturated_queue: null\n    bound_load: requests\n")).pools[0]
    assert pool.saturated_queue is None and pool.bound_load == "requests"


@pytest.mark.parametrize("extra, path, words", [
    ("    bound_factor: 1\n", "pools[0].bound_factor", "greater than 1"),
    ("    bound_factor: 0.5\n", "pools[0].bound_factor", "greater than 1"),
    ("    bound_factor: fast\n", "pools[0].bound_factor", "number"),
    ("    saturated_queue: -1\n", "pools[0].saturated_queue", "greater than or equal to 0"),
    ("    saturated_queue: 2.5\n", "pools[0].saturated_queue", "integer"),
    ("    bound_load: bytes\n", "pools[0].bound_load", "prefill_tokens"),
])
def test_bad_value_is_named(extra: str, path: str, words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy_text(POOL.format(extra=extra))
    found = [str(i) for i in info.value.issues]
    assert any(i.startswith(path + ":") and words in i for i in found), found
