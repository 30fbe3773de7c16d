"""The usage rollups: the control plane's consumer of the request log (issue 13 item 3).

:class:`UsageConsumer` reads ``kvgate:log`` with the consumer group ``kvgate-usage``
(created at ``0`` with ``MKSTREAM``, so entries logged before the first start count) and adds
every batch into one hash per **hour × tenant × model × pool**::

    kvgate:usage:h:<hour start, unix s>:<tenant>:<model>:<pool>   (tenant "" → "none", model "" → "none";
                                                                   ":" and "%" in a part percent-encoded)

with the integer fields of :data:`FIELDS`, and lists each hash in the ZSET ``kvgate:usage:hours``
(score = hour start). The increments, the ZADD, the EXPIREs (``usage.retention_days``) and the
batch's XACK are one ``MULTI``/``EXEC``: an entry is counted exactly once. A consumer that
dies after reading and before applying leaves its batch in the group's pending list; on
start a consumer reads its own pending entries first (id ``0``), then new ones (``>``), so the
batch is applied by the next start. The same transaction sets ``kvgate:usage:last`` (the newest
entry applied), where a group lost while the rollups were kept is made again; the consumer
WATCHes it from its read to its EXEC, so two consumers of one name at once (an old control plane
still stopping while the new one starts) cannot both apply the same pending batch. Entries read again (a failed apply) keep their
round-robin baseline figure (:class:`.baseline.RoundRobinBaseline` is fed each entry once).

Per entry (all integers; ``""`` or a missing field = unknown, as in entries logged before
issue 13, which count as requests with unknown usage):

* ``requests`` 1; ``ok`` status 2xx; ``failed`` status ≥ 400 or 0; ``hits`` cache HIT;
  ``retried`` tries > 1; ``unknown_usage`` no prompt token count;
* computed answers: ``prompt``, ``cached``, ``completion`` (the engine's usage), ``rr_cached``
  (the baseline's cached tokens, for entries whose ``cached`` is known);
  a HIT: ``avoided_prompt``, ``avoided_completion`` (the cached answer's usage);
* money in nano-dollars: ``cost`` (``cost_ok``: of the 2xx ones), ``saved_cache``,
  ``saved_prefix``, ``saved_batch``; ``unpriced`` entries whose cost is ``""``;
* ``ttft_ms_sum``, ``ttft_n``.

The consumer never takes the control plane's locks (it reads :attr:`ControlPlane.snapshot`).
Redis down: it retries with back-off (0.5 s doubling to 10 s) and logs once until it is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

import redis

from .. import keys, redisconn
from .baseline import RoundRobinBaseline

log = logging.getLogger("kvgate.costs")

STREAM = keys.LOG_STREAM
GROUP = "kvgate-usage"
CONSUMER = "kvgate-control"
BUCKET_PREFIX = "kvgate:usage:h:"
HOURS = "kvgate:usage:hours"
LAST = "kvgate:usage:last"
"""The id of the newest entry applied (set in each batch's transaction): a group lost while the
rollups were kept (deleted by hand) is made again from there, not from 0, so nothing counts twice."""
FIELDS: tuple[str, ...] = ("requests", "ok", "failed", "hits", "retried", "prompt", "cached", "completion",
                           "avoided_prompt", "avoided_completion", "cost", "cost_ok", "saved_cache",
                           "saved_prefix", "saved_batch", "rr_cached", "ttft_ms_sum", "ttft_n", "unpriced",
                           "unknown_usage")
"""The integer fields of a bucket hash (see the module)."""

BATCH = 500
BLOCK_MS = 1000
BACKOFF_S = (0.5, 10.0)


def _esc(part: str) -> str:
    return part.replace("%", "%25").replace(":", "%3A")


def _unesc(part: str) -> str:
    return part.replace("%3A", ":").replace("%25", "%")


def bucket_key(hour: int, tenant: str, model: str, pool: str) -> str:
    """``kvgate:usage:h:<hour>:<tenant>:<model>:<pool>`` (empty tenant/model → ``none``)."""
    return (f"{BUCKET_PREFIX}{int(hour)}:{_esc(tenant or 'none')}:{_esc(model or 'none')}:{_esc(pool)}")


def parse_bucket_key(key: str) -> tuple[int, str, str, str]:
    """``(hour, tenant, model, pool)`` of a :func:`bucket_key`. Raises ValueError for another key."""
    if not key.startswith(BUCKET_PREFIX):
        raise ValueError(f"not a usage bucket key: {key!r}")
    parts = key[len(BUCKET_PREFIX):].split(":")
    if len(parts) != 4:
        raise ValueError(f"not a usage bucket key: {key!r}")
    return int(parts[0]), _unesc(parts[1]), _unesc(parts[2]), _unesc(parts[3])


def _int(v: str | None) -> int | None:
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        try:
            return int(float(v))
        except ValueError:
            return None


def _hour(fields: Mapping[str, str], entry_id: str) -> int:
    try:
        ts = float(fields.get("ts") or "")
    except ValueError:
        ts = int(entry_id.partition("-")[0]) / 1000.0  # the stream id: when Redis got the entry
    return int(ts // 3600) * 3600


HIT_OUTCOMES = frozenset({"HIT", "SEMANTIC", "STATIC"})
"""The request log's ``cache`` values of answers no engine computed: an exact hit, a semantic one
(a paraphrase's cached answer) and a static answer (issue 15); all credited as the cache lever."""


def entry_counts(fields: Mapping[str, str], rr_cached: int | None = None) -> dict[str, int]:
    """One request-log entry's increments (non-zero fields of :data:`FIELDS`); see the module.

    Args:
        fields: the entry's fields (strings; missing = unknown).
        rr_cached: the round-robin baseline's cached tokens for it (None: not modelled).
    """
    out: dict[str, int] = {"requests": 1}
    status = _int(fields.get("status")) or 0
    ok = 200 <= status < 300
    hit = fields.get("cache") in HIT_OUTCOMES
    add = out.__setitem__
    if ok:
        add("ok", 1)
    if status >= 400 or status == 0:
        add("failed", 1)
    if hit:
        add("hits", 1)
    if (_int(fields.get("tries")) or 0) > 1:
        add("retried", 1)
    prompt, cached, completion = (_int(fields.get(f)) for f in ("prompt", "cached", "completion"))
    if prompt is None:
        add("unknown_usage", 1)
    if hit:
        out["avoided_prompt"] = prompt or 0
        out["avoided_completion"] = completion or 0
    else:
        out["prompt"] = prompt or 0
        out["cached"] = cached or 0
        out["completion"] = completion or 0
        if cached is not None:
            # not modelled (no logged block): round robin is credited with it all, no affinity claimed
            out["rr_cached"] = cached if rr_cached is None else rr_cached
    cost = _int(fields.get("cost"))
    if cost is None:
        add("unpriced", 1)
    else:
        out["cost"] = cost
        if ok:
            out["cost_ok"] = cost
    for f in ("saved_cache", "saved_prefix", "saved_batch"):
        out[f] = _int(fields.get(f)) or 0
    ttft = _int(fields.get("ttft"))
    if ttft is not None:
        out["ttft_ms_sum"] = ttft
        out["ttft_n"] = 1
    return {k: v for k, v in out.items() if v}


def aggregate(entries: Iterable[tuple[str, Mapping[str, str]]],
              rr: Mapping[str, int | None] | None = None) -> dict[str, dict[str, int]]:
    """Sum entries ``(id, fields)`` per bucket: ``{bucket key: {field: int}}`` (only non-zero fields).

    ``rr`` maps an entry id to its round-robin baseline figure (see :func:`entry_counts`).
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for eid, f in entries:
        key = bucket_key(_hour(f, eid), f.get("tenant", ""), f.get("model", ""), f.get("pool", ""))
        acc = out[key]
        for k, v in entry_counts(f, (rr or {}).get(eid)).items():
            acc[k] += v
    return {k: dict(v) for k, v in out.items()}


def _sid(v: str) -> tuple[int, int]:
    ms, _, seq = v.partition("-")
    return int(ms), int(seq or 0)


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


class UsageConsumer:
    """Reads the request log into the rollups; :meth:`start` / :meth:`stop` run it in a thread.

    Args:
        url: Redis URL (the policy's ``redis.client_url``: plain or through Sentinel).
        state: returns ``(policy, serving)``: the policy in force (None: not yet) and the
            serving node count per pool (None: every listed node). Called once per batch,
            so it must not block (the control plane passes its snapshot).
        consumer: the consumer name in the group; one control plane uses one name, so a
            restart finds its own pending entries.
        batch: entries per XREADGROUP.
    """

    def __init__(self, url: str, state: Callable[[], tuple[Any, dict[str, int] | None]],
                 consumer: str = CONSUMER, batch: int = BATCH, block_ms: int = BLOCK_MS):
        self.r = redisconn.from_url(url, decode_responses=True, socket_timeout=block_ms / 1000 + 5,
                                    socket_connect_timeout=2)
        self.state = state
        self.consumer = consumer
        self.batch = batch
        self.block_ms = block_ms
        self.baseline = RoundRobinBaseline()
        self._rr: dict[str, int | None] = {}  # baseline figures of entries read but not acknowledged yet
        self._pending = True  # read own pending entries (id 0) before new ones
        self._group = False
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.applied = 0
        """Entries applied since start (for tests and logs)."""

    # ------------------------------------------------------------ steps
    def ensure_group(self) -> None:
        """``XGROUP CREATE kvgate:log kvgate-usage <start> MKSTREAM`` (an existing group is kept):
        from ``0`` the first time, so entries logged before count; from :data:`LAST` when the
        rollups outlived their group."""
        try:
            self.r.xgroup_create(STREAM, GROUP, id=self.r.get(LAST) or "0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group = True

    def read(self) -> list[tuple[str, dict[str, str]]]:
        """One batch: own pending entries while there are any, else new ones (blocking up to
        ``block_ms``). Entries trimmed from the stream while pending come back without fields."""
        if not self._group:
            self.ensure_group()
        if self._pending:
            entries = self._xread("0", None)
            if entries:
                return entries
            self._pending = False
        return self._xread(">", self.block_ms)

    def _xread(self, start: str, block: int | None) -> list[tuple[str, dict[str, str]]]:
        resp = self.r.xreadgroup(GROUP, self.consumer, {STREAM: start}, count=self.batch, block=block)
        return [(_s(i), {_s(k): _s(v) for k, v in (f or {}).items()}) for i, f in (resp[0][1] if resp else [])]

    def apply(self, entries: list[tuple[str, dict[str, str]]], pipe: Any = None) -> int:
        """Add a batch to the rollups and acknowledge it, in one MULTI/EXEC. Returns the entries applied.

        ``pipe``: a transaction pipeline that WATCHed :data:`LAST` before the batch was read (see
        :meth:`step`); the EXEC then fails with redis.WatchError when another consumer applied a
        batch meanwhile (two control planes of one name at once), and nothing is written."""
        if not entries:
            if pipe is not None:
                pipe.reset()
            return 0
        lost = sum(1 for _, f in entries if not f)
        if lost:
            # trimmed (MAXLEN ~ keys.LOG_MAXLEN) while pending: acknowledged, not counted
            log.warning("usage rollups: %d log entries were trimmed from %s before they were counted", lost, STREAM)
        policy, serving = self.state()
        self.baseline.configure(policy, serving)
        for eid, f in entries:
            if eid not in self._rr and f:
                self._rr[eid] = self._baseline(f)
        days = policy.usage.retention_days if policy is not None else 35
        ttl = days * 86400
        buckets = aggregate([(i, f) for i, f in entries if f], self._rr)
        if pipe is None:
            pipe = self.r.pipeline(transaction=True)
        else:
            pipe.multi()
        for key, counts in buckets.items():
            for field_name, v in counts.items():
                pipe.hincrby(key, field_name, v)
            pipe.zadd(HOURS, {key: parse_bucket_key(key)[0]})
            pipe.expire(key, ttl)
        if buckets:
            pipe.expire(HOURS, ttl)
            # the index forgets buckets past their retention (a day's margin for a lagging consumer's
            # late writes, which refresh a bucket's TTL): it would otherwise only grow
            pipe.zremrangebyscore(HOURS, "-inf", f"({int(time.time()) - ttl - 86400}")
        pipe.xack(STREAM, GROUP, *[i for i, _ in entries])
        pipe.set(LAST, max(entries, key=lambda e: _sid(e[0]))[0], ex=ttl)
        pipe.execute()
        for i, _ in entries:
            self._rr.pop(i, None)
        self.applied += len(entries)
        return len(entries)

    def _baseline(self, f: Mapping[str, str]) -> int | None:
        if f.get("cache") in HIT_OUTCOMES or not f.get("node") or f.get("node") == "cache":
            return None  # never reached an engine: round robin would not have seen it either
        return self.baseline.serve(f.get("pool", ""), f.get("blocks", ""), _int(f.get("prompt")),
                                   _int(f.get("cached")))

    def step(self) -> int:
        """Read and apply one batch. Returns the entries applied. Raises redis.RedisError.

        :data:`LAST` is WATCHed from before the read to the EXEC: if another consumer of the same
        name (an old control plane still stopping while the new one starts) applied a batch in
        between, possibly the same pending entries, the EXEC is refused and the batch is read
        again from the pending list, less what the other one acknowledged."""
        for _ in range(10):
            pipe = self.r.pipeline(transaction=True)
            try:
                pipe.watch(LAST)
                return self.apply(self.read(), pipe)
            except redis.WatchError:
                self._pending = True
                pipe.reset()
            except redis.RedisError:
                self._pending = True  # whatever was read and not acknowledged is read again
                self._group = False  # and the group made again if Redis lost it (flushed, restarted empty)
                pipe.reset()
                raise
        return 0

    def drain(self, timeout: float = 30.0) -> int:
        """Apply batches until a read finds nothing (tests, tools). Returns the entries applied."""
        total, deadline = 0, time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.step()
            if n == 0:
                break
            total += n
        return total

    # ----------------------------------------------------------- thread
    def start(self) -> None:
        """Run :meth:`step` in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="kvgate-usage", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (within about ``block_ms``); a batch being applied is finished first."""
        self.stopping.set()
        if self._thread:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        delay = 0.0
        while not self.stopping.is_set():
            try:
                self.step()
                if delay:
                    log.info("usage rollups: Redis is back, consuming %s again", STREAM)
                delay = 0.0
            except redis.RedisError as exc:
                if not delay:
                    log.warning("usage rollups: Redis failed (%s); retrying with back-off", exc)
                delay = min(BACKOFF_S[1], max(BACKOFF_S[0], delay * 2))
                self.stopping.wait(delay)
            except Exception:  # a bad entry must not end the thread; the batch stays pending
                log.exception("usage rollups: batch failed")
                self._pending = True
                self.stopping.wait(BACKOFF_S[1])
