"""Semantic entries in Redis — the source of truth shared by every semantic service.

Keys (every one with a TTL):

- ``kvgate:sem:e:<pool>:<scope>:<id>`` — a hash ``{text, entry, vec, tags, model, ts}``: the last
  user message, the exact-cache key holding its answer, the unit vector (384 float32, raw bytes),
  the tags (JSON list), the embedding model, the insert time (unix s). TTL: the entry's ``ttl_s``.
  ``<id>`` is the first 16 hex digits of sha256(text), so the same text in a scope is one entry.
- ``kvgate:sem:tag:<tag>`` — a set of entry keys carrying that tag; its TTL is raised to the
  longest TTL of its members (``EXPIRE NX`` then ``EXPIRE GT``). Members may outlive their entry:
  they are skipped when gone.

Changes are announced on the pub/sub channel ``kvgate:sem:events`` (a channel, not a key:
nothing to expire) as JSON ``{"op": "add"|"del", "key": ..., "origin": <service id>}``; every
service applies the others' and also rescans periodically (a message lost while a service was
disconnected is picked up by the next rescan).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np
import redis

PREFIX = "kvgate:sem:"
ENTRY = PREFIX + "e:"
TAG = PREFIX + "tag:"
CHANNEL = PREFIX + "events"


@dataclass
class Entry:
    """One semantic entry as read from Redis; ``expires_at`` in unix seconds."""

    key: str
    pool: str
    scope: str
    text: str
    entry: str
    vec: np.ndarray
    tags: list[str]
    expires_at: float


def entry_key(pool: str, scope: str, text: str) -> str:
    """``kvgate:sem:e:<pool>:<scope>:<sha256(text)[:16]>``."""
    return f"{ENTRY}{pool}:{scope}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def split_key(key: str) -> tuple[str, str]:
    """``(pool, scope)`` of an entry key (the pool may contain ``:``, scope and id do not)."""
    pool, scope, _ = key[len(ENTRY):].rsplit(":", 2)
    return pool, scope


class Store:
    """Reads and writes the entries over one ``redis.Redis`` client (thread-safe pool)."""

    def __init__(self, client: redis.Redis, origin: str):
        self.r = client
        self.origin = origin

    def put(self, pool: str, scope: str, text: str, entry: str, vec: np.ndarray, ttl_s: int,
            tags: list[str], model: str) -> str:
        """Write (or replace) an entry with its TTL, index its tags, announce it. Returns its key."""
        key = entry_key(pool, scope, text)
        p = self.r.pipeline(transaction=True)
        p.delete(key)
        p.hset(key, mapping={"text": text, "entry": entry, "vec": np.asarray(vec, np.float32).tobytes(),
                             "tags": json.dumps(tags), "model": model, "ts": f"{time.time():.3f}"})
        p.expire(key, ttl_s)
        for tag in tags:
            p.sadd(TAG + tag, key)
            p.expire(TAG + tag, ttl_s, nx=True)
            p.expire(TAG + tag, ttl_s, gt=True)
        p.publish(CHANNEL, json.dumps({"op": "add", "key": key, "origin": self.origin}))
        p.execute()
        return key

    def get(self, key: str) -> Entry | None:
        """The entry at ``key`` or ``None`` when it is gone (expired, removed, not an entry)."""
        p = self.r.pipeline(transaction=False)
        p.hgetall(key)
        p.pttl(key)
        h, pttl = p.execute()
        return _entry(key, h, pttl)

    def exists(self, key: str) -> bool:
        return bool(self.r.exists(key))

    def scan(self, pool: str | None = None, batch: int = 500):
        """Every live entry (of ``pool``), read in pipelined batches."""
        match = f"{ENTRY}{pool}:*" if pool else f"{ENTRY}*"
        keys: list[str] = []
        for k in self.r.scan_iter(match=match, count=1000):
            keys.append(k.decode() if isinstance(k, bytes) else k)
            if len(keys) >= batch:
                yield from self._read(keys)
                keys = []
        if keys:
            yield from self._read(keys)

    def _read(self, keys: list[str]):
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.hgetall(k)
            p.pttl(k)
        res = p.execute()
        for i, k in enumerate(keys):
            e = _entry(k, res[2 * i], res[2 * i + 1])
            if e is not None:
                yield e

    def delete(self, keys: list[str]) -> int:
        """Delete entries, announce each removal; returns how many existed."""
        if not keys:
            return 0
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.delete(k)
        n = sum(p.execute())
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.publish(CHANNEL, json.dumps({"op": "del", "key": k, "origin": self.origin}))
        p.execute()
        return n

    def keys_with_tag(self, tag: str) -> list[str]:
        return [k.decode() if isinstance(k, bytes) else k for k in self.r.smembers(TAG + tag)]

    def drop_tag(self, tag: str, keys: list[str] | None = None) -> None:
        """Remove ``keys`` from the tag's set (all of it when ``None``)."""
        if keys is None:
            self.r.delete(TAG + tag)
        elif keys:
            self.r.srem(TAG + tag, *keys)


def _entry(key: str, h: dict, pttl: int) -> Entry | None:
    if not h or pttl == -2:
        return None
    try:
        pool, scope = split_key(key)
        vec = np.frombuffer(h[b"vec"], dtype=np.float32).copy()
        return Entry(key, pool, scope, h[b"text"].decode(), h[b"entry"].decode(), vec,
                     json.loads(h.get(b"tags", b"[]")),
                     time.time() + (pttl / 1000 if pttl > 0 else 86400 * 365))
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
