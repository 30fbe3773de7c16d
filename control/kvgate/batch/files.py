"""The Batch API's files: bytes on disk, metadata in Redis, each file a tenant's.

Bytes live in ``<data_dir>/files/<file_id>``, written atomically (a temp file in the same
folder, fsync, rename, fsync of the folder), so a crash leaves either the whole file or none;
the SHA-256 of the bytes is computed while they are written. Metadata is the hash
``kvgate:batch:file:<file_id>`` (:func:`kvgate.batch.records.file_key`: id, tenant, purpose,
filename, bytes, created_at, sha256, status, expires_at) and each tenant's files are the zset
``kvgate:batch:files:<tenant>`` (score = created_at in ms). The metadata is written after the
bytes are in place, so a listed file always has its bytes.

Tenancy: every read takes the caller's tenant ("" under ``gateway.auth: off``); another
tenant's id answers exactly as an unknown one (:class:`FileNotFound`), so ids cannot be probed.

Purposes: ``batch`` (input files, the only purpose a client may upload) and ``batch_output``
(the output and error files the worker writes with :meth:`FileStore.write_output`).

The Redis client must decode responses (``decode_responses=True``, as
:class:`kvgate.control.store.Store`'s). Redis errors propagate as :class:`redis.RedisError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO

import redis

from . import records

PURPOSE_BATCH = "batch"
PURPOSE_OUTPUT = "batch_output"
PURPOSES = (PURPOSE_BATCH, PURPOSE_OUTPUT)
UPLOAD_PURPOSES = (PURPOSE_BATCH,)
"""What a client may upload (``batch_output`` files are the worker's)."""

MAX_FILENAME = 255
MAX_LIST = 10_000
"""The most files one list page holds (OpenAI's bound and default)."""
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 86400
"""OpenAI's bounds of ``expires_after[seconds]``."""

CHUNK = 1024 * 1024
_FILE_ID_RE = re.compile(r"^file-[0-9a-f]{24}$")


# --------------------------------------------------------------------------- errors
class BatchApiError(Exception):
    """A Batch API request that cannot be done. ``message`` is shown to the client; ``param``
    names the request field at fault (OpenAI's ``error.param``) or is None. Each subclass has
    its status and code in :data:`kvgate.web.errors.ERRORS`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(BatchApiError):
    """A malformed or unsupported request (→ 400 ``invalid_request_error``)."""


class FileNotFound(BatchApiError):
    """No such file for this tenant (→ 404): unknown, deleted, expired or another tenant's."""


class FileTooLarge(BatchApiError):
    """The upload is larger than ``batch.max_file_bytes`` (→ 413)."""


class FileInUse(BatchApiError):
    """The file is the input of a batch still running (→ 409): deleting it would fail that batch."""


# --------------------------------------------------------------------------- helpers
def valid_file_id(file_id: str) -> bool:
    """Whether ``file_id`` has the shape of our ids (``file-`` + 24 hex): only such ids name a path."""
    return bool(_FILE_ID_RE.match(file_id or ""))


def clean_filename(name: str | None) -> str:
    """The client's file name as we keep it: the last path component, control characters
    dropped, NFC, at most :data:`MAX_FILENAME` characters; ``"upload.jsonl"`` when nothing is left."""
    base = re.split(r"[\\/]", name or "")[-1]
    base = "".join(c for c in unicodedata.normalize("NFC", base) if c.isprintable()).strip()
    return base[:MAX_FILENAME] or "upload.jsonl"


def to_openai(h: Mapping[str, str]) -> dict[str, Any]:
    """The OpenAI File object of a metadata hash: ``{id, object: "file", bytes, created_at,
    expires_at (int or null), filename, purpose, status, status_details: null}``."""
    return {
        "id": h["id"],
        "object": "file",
        "bytes": int(h.get("bytes") or 0),
        "created_at": int(h.get("created_at") or 0),
        "expires_at": int(h["expires_at"]) if h.get("expires_at") else None,
        "filename": h.get("filename", ""),
        "purpose": h.get("purpose", PURPOSE_BATCH),
        "status": h.get("status") or "processed",
        "status_details": None,
    }


def _list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def resolve_data_dir(data_dir: str | None, run_dir: Path | str | None) -> Path:
    """The data directory of policy ``batch.data_dir``: null → ``<run dir>/data``; a relative
    path is relative to the run directory; ``~`` is expanded. ``run_dir`` None = kvgate's
    default run directory (:func:`kvgate.rundir.default_run_dir`). The control plane and every
    worker resolve it alike, so they read and write the same files."""
    if run_dir is None:
        from ..rundir import default_run_dir

        run_dir = default_run_dir()
    base = Path(run_dir)
    if not data_dir:
        return base / "data"
    p = Path(data_dir).expanduser()
    return p if p.is_absolute() else base / p


# --------------------------------------------------------------------------- the store
class FileStore:
    """Files of every tenant in ``data_dir/files`` (created on first write) and ``r`` (Redis,
    ``decode_responses=True``). ``retention_days``: a file's ``expires_at`` is its
    ``created_at`` plus this many days (policy ``batch.file_retention_days``); an expired file
    answers as not found (and is removed when next looked up)."""

    def __init__(self, data_dir: Path | str, r: redis.Redis, *, retention_days: int = 30):
        self.data_dir = Path(data_dir)
        self.dir = self.data_dir / "files"
        self.r = r
        self.retention_days = retention_days

    # ------------------------------------------------------------ writing
    def create(self, tenant: str, stream: IO[bytes], filename: str | None, purpose: str, *, max_bytes: int,
               expires_after_s: int | None = None, now: float | None = None) -> dict[str, Any]:
        """Store an upload read from ``stream`` (e.g. werkzeug's ``FileStorage.stream``) as a new
        file of ``tenant`` → its OpenAI File object.

        ``purpose`` must be ``batch``; ``expires_after_s`` (OpenAI's ``expires_after[seconds]``,
        3600..2592000) replaces the retention; ``max_bytes``: policy ``batch.max_file_bytes``.

        Raises:
            InvalidRequest: another purpose, a bad ``expires_after_s``, an empty file.
            FileTooLarge: more than ``max_bytes`` bytes (nothing is kept).
            redis.RedisError: Redis unreachable (nothing is kept).
        """
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"Invalid value for 'purpose': {str(purpose)[:40]!r}. kvgate stores files for the "
                                 "Batch API only: the purpose must be 'batch'.", "purpose")
        if expires_after_s is not None and not MIN_EXPIRES_AFTER_S <= expires_after_s <= MAX_EXPIRES_AFTER_S:
            raise InvalidRequest(f"expires_after[seconds] must be between {MIN_EXPIRES_AFTER_S} and "
                                 f"{MAX_EXPIRES_AFTER_S}", "expires_after")

        def chunks() -> Iterator[bytes]:
            while True:
                b = stream.read(CHUNK)
                if not b:
                    return
                yield b

        return self._write(tenant, chunks(), clean_filename(filename), purpose, max_bytes=max_bytes,
                           expires_after_s=expires_after_s, now=now, allow_empty=False)

    def write_output(self, tenant: str, filename: str, lines: Iterable[str | bytes | Mapping[str, Any]], *,
                     file_id: str | None = None, now: float | None = None) -> dict[str, Any]:
        """Write an output or error file of a batch (purpose ``batch_output``) → its File object.

        ``lines``: JSON objects (dicts, dumped compactly) or already-encoded lines (str/bytes;
        a missing trailing newline is added). ``file_id``: the id to write under (a worker that
        picked the id before a crash writes the same file again, atomically replacing it);
        None = a new id. An empty ``lines`` makes an empty file (0 bytes).

        Raises:
            InvalidRequest: ``file_id`` is malformed or another tenant's.
            redis.RedisError: Redis unreachable.
        """
        if file_id is not None:
            if not valid_file_id(file_id):
                raise InvalidRequest(f"malformed file id {file_id[:60]!r}", "file_id")
            owner = self.r.hget(records.file_key(file_id), "tenant")
            if owner is not None and owner != tenant:
                raise InvalidRequest(f"file {file_id} belongs to another tenant", "file_id")

        def encoded() -> Iterator[bytes]:
            for line in lines:
                if isinstance(line, Mapping):
                    b = json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode()
                else:
                    b = line.encode() if isinstance(line, str) else bytes(line)
                yield b if b.endswith(b"\n") else b + b"\n"

        return self._write(tenant, encoded(), clean_filename(filename), PURPOSE_OUTPUT, max_bytes=None,
                           expires_after_s=None, now=now, allow_empty=True, file_id=file_id)

    def _write(self, tenant: str, chunks: Iterable[bytes], filename: str, purpose: str, *, max_bytes: int | None,
               expires_after_s: int | None, now: float | None, allow_empty: bool,
               file_id: str | None = None) -> dict[str, Any]:
        fid = file_id or records.new_file_id()
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / fid
        tmp = self.dir / f".tmp-{fid}-{secrets.token_hex(4)}"
        digest = hashlib.sha256()
        size = 0
        try:
            # 0600: tenants' prompts and answers, readable by kvgate's user only
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                for b in chunks:
                    size += len(b)
                    if max_bytes is not None and size > max_bytes:
                        raise FileTooLarge(f"The file is larger than the {max_bytes:,} bytes this gateway accepts "
                                           "(policy batch.max_file_bytes); split it into several batches.", "file")
                    digest.update(b)
                    out.write(b)
                out.flush()
                os.fsync(out.fileno())
            if size == 0 and not allow_empty:
                raise InvalidRequest("The file is empty: a batch input file holds one JSON request per line.",
                                     "file")
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        t = int(now if now is not None else time.time())
        life = expires_after_s if expires_after_s is not None else self.retention_days * 86400
        meta = {"id": fid, "tenant": tenant, "purpose": purpose, "filename": filename, "bytes": str(size),
                "created_at": str(t), "sha256": digest.hexdigest(), "status": "processed",
                "expires_at": str(t + life)}
        try:
            with self.r.pipeline(transaction=True) as p:
                p.delete(records.file_key(fid))
                p.hset(records.file_key(fid), mapping=meta)
                p.zadd(records.tenant_files_key(tenant), {fid: t * 1000 + int(time.time() * 1000) % 1000})
                p.execute()
        except BaseException:
            if file_id is None:  # a new file nobody can name: do not leave its bytes behind
                final.unlink(missing_ok=True)
            raise
        return to_openai(meta)

    # ------------------------------------------------------------ reading
    def record(self, tenant: str, file_id: str, *, now: float | None = None) -> dict[str, str]:
        """The metadata hash of ``tenant``'s file (with ``sha256``).

        Raises:
            FileNotFound: unknown, malformed, expired or another tenant's id.
        """
        h = self.r.hgetall(records.file_key(file_id)) if valid_file_id(file_id) else {}
        if not h or h.get("tenant") != tenant:
            raise FileNotFound(f"No such File object: {file_id[:80]}", "file_id")
        exp = h.get("expires_at")
        if exp and int(exp) <= int(now if now is not None else time.time()):
            self._remove(h)
            raise FileNotFound(f"No such File object: {file_id[:80]} (it expired)", "file_id")
        return h

    def get(self, tenant: str, file_id: str) -> dict[str, Any]:
        """The OpenAI File object of ``tenant``'s file. Raises :class:`FileNotFound`."""
        return to_openai(self.record(tenant, file_id))

    def path(self, tenant: str, file_id: str) -> Path:
        """Where ``tenant``'s file's bytes are (the worker reads input files from here).
        Raises :class:`FileNotFound` (also when the bytes are missing on disk)."""
        self.record(tenant, file_id)
        p = self.dir / file_id
        if not p.is_file():
            raise FileNotFound(f"No such File object: {file_id} (its bytes are missing from the data directory)",
                               "file_id")
        return p

    def open(self, tenant: str, file_id: str) -> BinaryIO:
        """``tenant``'s file opened for reading (binary); the caller closes it. Opened before it is
        returned, so a delete meanwhile does not cut a download short. Raises :class:`FileNotFound`."""
        p = self.path(tenant, file_id)
        try:
            return open(p, "rb")
        except FileNotFoundError:
            raise FileNotFound(f"No such File object: {file_id}", "file_id") from None

    def list(self, tenant: str, *, after: str | None = None, limit: int = MAX_LIST, order: str = "desc",
             purpose: str | None = None, now: float | None = None) -> dict[str, Any]:
        """A page of ``tenant``'s files, OpenAI's list object ``{object: "list", data, first_id,
        last_id, has_more}``: ``order`` ``desc`` (newest first, the default) or ``asc`` by
        ``created_at``; ``after``: the id the previous page ended with (an id that is not in the
        list gives an empty page); ``limit`` 1..10,000; ``purpose``: only files of this purpose.

        Raises:
            InvalidRequest: a bad ``limit`` or ``order``.
        """
        if not 1 <= limit <= MAX_LIST:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIST}", "limit")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", "order")
        key = records.tenant_files_key(tenant)
        desc = order == "desc"
        start = 0
        if after:
            rank = self.r.zrevrank(key, after) if desc else self.r.zrank(key, after)
            if rank is None:
                return _list_object([], False)
            start = rank + 1
        t = int(now if now is not None else time.time())
        out: list[dict[str, Any]] = []
        stale: list[str] = []
        step = min(max(limit + 1, 50), 1000)
        while len(out) <= limit:
            ids = (self.r.zrevrange if desc else self.r.zrange)(key, start, start + step - 1)
            if not ids:
                break
            start += len(ids)
            with self.r.pipeline(transaction=False) as p:
                for fid in ids:
                    p.hgetall(records.file_key(fid))
                hashes = p.execute()
            for fid, h in zip(ids, hashes):
                if not h:  # deleted between the two reads, or a stale index entry
                    stale.append(fid)
                    continue
                if h.get("expires_at") and int(h["expires_at"]) <= t:
                    continue
                if purpose is not None and h.get("purpose") != purpose:
                    continue
                out.append(to_openai(h))
                if len(out) > limit:
                    break
        if stale:  # removed after the walk: removing during it would shift the ranks walked
            self.r.zrem(key, *stale)
        return _list_object(out[:limit], len(out) > limit)

    # ------------------------------------------------------------ deleting
    def delete(self, tenant: str, file_id: str) -> dict[str, Any]:
        """Delete ``tenant``'s file (metadata, then bytes) → OpenAI's ``{id, object: "file",
        deleted: true}``. Raises :class:`FileNotFound`."""
        h = self.record(tenant, file_id)
        self._remove(h)
        return {"id": file_id, "object": "file", "deleted": True}

    def _remove(self, h: Mapping[str, str]) -> None:
        fid = h["id"]
        with self.r.pipeline(transaction=True) as p:
            p.delete(records.file_key(fid))
            p.zrem(records.tenant_files_key(h.get("tenant", "")), fid)
            p.execute()
        (self.dir / fid).unlink(missing_ok=True)

    def purge_expired(self, tenant: str, now: float | None = None) -> int:
        """Remove ``tenant``'s expired files → how many (a housekeeping step for the worker)."""
        t = int(now if now is not None else time.time())
        n = 0
        for fid in self.r.zrange(records.tenant_files_key(tenant), 0, -1):
            h = self.r.hgetall(records.file_key(fid))
            if h and h.get("expires_at") and int(h["expires_at"]) <= t:
                self._remove(h)
                n += 1
        return n


    def purge_orphans(self, min_age_s: float = 3600.0, now: float | None = None) -> int:
        """Remove files on disk that Redis no longer knows (a private Redis that kept nothing
        across ``kvgate down``, or a crash between the bytes and their record) and half-written
        temporaries, older than ``min_age_s`` → how many. Nothing can read such a file: without
        its record it has no tenant. Raises redis.RedisError."""
        t = now if now is not None else time.time()
        if not self.dir.is_dir():
            return 0
        n = 0
        for path in self.dir.iterdir():
            try:
                if t - path.stat().st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
            name = path.name
            if name.startswith(".tmp-") or (valid_file_id(name) and not self.r.exists(records.file_key(name))):
                path.unlink(missing_ok=True)
                n += 1
        return n


def _fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (POSIX: fsync of the folder)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
