"""The semantic service's in-memory indexes (kvgate.semantic.index): exact flat search and
hnswlib, per scope, with removal and replacement."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.semantic.index import make_index

KINDS = ["flat", pytest.param("hnsw", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("hnswlib") is None, reason="hnswlib not installed"))]


def unit(rng, n: int, dim: int = 384) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", KINDS)
def test_nearest_within_the_scope_only(kind: str) -> None:
    rng = np.random.default_rng(1)
    x = unit(rng, 300)
    ix = make_index(kind)
    for i in range(200):
        ix.add("s1", f"a{i}", x[i])
    for i in range(200, 300):
        ix.add("s2", f"b{i}", x[i])
    assert len(ix) == 300
    q = x[7] + 0.01 * unit(rng, 1)[0]
    q /= np.linalg.norm(q)
    (best, sim), *_ = ix.search("s1", q, 3)
    assert best == "a7" and 0.99 < sim <= 1.0001
    assert all(k.startswith("b") for k, _ in ix.search("s2", q, 5))  # never another scope's entry
    assert ix.search("nope", q, 1) == []
    sims = [s for _, s in ix.search("s1", q, 5)]
    assert sims == sorted(sims, reverse=True)


@pytest.mark.parametrize("kind", KINDS)
def test_remove_and_replace(kind: str) -> None:
    rng = np.random.default_rng(2)
    x = unit(rng, 50)
    ix = make_index(kind)
    for i in range(50):
        ix.add("s", str(i), x[i])
    assert ix.remove("3") and not ix.remove("3")
    assert "3" not in ix and len(ix) == 49
    assert all(k != "3" for k, _ in ix.search("s", x[3], 49))
    ix.add("s", "4", x[3])  # replaced: one entry, the new vector
    assert len(ix) == 49
    assert ix.search("s", x[3], 1)[0][0] == "4"
    for i in range(50):
        ix.remove(str(i))
    assert len(ix) == 0 and ix.search("s", x[0], 1) == []
    ix.add("s", "again", x[0])  # a scope emptied and used again
    assert ix.search("s", x[0], 1)[0][0] == "again"


def test_flat_grows_past_its_initial_capacity() -> None:
    rng = np.random.default_rng(3)
    x = unit(rng, 1000)
    ix = make_index("flat")
    for i in range(1000):
        ix.add("s", str(i), x[i])
    assert [ix.search("s", x[i], 1)[0][0] for i in (0, 17, 999)] == ["0", "17", "999"]


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="flat or hnsw"):
        make_index("annoy")
