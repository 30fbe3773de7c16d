"""Batches as the API sees them: create, get, list and cancel (OpenAI's ``/v1/batches``).

:meth:`Batches.create` checks the request's own fields only (the endpoint, the completion
window, the metadata, that the input file is the tenant's and has purpose ``batch``) and writes
the record with status ``validating``; the worker (:mod:`kvgate.batch.runner`) reads the file,
validates every line and moves the batch on. :meth:`Batches.cancel` moves a ``validating`` or
``in_progress`` batch to ``cancelling`` through :func:`kvgate.batch.records.transition`; the
worker lets the lines in flight finish and ends it ``cancelled``.

Every read takes the caller's tenant ("" under ``gateway.auth: off``): another tenant's batch
answers as an unknown one (:class:`BatchNotFound`). Redis errors propagate as
:class:`redis.RedisError`; the client must decode responses (``decode_responses=True``).
"""

from __future__ import annotations

import re
import time
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis

from ..policy.batch import BatchConfig, window_seconds
from . import records
from .files import PURPOSE_BATCH, BatchApiError, FileNotFound, FileStore, InvalidRequest, resolve_data_dir

MAX_LIST = 100
DEFAULT_LIST = 20
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
"""OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512."""
CANCELLABLE = (records.VALIDATING, records.IN_PROGRESS)
_BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{24}$")


class BatchNotFound(BatchApiError):
    """No such batch for this tenant (→ 404): unknown or another tenant's."""


class BatchNotCancellable(BatchApiError):
    """The batch is finishing or finished (→ 409): ``status`` says which status it has."""

    def __init__(self, message: str, status: str):
        super().__init__(message, None)
        self.status = status


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata`` as OpenAI accepts it (null, or at most 16 string pairs, keys ≤ 64 and values
    ≤ 512 characters) → a plain dict or None (an empty one is None). Raises :class:`InvalidRequest`."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise InvalidRequest("metadata must be an object of string keys and string values", "metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata holds at most {MAX_METADATA_PAIRS} pairs ({len(metadata)} given)", "metadata")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidRequest("metadata keys and values must be strings", "metadata")
        if len(k) > MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata key {k[:20]!r}…: at most {MAX_METADATA_KEY} characters", "metadata")
        if len(v) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata value of {k!r}: at most {MAX_METADATA_VALUE} characters", "metadata")
    return dict(metadata) or None


class Batches:
    """The batches of every tenant in Redis ``r``; ``files``: the input files' store (or a
    function returning the one in force); ``config``: returns the ``batch:`` section of the
    policy in force (read at each call, so a new policy's windows apply at once)."""

    def __init__(self, r: redis.Redis, files: FileStore | Callable[[], FileStore],
                 config: Callable[[], BatchConfig]):
        self.r, self.config = r, config
        self._files = files if callable(files) else (lambda: files)

    @property
    def files(self) -> FileStore:
        return self._files()

    def create(self, tenant: str, *, input_file_id: Any, endpoint: Any, completion_window: Any,
               metadata: Any = None, now: float | None = None) -> dict[str, Any]:
        """A new batch of ``tenant`` over its file ``input_file_id`` → the OpenAI Batch object
        (status ``validating``, ``expires_at`` = now + the window, counts 0).

        Raises:
            InvalidRequest: a missing or wrong field (``param`` names it): an endpoint other than
                /v1/chat/completions, /v1/completions, /v1/embeddings; a window the policy does
                not offer (``batch.completion_windows``); bad metadata; an input file that is not
                this tenant's or not of purpose ``batch``.
        """
        cfg = self.config()
        for name, value in (("input_file_id", input_file_id), ("endpoint", endpoint),
                            ("completion_window", completion_window)):
            if value is None or value == "":
                raise InvalidRequest(f"Missing required parameter: '{name}'.", name)
            if not isinstance(value, str):
                raise InvalidRequest(f"Invalid type for '{name}': expected a string, but got {type(value).__name__}.",
                                     name)
        if endpoint not in records.ENDPOINTS:
            raise InvalidRequest(f"Invalid value for 'endpoint': {endpoint[:60]!r}. Supported values are: "
                                 + ", ".join(f"'{e}'" for e in records.ENDPOINTS) + ".", "endpoint")
        if completion_window not in cfg.completion_windows:
            raise InvalidRequest(f"Invalid value for 'completion_window': {completion_window[:20]!r}. Supported "
                                 "values are: " + ", ".join(f"'{w}'" for w in cfg.completion_windows) + ".",
                                 "completion_window")
        meta = check_metadata(metadata)
        try:
            f = self.files.record(tenant, input_file_id)
        except FileNotFound:
            raise InvalidRequest(f"Invalid 'input_file_id': {input_file_id[:80]!r}: no such file (upload it with "
                                 "purpose 'batch' first).", "input_file_id") from None
        if f.get("purpose") != PURPOSE_BATCH:
            raise InvalidRequest(f"The input file {input_file_id} has purpose {f.get('purpose')!r}: a batch reads a "
                                 "file uploaded with purpose 'batch'.", "input_file_id")
        rec = records.new_record(batch_id=records.new_batch_id(), tenant=tenant, endpoint=endpoint,
                                 input_file_id=input_file_id, completion_window=completion_window,
                                 window_s=window_seconds(completion_window), metadata=meta, now=now)
        records.save_new(self.r, rec)
        return records.to_openai(rec)

    def record(self, tenant: str, batch_id: str) -> dict[str, str]:
        """The hash of ``tenant``'s batch. Raises :class:`BatchNotFound`."""
        h = records.load(self.r, batch_id) if _BATCH_ID_RE.match(batch_id or "") else None
        if not h or h.get("tenant") != tenant:
            raise BatchNotFound(f"No batch found with id {batch_id[:80]!r}.", "batch_id")
        return h

    def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """The OpenAI Batch object of ``tenant``'s batch. Raises :class:`BatchNotFound`."""
        return records.to_openai(self.record(tenant, batch_id))

    def list(self, tenant: str, *, after: str | None = None, limit: int = DEFAULT_LIST) -> dict[str, Any]:
        """A page of ``tenant``'s batches, newest first: ``{object: "list", data, first_id,
        last_id, has_more}``. ``after``: the id the previous page ended with (one not in the list
        gives an empty page); ``limit`` 1..100 (default 20). Raises :class:`InvalidRequest`."""
        if not 1 <= limit <= MAX_LIST:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIST}", "limit")
        key = records.tenant_batches_key(tenant)
        start = 0
        if after:
            rank = self.r.zrevrank(key, after)
            if rank is None:
                return {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
            start = rank + 1
        ids = self.r.zrevrange(key, start, start + limit)  # one more than asked: has_more
        with self.r.pipeline(transaction=False) as p:
            for bid in ids:
                p.hgetall(records.batch_key(bid))
            hashes = p.execute()
        data = [records.to_openai(h) for h in hashes if h][:limit]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}

    def cancel(self, tenant: str, batch_id: str, now: float | None = None) -> dict[str, Any]:
        """Ask ``tenant``'s batch to stop → its Batch object (status ``cancelling``; the worker
        ends it ``cancelled`` once the lines in flight are done). A batch already ``cancelling``
        or ``cancelled`` is answered as it is (cancel is idempotent).

        Raises:
            BatchNotFound: no such batch for this tenant.
            BatchNotCancellable: ``finalizing``, ``completed``, ``failed`` or ``expired``.
        """
        self.record(tenant, batch_id)
        records.transition(self.r, batch_id, records.CANCELLING, allowed_from=CANCELLABLE,
                           now=now if now is not None else time.time())
        h = self.record(tenant, batch_id)
        status = h.get("status", "")
        if status not in (records.CANCELLING, records.CANCELLED):
            raise BatchNotCancellable(f"Cannot cancel a batch with status '{status}'.", status)
        return records.to_openai(h)

    def input_in_use(self, tenant: str, file_id: str) -> str | None:
        """The id of a batch of ``tenant`` not yet finished that reads ``file_id``, or None."""
        ids = self.r.zrange(records.OPEN, 0, -1)
        if not ids:
            return None
        with self.r.pipeline(transaction=False) as p:
            for bid in ids:
                p.hmget(records.batch_key(bid), "tenant", "input_file_id")
            rows = p.execute()
        for bid, (t, fid) in zip(ids, rows):
            if t == tenant and fid == file_id:
                return bid
        return None


class BatchApi:
    """The Batch API's services over one Redis, for the control plane (``plane.files``,
    ``plane.batches``): ``policy()`` returns the policy in force (its ``batch:`` section is read
    at each use); ``run_dir``: where a null or relative ``batch.data_dir`` lives. The
    :class:`FileStore` is rebuilt when a new policy moves the data directory or the retention."""

    def __init__(self, r: redis.Redis, policy: Callable[[], Any], run_dir: Path | str | None):
        self.r, self.policy, self.run_dir = r, policy, run_dir
        self._lock = threading.Lock()
        self._files: tuple[tuple[Path, int], FileStore] | None = None
        self.batches = Batches(r, lambda: self.files, self.config)

    def config(self) -> BatchConfig:
        """The ``batch:`` section in force (the defaults before a policy is applied)."""
        p = self.policy()
        return p.batch if p is not None else BatchConfig()

    @property
    def files(self) -> FileStore:
        cfg = self.config()
        want = (resolve_data_dir(cfg.data_dir, self.run_dir), cfg.file_retention_days)
        with self._lock:
            if self._files is None or self._files[0] != want:
                self._files = (want, FileStore(want[0], self.r, retention_days=want[1]))
            return self._files[1]

