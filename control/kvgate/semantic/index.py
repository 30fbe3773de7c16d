"""In-memory vector indexes, one per scope (a semantic candidate must share the scope exactly, so
a search never looks outside it).

- :class:`FlatIndex`: exact cosine by brute force (a matrix-vector product over numpy rows of
  unit vectors); the default — measured faster than HNSW up to 100,000 entries in one scope at
  384 dimensions (docs/benchmarks.md, ``kvgate bench semantic``), and exact.
- :class:`HnswIndex`: hnswlib (approximate nearest neighbours, cosine space), for very large
  scopes; needs the optional ``hnswlib`` package.

Both: ``add(scope, id, vec)``, ``remove(id)``, ``search(scope, vec, k) -> [(id, similarity)]``,
``len()``; ``vec`` a unit float32 vector of ``dim`` dimensions. Not thread-safe: the service
serialises calls with a lock.
"""

from __future__ import annotations

import numpy as np


class FlatIndex:
    """Exact brute-force cosine search per scope (rows of unit vectors, grown by doubling)."""

    kind = "flat"

    def __init__(self, dim: int = 384):
        self.dim = dim
        self._scopes: dict[str, _FlatScope] = {}
        self._where: dict[str, str] = {}  # id -> scope

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, id_: str) -> bool:
        return id_ in self._where

    def add(self, scope: str, id_: str, vec: np.ndarray) -> None:
        """Add (or replace) ``id_`` in ``scope``."""
        if id_ in self._where:
            self.remove(id_)
        self._scopes.setdefault(scope, _FlatScope(self.dim)).add(id_, vec)
        self._where[id_] = scope

    def remove(self, id_: str) -> bool:
        """Remove ``id_``; False when it was not there."""
        scope = self._where.pop(id_, None)
        if scope is None:
            return False
        s = self._scopes[scope]
        s.remove(id_)
        if not s.n:
            del self._scopes[scope]
        return True

    def search(self, scope: str, vec: np.ndarray, k: int = 1) -> list[tuple[str, float]]:
        """The ``k`` most similar entries of ``scope``, best first, as ``(id, cosine similarity)``."""
        s = self._scopes.get(scope)
        return s.search(vec, k) if s else []


class _FlatScope:
    def __init__(self, dim: int):
        self.mat = np.empty((16, dim), dtype=np.float32)
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}
        self.n = 0

    def add(self, id_: str, vec: np.ndarray) -> None:
        if self.n == len(self.mat):
            self.mat = np.concatenate([self.mat, np.empty_like(self.mat)])
        self.mat[self.n] = vec
        self.ids.append(id_)
        self.pos[id_] = self.n
        self.n += 1

    def remove(self, id_: str) -> None:
        i = self.pos.pop(id_)
        last = self.n - 1
        if i != last:  # move the last row into the hole
            self.mat[i] = self.mat[last]
            moved = self.ids[last]
            self.ids[i] = moved
            self.pos[moved] = i
        self.ids.pop()
        self.n -= 1

    def search(self, vec: np.ndarray, k: int) -> list[tuple[str, float]]:
        sims = self.mat[: self.n] @ vec
        k = min(k, self.n)
        top = np.argpartition(-sims, k - 1)[:k] if k < self.n else np.arange(self.n)
        top = top[np.argsort(-sims[top])]
        return [(self.ids[i], float(sims[i])) for i in top]


class HnswIndex:
    """Approximate cosine search per scope with hnswlib (``M=16``, ``ef_construction=200``,
    ``ef=64``); removed entries are marked deleted and their labels reused."""

    kind = "hnsw"

    def __init__(self, dim: int = 384, ef: int = 64):
        try:
            import hnswlib  # noqa: F401
        except ImportError:
            raise RuntimeError("semantic_service.index: hnsw needs the hnswlib package "
                               "(pip install 'kvgate[hnsw]'); or use index: flat") from None
        self.dim, self.ef = dim, ef
        self._scopes: dict[str, _HnswScope] = {}
        self._where: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, id_: str) -> bool:
        return id_ in self._where

    def add(self, scope: str, id_: str, vec: np.ndarray) -> None:
        if id_ in self._where:
            self.remove(id_)
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _HnswScope(self.dim, self.ef)
        s.add(id_, vec)
        self._where[id_] = scope

    def remove(self, id_: str) -> bool:
        scope = self._where.pop(id_, None)
        if scope is None:
            return False
        s = self._scopes[scope]
        s.remove(id_)
        if not s.labels:
            del self._scopes[scope]
        return True

    def search(self, scope: str, vec: np.ndarray, k: int = 1) -> list[tuple[str, float]]:
        s = self._scopes.get(scope)
        return s.search(vec, k) if s else []


class _HnswScope:
    def __init__(self, dim: int, ef: int):
        import hnswlib

        self.idx = hnswlib.Index(space="cosine", dim=dim)
        self.cap = 64
        self.idx.init_index(max_elements=self.cap, ef_construction=200, M=16, allow_replace_deleted=True)
        self.idx.set_ef(ef)
        self.labels: dict[str, int] = {}
        self.ids: dict[int, str] = {}
        self.free: list[int] = []
        self.next = 0

    def add(self, id_: str, vec: np.ndarray) -> None:
        if self.free:
            label = self.free.pop()
            self.idx.add_items(vec[None, :], [label], replace_deleted=True)
        else:
            if self.next == self.cap:
                self.cap *= 2
                self.idx.resize_index(self.cap)
            label = self.next
            self.next += 1
            self.idx.add_items(vec[None, :], [label])
        self.labels[id_] = label
        self.ids[label] = id_

    def remove(self, id_: str) -> None:
        label = self.labels.pop(id_)
        del self.ids[label]
        self.idx.mark_deleted(label)
        self.free.append(label)

    def search(self, vec: np.ndarray, k: int) -> list[tuple[str, float]]:
        k = min(k, len(self.labels))
        if not k:
            return []
        labels, dists = self.idx.knn_query(vec[None, :], k=k)
        return [(self.ids[int(lab)], 1.0 - float(d)) for lab, d in zip(labels[0], dists[0])]


def make_index(kind: str, dim: int = 384):
    """``flat`` → :class:`FlatIndex`, ``hnsw`` → :class:`HnswIndex`."""
    if kind == "flat":
        return FlatIndex(dim)
    if kind == "hnsw":
        return HnswIndex(dim)
    raise ValueError(f"unknown index kind {kind!r} (flat or hnsw)")
