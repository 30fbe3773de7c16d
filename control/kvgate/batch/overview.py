"""The operator's view of every tenant's batches (the admin page's Batches page, ``GET
/api/v1/batches``, ``kvgate batches``): read-only over :mod:`kvgate.batch.records`.

A tenant reaches only its own batches through ``/v1/batches`` (:mod:`kvgate.batch.jobs`); the
operator sees them all, newest first, each the OpenAI Batch object plus ``tenant`` and
``progress`` (finished lines ÷ total, 0..1; None before validation counted the lines).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import redis

from . import records as rec

MAX_LIST = 500


def with_tenant(h: dict[str, str]) -> dict[str, Any]:
    """The OpenAI object of a batch hash, plus ``tenant`` and ``progress``."""
    obj = rec.to_openai(h)
    counts = obj["request_counts"]
    total = counts["total"]
    obj["tenant"] = h.get("tenant", "")
    obj["progress"] = (counts["completed"] + counts["failed"]) / total if total else None
    return obj


def tenants_with_batches(r: redis.Redis) -> list[str]:
    """Every tenant that has a batch list (SCAN: tenants the policy no longer has included)."""
    prefix = rec.tenant_batches_key("")
    return sorted(_s(k)[len(prefix):] for k in r.scan_iter(match=prefix + "*", count=1000))


def list_batches(r: redis.Redis, tenants: Iterable[str] | None = None, *, tenant: str | None = None,
                 status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Batches of ``tenants`` (None: every tenant that has one) or only of ``tenant``, newest
    first, at most ``limit`` (≤ MAX_LIST), optionally only those in ``status``.

    Raises:
        ValueError: ``status`` is not a batch status.
        redis.RedisError: Redis unreachable.
    """
    if status is not None and status not in rec.STATUSES:
        raise ValueError(f"unknown status {status!r}: one of {', '.join(rec.STATUSES)}")
    limit = max(1, min(int(limit), MAX_LIST))
    if tenant is not None:
        names = [tenant]
    else:
        names = list(dict.fromkeys(tenants if tenants is not None else tenants_with_batches(r)))
    scored: list[tuple[float, str]] = []
    with r.pipeline(transaction=False) as p:
        for t in names:
            p.zrevrange(rec.tenant_batches_key(t), 0, MAX_LIST - 1, withscores=True)
        for rows in p.execute():
            scored.extend((score, _s(member)) for member, score in rows)
    newest = heapq.nlargest(MAX_LIST, scored)
    out: list[dict[str, Any]] = []
    with r.pipeline(transaction=False) as p:
        for _score, batch_id in newest:
            p.hgetall(rec.batch_key(batch_id))
        hashes = p.execute()
    for h in hashes:
        if not h:
            continue  # listed, but its record is gone (deleted by hand)
        d = {_s(k): _s(v) for k, v in h.items()}
        if status is None or d.get("status") == status:
            out.append(with_tenant(d))
            if len(out) >= limit:
                break
    return out


def find(r: redis.Redis, batch_id: str) -> dict[str, Any] | None:
    """One batch by id (any tenant's), or None. Raises redis.RedisError."""
    h = rec.load(r, batch_id)
    return with_tenant(h) if h else None


def summary(batches: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Batches per status (every status present, 0 where none)."""
    out = dict.fromkeys(rec.STATUSES, 0)
    for b in batches:
        out[b["status"]] = out.get(b["status"], 0) + 1
    return out


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
