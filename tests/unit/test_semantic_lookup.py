"""SemanticCache.lookup's decisions that need no Redis (kvgate.semantic.service): a lookup the
gateway has given up on, a text past the model's length, guard rejections of candidates."""

from __future__ import annotations

import time

import pytest
import redis

from kvgate.semantic.service import SemanticCache


@pytest.fixture(scope="module")
def cache() -> SemanticCache:
    c = SemanticCache(redis.Redis(port=1, socket_connect_timeout=0.1), index="flat")
    for i, text in enumerate(["How do I enable dark mode?", "What is the fee for order 7310?"]):
        c._add(f"kvgate:sem:e:p:S:{i}", text, f"kvgate:cache:{i}", c.embedder.embed_one(text), time.time() + 60)
    return c


def test_a_lookup_that_waited_past_the_timeout_is_a_miss_at_once(cache: SemanticCache) -> None:
    r = cache.lookup("p", "S", "How do I enable dark mode?", 0.9, arrived=time.monotonic() - 1.0)
    assert r == {"hit": None, "similarity": None, "entry": None, "answer": None, "rejected": None, "ms": 0.0}


def test_guards_reject_candidates_above_the_threshold(cache: SemanticCache) -> None:
    assert cache.lookup("p", "S", "How do I disable dark mode?", 0.8)["rejected"] == "antonym"
    assert cache.lookup("p", "S", "What is the fee for order 7301?", 0.8)["rejected"] == "number"
    assert cache.lookup("p", "other", "How do I disable dark mode?", 0.8)["rejected"] is None  # no candidate


def test_a_text_past_the_model_length_is_never_compared(cache: SemanticCache) -> None:
    r = cache.lookup("p", "S", "How do I enable dark mode? " * 80, 0.8)
    assert r["hit"] is None and r["rejected"] == "length"
    assert cache.insert("p", "S", "x " * 600, "kvgate:cache:long") is None  # not stored (no Redis call)
