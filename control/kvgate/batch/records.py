"""The Batch API's shared core: Redis key names, the batch record and its status machine, the
OpenAI Batch object, and the batch principal the worker sends lines through the gateway with.

Statuses are OpenAI's (https://platform.openai.com/docs/api-reference/batch/object)::

    validating ─► in_progress ─► finalizing ─► completed
        │              │
        ├─► failed     ├─► expired        (the completion window ended; finished lines kept)
        └──────────────┴─► cancelling ─► cancelled

A batch is a Redis hash ``kvgate:batch:b:<id>`` (fields :data:`BATCH_FIELDS`; timestamps are
unix seconds, ``""`` = null; ``errors`` / ``metadata`` JSON or ``""``); ``kvgate:batch:tenant:
<tenant>`` lists a tenant's batches (zset, score = created_at in ms) and ``kvgate:batch:open``
the batches not yet terminal (zset, score = expires_at), which is what workers scan. Files are
``kvgate:batch:file:<id>`` hashes (bytes on disk, :mod:`kvgate.batch.files`), listed per tenant
in ``kvgate:batch:files:<tenant>``. The worker's own keys are under ``kvgate:batch:run:<id>:``.

Status changes go through :func:`transition` only: one atomic compare-and-set (WATCH/MULTI on
the batch hash), so a cancel racing the worker's finalize is decided once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

PREFIX = "kvgate:batch:"
OPEN = PREFIX + "open"
"""Sorted set of batch ids not yet terminal, score = ``expires_at`` (unix s)."""

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED)
TERMINAL = frozenset({COMPLETED, FAILED, EXPIRED, CANCELLED})

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
"""The endpoints a batch may run (OpenAI's, less /v1/responses which kvgate does not serve)."""

_STAMP = {  # status -> the field that records when the batch entered it
    IN_PROGRESS: "in_progress_at", FINALIZING: "finalizing_at", COMPLETED: "completed_at",
    FAILED: "failed_at", EXPIRED: "expired_at", CANCELLING: "cancelling_at", CANCELLED: "cancelled_at",
}
TIME_FIELDS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")
COUNT_FIELDS = ("total", "completed", "failed")
BATCH_FIELDS = ("id", "tenant", "endpoint", "input_file_id", "completion_window", "status", *TIME_FIELDS,
                "output_file_id", "error_file_id", "errors", "metadata", *COUNT_FIELDS, "model", "usage")
"""``model``: the model the lines asked for (the first line's; set by validation); ``usage``: JSON
of the succeeded lines' tokens summed at the end, OpenAI's shape (:func:`usage_of`)."""


def usage_of(bodies: Iterable[Any]) -> dict[str, Any]:
    """OpenAI's batch ``usage`` summed over answer bodies (chat/completions/embeddings):
    ``{"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens",
    "output_tokens_details": {"reasoning_tokens"}, "total_tokens"}``; a body without ``usage``
    counts 0."""
    inp = cached = out = reasoning = 0
    for body in bodies:
        u = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(u, dict):
            continue
        inp += int(u.get("prompt_tokens") or 0)
        out += int(u.get("completion_tokens") or 0)
        cached += int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning += int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": inp + out}


def batch_key(batch_id: str) -> str:
    """The batch's hash."""
    return f"{PREFIX}b:{batch_id}"


def tenant_batches_key(tenant: str) -> str:
    """A tenant's batches, zset score = created_at (ms)."""
    return f"{PREFIX}tenant:{tenant}"


def file_key(file_id: str) -> str:
    """A file's metadata hash."""
    return f"{PREFIX}file:{file_id}"


def tenant_files_key(tenant: str) -> str:
    """A tenant's files, zset score = created_at (ms)."""
    return f"{PREFIX}files:{tenant}"


def run_prefix(batch_id: str) -> str:
    """Prefix of the worker's keys for one batch (``kvgate:batch:run:<id>:``)."""
    return f"{PREFIX}run:{batch_id}:"


def new_batch_id() -> str:
    """``batch_`` + 24 hex digits (96 random bits)."""
    return "batch_" + secrets.token_hex(12)


def new_file_id() -> str:
    """``file-`` + 24 hex digits, as OpenAI spells file ids."""
    return "file-" + secrets.token_hex(12)


def new_line_id() -> str:
    """``batch_req_`` + 24 hex digits: the id of one output/error line."""
    return "batch_req_" + secrets.token_hex(12)


def new_record(*, batch_id: str, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
               window_s: int, metadata: Mapping[str, str] | None, now: float | None = None) -> dict[str, str]:
    """The hash of a new batch (status ``validating``, counts 0, ``expires_at`` = now + window)."""
    t = int(now if now is not None else time.time())
    rec = {f: "" for f in BATCH_FIELDS}
    rec.update(id=batch_id, tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
               completion_window=completion_window, status=VALIDATING, created_at=str(t),
               expires_at=str(t + int(window_s)), metadata=json.dumps(dict(metadata)) if metadata else "",
               total="0", completed="0", failed="0")
    return rec


def save_new(r: redis.Redis, rec: Mapping[str, str]) -> None:
    """Write a new batch record and index it (tenant list, open set) in one MULTI/EXEC."""
    with r.pipeline(transaction=True) as p:
        p.hset(batch_key(rec["id"]), mapping=dict(rec))
        p.zadd(tenant_batches_key(rec["tenant"]), {rec["id"]: _order_score(int(rec["created_at"]))})
        p.zadd(OPEN, {rec["id"]: int(rec["expires_at"])})
        p.execute()


def _ms() -> int:
    # sub-second order of batches created in the same second (the list is newest first)
    return int(time.time() * 1000) % 1000


_last_score = 0


def _order_score(created_at_s: int) -> int:
    """A batch's score in its tenant's list (ms): created_at and the sub-second time, strictly
    above the last one this process gave, so two batches created in one millisecond keep their
    creation order (a tie would order them by their random ids)."""
    global _last_score
    score = max(created_at_s * 1000 + _ms(), _last_score + 1)
    _last_score = score
    return score


def load(r: redis.Redis, batch_id: str) -> dict[str, str] | None:
    """The batch's hash, or None if there is no such batch."""
    h = r.hgetall(batch_key(batch_id))
    return {_s(k): _s(v) for k, v in h.items()} or None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def transition(r: redis.Redis, batch_id: str, to: str, *, allowed_from: Iterable[str],
               fields: Mapping[str, Any] | None = None, now: float | None = None) -> bool:
    """Move the batch to status ``to`` if its status is one of ``allowed_from``, atomically.

    Sets ``<to>_at`` (for a status that has one) to ``now`` (unix s) and every ``fields`` item
    (values written as str; dicts/lists as JSON). On a terminal status the batch leaves
    :data:`OPEN`. Returns False (nothing written) when the batch does not exist or its status
    is not in ``allowed_from`` — the caller lost a race or the request is out of order.

    Raises:
        ValueError: ``to`` is not a status.
        redis.RedisError: Redis unreachable.
    """
    if to not in STATUSES:
        raise ValueError(f"unknown batch status {to!r}")
    allowed = set(allowed_from)
    key = batch_key(batch_id)
    t = int(now if now is not None else time.time())
    update: dict[str, str] = {"status": to}
    if to in _STAMP:
        update[_STAMP[to]] = str(t)
    for k, v in (fields or {}).items():
        update[k] = json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else str(v))
    with r.pipeline(transaction=True) as p:
        while True:
            try:
                p.watch(key)
                cur = p.hget(key, "status")
                if cur is None or _s(cur) not in allowed:
                    p.unwatch()
                    return False
                p.multi()
                p.hset(key, mapping=update)
                if to in TERMINAL:
                    p.zrem(OPEN, batch_id)
                p.execute()
                return True
            except redis.WatchError:
                continue


def _int_or_none(v: str | None) -> int | None:
    return int(v) if v not in (None, "") else None


def to_openai(h: Mapping[str, str]) -> dict[str, Any]:
    """The OpenAI Batch object of a batch hash (fields in OpenAI's order; nulls where unset)."""
    errors = json.loads(h["errors"]) if h.get("errors") else None
    return {
        "id": h["id"],
        "object": "batch",
        "endpoint": h.get("endpoint", ""),
        "model": h.get("model") or None,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": h.get("input_file_id", ""),
        "completion_window": h.get("completion_window", ""),
        "status": h.get("status", ""),
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
        **{f: _int_or_none(h.get(f)) for f in TIME_FIELDS},
        "request_counts": {f: int(h.get(f) or 0) for f in COUNT_FIELDS},
        "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
        "usage": json.loads(h["usage"]) if h.get("usage") else None,
    }


# ------------------------------------------------------------------ the batch principal
PRINCIPAL_HEADER = "X-Kvgate-Batch"
"""The header that carries a batch line's principal through the gateway."""
PRINCIPAL_VERSION = "v1"


def batch_secret(admin_token: str) -> str:
    """The gateway's batch-principal secret, hex: HMAC-SHA256(admin token, "kvgate batch principal v1").

    Derived, never stored: the control plane renders it into the gateway's ``kvgate.json`` and
    the worker derives it from the same token file, so replacing the token replaces it.
    """
    return hmac.new(admin_token.encode(), b"kvgate batch principal v1", hashlib.sha256).hexdigest()


def sign_principal(secret: str, batch_id: str, line: int, tenant: str, expires: int) -> str:
    """The ``X-Kvgate-Batch`` value ``v1.<batch_id>.<line>.<tenant>.<expires>.<mac>`` for line
    ``line`` (0-based) of batch ``batch_id`` of ``tenant`` ("" under ``gateway.auth: off``),
    valid until ``expires`` (unix s); mac = lowercase hex HMAC-SHA1(secret, the part before it)
    — the gateway checks it with ``ngx.hmac_sha1`` (lua/kvgate/tenant.lua).
    """
    msg = f"{PRINCIPAL_VERSION}.{batch_id}.{int(line)}.{tenant}.{int(expires)}"
    mac = hmac.new(secret.encode(), msg.encode(), hashlib.sha1).hexdigest()
    return f"{msg}.{mac}"
