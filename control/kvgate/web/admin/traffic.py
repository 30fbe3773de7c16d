"""Traffic figures for the admin page, read from the gateway's request log and cache in Redis.

:class:`TrafficTracker` follows the request-log stream ``kvgate:log`` (written by
``lua/kvgate/reqlog.lua``: ``ts pool node status cache kind fp key ms point tries home``) and
gives, per pool over a window: cache outcomes, the **affinity ratio** (share of routed
requests served by their route key's *home* node: the entry's ``node`` against its ``home``,
both logged by the gateway's balancer; no ring here), failovers, 5xx errors and the hottest
route keys. It reads the window once, then only the entries added since its last update,
and keeps per-pool time buckets in memory. :func:`traffic_view` gives the same figures in
one go (a tracker used once). :func:`cache_stats` counts the response-cache entries
(``kvgate:resp:v<N>:*``) of the current and of older namespace versions, and their memory.

``python -m kvgate.bench.micro.traffic`` compares the two on 50,000 synthetic entries.

All raise :class:`redis.RedisError` when Redis fails; the caller decides what to show.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis

from ... import keys
from ...policy.model import Policy

STREAM = keys.LOG_STREAM
"""The request-log stream (``reqlog.lua``'s ``_M.STREAM``)."""

RESP_PREFIX = keys.RESP_PREFIX
"""Response-cache keys: ``kvgate:resp:v<N>:<tenant>:<sha256>`` (``cache_key.lua``)."""

HOT_KEYS = 10
PAGE = 1000
CLOCK_SKEW_S = 5.0
"""Slack between the gateway's clock (an entry's ``ts``, the request's start) and Redis's
(the stream id, set at the flush, after the request ended): the read stops only at ids this
much older than the window start."""

CACHE_OUTCOMES = ("HIT", "MISS", "BYPASS")


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else ("" if v is None else str(v))


def _int(v: str) -> int | None:
    try:
        return int(v)
    except ValueError:
        return None


FIELDS = ("ts", "pool", "node", "status", "cache", "kind", "key", "point", "tries", "home")
"""The entry fields read (``fp`` and ``ms`` are not needed here)."""

_US, _RS = "\x1f", "\x1e"

# One page of XRANGE (ARGV[4] == '0': ARGV[1] = start, ARGV[2] = end, oldest first) or
# XREVRANGE ('1': ARGV[1] = end, ARGV[2] = start, newest first), packed into ONE string:
# "id US ts US pool ... RS id US ...", fields in FIELDS order, missing ones empty, a value
# holding US or RS emptied. redis-py's pure-Python parser would otherwise spend most of the
# time on the 22 strings of every entry (50,000 entries: ~5 s instead of well under one),
# and still a good part on one string per entry. Run per page, so Redis is never blocked
# for long.
_PAGE_SCRIPT = """
local cmd = ARGV[4] == '1' and 'XREVRANGE' or 'XRANGE'
local rows = redis.call(cmd, KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
local names = {%s}
local out = {}
for i = 1, #rows do
    local f = rows[i][2]
    local m = {}
    for j = 1, #f, 2 do m[f[j]] = f[j + 1] end
    local parts = {rows[i][1]}
    for k = 1, #names do
        local v = m[names[k]] or ''
        if string.find(v, '[\\30\\31]') then v = '' end
        parts[k + 1] = v
    end
    out[i] = table.concat(parts, '\\31')
end
return table.concat(out, '\\30')
""" % ", ".join(f"'{f}'" for f in FIELDS)

Row = tuple  # (id, ts, pool, node, status, cache, kind, key, point, tries, home): strings, FIELDS order


def _page(r: redis.Redis, first: str, last: str, count: int = PAGE, reverse: bool = True) -> list[Row]:
    """Up to ``count`` entries as rows ``(id, *FIELDS)`` (missing fields ``""``): newest
    first from ``first`` down to ``last`` (``reverse``, XREVRANGE), or oldest first from
    ``first`` up to ``last`` (XRANGE); both bounds inclusive."""
    try:
        packed = _s(r.eval(_PAGE_SCRIPT, 1, STREAM, first, last, count, "1" if reverse else "0"))
    except redis.ResponseError:
        # scripting refused (a managed Redis without EVAL): the plain command
        raw = (r.xrevrange(STREAM, max=first, min=last, count=count) if reverse
               else r.xrange(STREAM, min=first, max=last, count=count))
        out: list[Row] = []
        for i, fields in raw:
            d = {_s(k): _s(v) for k, v in fields.items()}
            out.append((_s(i), *(d.get(f, "") for f in FIELDS)))
        return out
    if not packed:
        return []
    return [tuple(row.split(_US)) for row in packed.split(_RS)]


# ---------------------------------------------------------------- stream ids
_SEQ_MAX = (1 << 64) - 1


def _sid(v: Any) -> tuple[int, int]:
    """``"1795945484455-3"`` → ``(1795945484455, 3)``."""
    ms, _, seq = _s(v).partition("-")
    return int(ms), int(seq or 0)


def _fmt(sid: tuple[int, int]) -> str:
    return f"{sid[0]}-{sid[1]}"


def _after(sid: tuple[int, int]) -> str:
    """The smallest id above ``sid`` (an inclusive start: ``(id`` needs Redis 6.2)."""
    return _fmt((sid[0], sid[1] + 1) if sid[1] < _SEQ_MAX else (sid[0] + 1, 0))


def _before(sid: tuple[int, int]) -> str:
    """The largest id below ``sid`` (an inclusive end)."""
    return _fmt((sid[0], sid[1] - 1) if sid[1] > 0 else (sid[0] - 1, _SEQ_MAX))


def _stream_info(r: redis.Redis) -> tuple[tuple[int, int], tuple[int, int] | None] | None:
    """(last generated id, first entry's id or None when empty) of the stream; None when
    there is no stream."""
    try:
        info = r.xinfo_stream(STREAM)
    except redis.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise
    first = info.get("first-entry")
    return _sid(info["last-generated-id"]), (_sid(first[0]) if first else None)


# ---------------------------------------------------------------- aggregation
# counters of a bucket (and of a pool's window total), by index
_REQ, _HIT, _MISS, _BYPASS, _ROUTED, _AT_HOME, _FAILOVERS, _ERRORS, _KEYED = range(9)
_NC = 9
_CACHE_IDX = {"HIT": _HIT, "MISS": _MISS, "BYPASS": _BYPASS}

BUCKET_S = 15.0
"""Default bucket width of :class:`TrafficTracker` (seconds)."""
MAX_KEYS = 1000
"""Default cap on the route keys kept per bucket and pool (:class:`TrafficTracker`)."""


# A route key's record, in a bucket and in a pool's window sum, one flat list (a list and
# a dict per key would take twice the memory): [requests, kind, home, idx, node, n, node,
# n, ...]: kind and home of the key's newest entry, idx the bucket that entry is in, then
# where the requests were served ("cache" for HITs), usually one node.
_N, _KIND, _HOME, _AT, _NODES = range(5)


def _add_nodes(dst: list[Any], src: list[Any]) -> None:
    for i in range(_NODES, len(src), 2):
        node = src[i]
        for j in range(_NODES, len(dst), 2):
            if dst[j] == node:
                dst[j + 1] += src[i + 1]
                break
        else:
            dst += (node, src[i + 1])


def _sub_nodes(dst: list[Any], src: list[Any]) -> None:
    for i in range(_NODES, len(src), 2):
        node = src[i]
        for j in range(_NODES, len(dst), 2):
            if dst[j] == node:
                left = dst[j + 1] - src[i + 1]
                if left > 0:
                    dst[j + 1] = left
                else:
                    del dst[j:j + 2]
                break


class _Bucket:
    """One pool's entries whose ``ts`` falls in ``[idx × bucket_s, (idx + 1) × bucket_s)``:
    counters ``c``, route-key records ``keys`` (hash → record, at most ``max_keys`` once
    merged), and ``other``: keyed requests of the keys folded out by the cap (they still
    count in ``c[_KEYED]``)."""

    __slots__ = ("c", "keys", "other")

    def __init__(self) -> None:
        self.c = [0] * _NC
        self.keys: dict[str, list[Any]] = {}
        self.other = 0


class _PoolWindow:
    """A pool's buckets (by idx) and their running sum: ``c`` = Σ buckets' ``c``; ``keys``:
    hash → record summed over the buckets that hold the key, with the newest bucket's kind
    and home."""

    __slots__ = ("buckets", "c", "keys")

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.c = [0] * _NC
        self.keys: dict[str, list[Any]] = {}

    def add(self, idx: int, d: _Bucket, max_keys: int) -> None:
        """Merge ``d`` (entries newer than those already in bucket ``idx``) into bucket
        ``idx`` and the sum; then cap the bucket's keys."""
        b = self.buckets.get(idx)
        if b is None:
            b = self.buckets[idx] = _Bucket()
        bc, c = b.c, self.c
        for i, v in enumerate(d.c):
            bc[i] += v
            c[i] += v
        b.other += d.other
        bkeys, wkeys = b.keys, self.keys
        for key, rec in d.keys.items():
            brec = bkeys.get(key)
            if brec is None:
                bkeys[key] = rec
            else:
                brec[_N] += rec[_N]
                brec[_KIND] = rec[_KIND]
                if rec[_HOME]:  # a HIT logs no home: the last known one stays
                    brec[_HOME] = rec[_HOME]
                _add_nodes(brec, rec)
            w = wkeys.get(key)
            if w is None:
                wkeys[key] = list(rec)
            else:
                w[_N] += rec[_N]
                if idx >= w[_AT]:
                    w[_KIND], w[_AT] = rec[_KIND], idx
                    if rec[_HOME]:
                        w[_HOME] = rec[_HOME]
                elif not w[_HOME]:
                    w[_HOME] = rec[_HOME]
                _add_nodes(w, rec)
        if len(bkeys) > max_keys:
            ranked = sorted(bkeys.items(), key=lambda kv: (-kv[1][_N], kv[0]))
            b.keys = dict(ranked[:max_keys])
            folded = ranked[max_keys:]
            b.other += sum(rec[_N] for _, rec in folded)
            self._sub_keys(folded)

    def _sub_keys(self, keys: Iterable[tuple[str, list[Any]]]) -> None:
        wkeys = self.keys
        for key, rec in keys:
            w = wkeys[key]
            w[_N] -= rec[_N]
            if w[_N] <= 0:
                del wkeys[key]
            else:
                _sub_nodes(w, rec)

    def expire(self, first_idx: int) -> None:
        """Drop the buckets below ``first_idx``."""
        for idx in [i for i in self.buckets if i < first_idx]:
            b = self.buckets.pop(idx)
            c = self.c
            for i, v in enumerate(b.c):
                c[i] -= v
            self._sub_keys(b.keys.items())


class _Delta:
    """Entries read by one update, aggregated per pool and bucket (outside the lock)."""

    def __init__(self, policy: Policy, bucket_s: float, cutoff: float, newest_first: bool) -> None:
        self.node_ids = {p.name: frozenset(n.id for n in p.nodes) for p in policy.pools}
        self.bucket_s, self.cutoff, self.newest_first = bucket_s, cutoff, newest_first
        self.pools: dict[str, dict[int, _Bucket]] = {p.name: {} for p in policy.pools}
        self.strs: dict[str, str] = {}
        self.taken = 0
        self.oldest: float | None = None

    def take(self, rows: list[Row], limit: int | None = None) -> bool:
        """Aggregate the rows; entries with ``ts`` before the cutoff are skipped. With
        ``limit``: stop before the in-window entry that would exceed it; False then."""
        bucket_s, cutoff, newest_first = self.bucket_s, self.cutoff, self.newest_first
        pools, node_ids, strs = self.pools, self.node_ids, self.strs
        for entry_id, ts_s, pool, node, status, cache, kind, key, point_s, tries, home in rows:
            try:
                ts = float(ts_s)
            except ValueError:
                ts = math.nan
            if not math.isfinite(ts):  # no usable ts: the stream id's time (ms) stands in
                ts = int(entry_id.split("-", 1)[0]) / 1000.0
            if ts < cutoff:
                continue  # started before the window (a long stream, logged at its end)
            if limit is not None and self.taken >= limit:
                return False
            self.taken += 1
            if self.oldest is None or ts < self.oldest:
                self.oldest = ts
            buckets = pools.get(pool)
            if buckets is None:
                continue  # a pool that left the policy
            idx = int(ts // bucket_s)
            b = buckets.get(idx)
            if b is None:
                b = buckets[idx] = _Bucket()
            c = b.c
            c[_REQ] += 1
            ci = _CACHE_IDX.get(cache)
            if ci is not None:
                c[ci] += 1
            st = _int(status)
            if st is not None and st >= 500:
                c[_ERRORS] += 1
            if tries and tries != "1" and tries != "0":
                t = _int(tries)
                if t is not None and t > 1:
                    c[_FAILOVERS] += 1
            if not point_s or _int(point_s) is None:
                continue  # no route key
            hit = cache == "HIT"
            if not hit and node in ("", "cache"):
                continue  # no node answered (every node failed)
            if home:
                home = strs.setdefault(home, home)
                if not hit:
                    c[_ROUTED] += 1
                    if node == home and node in node_ids[pool]:
                        c[_AT_HOME] += 1
            # no home: a HIT (never balanced), or an entry logged before the gateway logged
            # homes (issue 10): unknown, outside routed/at_home
            if key:
                c[_KEYED] += 1
                # one str object per distinct kind and node in the records, not one per entry
                kind = strs.setdefault(kind, kind)
                served = "cache" if hit else (home if node == home else strs.setdefault(node, node))
                rec = b.keys.get(key)
                if rec is None:
                    b.keys[key] = [1, kind, home, idx, served, 1]
                    continue
                rec[_N] += 1
                if not newest_first:
                    rec[_KIND] = kind
                    if home:
                        rec[_HOME] = home
                elif not rec[_HOME]:
                    rec[_HOME] = home
                for j in range(_NODES, len(rec), 2):
                    if rec[j] == served:
                        rec[j + 1] += 1
                        break
                else:
                    rec += (served, 1)
        return True


class TrafficTracker:
    """Incremental per-pool traffic figures over the request log (what :func:`traffic_view`
    gives), kept up to date by reading only the entries added since the last update.

    :meth:`update` reads the stream and folds its entries into per-pool **time buckets**
    (by the entry's ``ts``, ``bucket_s`` wide); :meth:`view` merges the buckets of the
    window, without touching Redis. The first update (and one after a pause longer than
    the window, or after a policy with no stream yet) *backfills*: it reads the window
    newest first, like :func:`traffic_view`, at most ``max_backfill`` entries. Later
    updates read the entries after the last id seen, oldest first (XRANGE from the id
    after it, pages of 1000), at most ``max_step`` per call: more than that and
    :attr:`lagging` is set and the rest is read by the next calls.

    **The window's edge** moves by whole buckets: an entry is taken only if its ``ts`` is
    in the window when it is read, and a bucket is dropped once all of it is older than
    the window, so the figures cover between ``window_s`` and ``window_s + bucket_s``.
    ``bucket_s`` defaults to 15 s: the edge is then within 1.7 % of a 15-minute window,
    and a window holds at most 61 buckets per pool, which bounds memory (below) and the
    work of expiry. (10 s: 91 buckets for no visible gain; 60 s: a 7 % edge.)

    **Home.** A key's home is the entry's ``home`` field, logged by the gateway's balancer
    on the home ring in force when the request was served (see :func:`traffic_view`); a
    later weight change does not re-judge an entry. Entries without a ``home`` (cache HITs,
    entries older than the field) are outside ``routed``/``at_home``. A hot key's ``kind``
    is that of its newest entry, its ``home`` the newest one logged.

    **Policy changes.** The pools are those of the policy given to the update: buckets of
    a pool that left it are dropped, entries of pools it does not have are ignored, and a
    pool whose nodes changed keeps its buckets (their entries were judged on the home ring of
    their time).

    **Memory.** Each bucket keeps at most ``max_keys`` route keys (default 1000), the
    ones with most requests; the others are folded into one count that still counts in
    the totals and in ``share`` (so a key's count is a lower bound once its bucket had
    more than ``max_keys`` keys; the top 10 of the window are unaffected unless the
    traffic is spread so thin that no key stands out). Counters are exact. So at most
    ``pools × (window_s / bucket_s + 1) × max_keys`` key records are kept in the buckets
    (900 s, 15 s, 1000: 61,000 per pool), plus one per distinct key of the window for the
    running sum: about 185 bytes per record (flat lists; measured by ``python -m
    kvgate.bench.micro.traffic``), so at most about 22 MB per pool, reached only when a
    pool sees more than 1000 distinct keys every 15 s (over 67 requests/s) for the whole
    window. Below the cap memory follows the traffic: 50,000 entries over 5,000 keys hold
    about 6 MB. While an update runs, its entries (at most ``max_step``, or
    ``max_backfill`` for a backfill) are held on the side, uncapped (a backfill of 50,000
    distinct keys: about 30 MB more at its peak).

    **The stream trimmed or replaced.** Each update asks ``XINFO STREAM`` first. No
    stream: nothing to read (the buckets age out). Its oldest entry newer than the last
    id read: entries were trimmed (``MAXLEN``) or the stream was re-created before they
    were read; reading goes on from what exists and :attr:`gaps` counts the event. Its
    last generated id *older* than the last id read (deleted and re-created with older
    ids, or restored from an older snapshot): the entries it holds are taken as read,
    reading goes on after its last id, and :attr:`gaps` counts it.

    **Threads and failures.** One update runs at a time (a second caller waits for the
    first, then reads what is new since). Redis is read outside the lock that
    :meth:`view` takes; the entries are folded in afterwards under it. A Redis error
    propagates (:class:`redis.RedisError`) and changes nothing: the next update reads the
    same entries again.
    """

    def __init__(self, window_s: float = 900, bucket_s: float = BUCKET_S, max_backfill: int = 50000,
                 max_step: int = 20000, max_keys: int = MAX_KEYS) -> None:
        if window_s <= 0 or bucket_s <= 0:
            raise ValueError("window_s and bucket_s must be > 0")
        if max_step < 1 or max_keys < 1 or max_backfill < 0:
            raise ValueError("max_step and max_keys must be >= 1, max_backfill >= 0")
        self.window_s = float(window_s)
        self.bucket_s = float(bucket_s)
        self.max_backfill = int(max_backfill)
        self.max_step = int(max_step)
        self.max_keys = int(max_keys)
        self._update_lock = threading.Lock()  # one update at a time
        self._lock = threading.Lock()  # the state below
        self._pools: dict[str, _PoolWindow] = {}
        self._cursor: tuple[int, int] | None = None
        self._floor: float | None = None
        self.lagging = False
        """The last update stopped at ``max_step`` before the stream's end: the figures
        miss the newest entries until later updates catch up."""
        self.gaps = 0
        """Updates that found entries missing (trimmed or the stream replaced before they
        were read)."""
        self.updates = 0
        self.entries_read = 0
        """Stream entries read by all updates (in the window or not)."""

    # ---------------------------------------------------------------- update
    def update(self, r: redis.Redis, policy: Policy, now: float | None = None) -> None:
        """Read the entries added since the last update (the first: the window) and fold
        them in.

        Args:
            r: Redis client (``decode_responses`` either way).
            policy: the policy in force (its pools and their nodes).
            now: the window's end (default: ``time.time()``).

        Raises:
            redis.RedisError: Redis failed; the tracker is left as it was.
        """
        with self._update_lock:
            now = time.time() if now is None else float(now)
            cutoff = now - self.window_s
            info = _stream_info(r)
            with self._lock:
                cursor = self._cursor
            if (cursor is not None and info is not None and info[0] > cursor
                    and cursor[0] < (cutoff - CLOCK_SKEW_S) * 1000):
                # new entries, and the last one read is older than the window: what the
                # buckets hold has expired, and the backlog is mostly older than the window
                # too: start over, reading the window newest first
                cursor = None
            read = 0
            gap = lagging = False
            floor: float | None = None
            if cursor is None:
                delta = _Delta(policy, self.bucket_s, cutoff, newest_first=True)
                new_cursor = None if info is None else info[0]
                if new_cursor is not None:
                    complete, read = self._backfill(r, delta, new_cursor, cutoff)
                    if not complete:
                        floor = now if delta.oldest is None else delta.oldest
            else:
                delta = _Delta(policy, self.bucket_s, cutoff, newest_first=False)
                new_cursor = cursor
                if info is not None:
                    last, first = info
                    if last < cursor:
                        new_cursor, gap = last, True
                    elif last > cursor:
                        gap = first is None or first > cursor
                        new_cursor, read = self._step(r, delta, cursor, last)
                        lagging = new_cursor < last
            with self._lock:
                if cursor is None:
                    self._pools, self._floor = {}, floor
                for name in [n for n in self._pools if n not in delta.pools]:
                    del self._pools[name]
                for name, buckets in delta.pools.items():
                    pw = self._pools.get(name)
                    if pw is None:
                        pw = self._pools[name] = _PoolWindow()
                    for idx in sorted(buckets):
                        pw.add(idx, buckets[idx], self.max_keys)
                self._expire(cutoff)
                self._cursor = new_cursor
                self.lagging = lagging
                self.gaps += gap
                self.updates += 1
                self.entries_read += read

    def _backfill(self, r: redis.Redis, delta: _Delta, last: tuple[int, int], cutoff: float) -> tuple[bool, int]:
        """The window newest first, from ``last`` down; (False: cut at ``max_backfill``,
        entries read)."""
        # ids are Redis's clock at the flush, after the request's start (ts): nothing older
        # than this id can be in the window
        start = str(max(0, int((cutoff - CLOCK_SKEW_S) * 1000)))
        end = _fmt(last)
        read = 0
        while True:
            rows = _page(r, end, start, PAGE, reverse=True)
            read += len(rows)
            if not rows:
                return True, read
            if not delta.take(rows, limit=self.max_backfill):
                return False, read
            if len(rows) < PAGE:
                return True, read
            end = _before(_sid(rows[-1][0]))

    def _step(self, r: redis.Redis, delta: _Delta, cursor: tuple[int, int],
              last: tuple[int, int]) -> tuple[tuple[int, int], int]:
        """Entries after ``cursor`` up to ``last``, oldest first, at most ``max_step``;
        (the new cursor: ``last`` once all were read, else the last id read; entries read)."""
        end = _fmt(last)
        read = 0
        while True:
            n = min(PAGE, self.max_step - read)
            if n <= 0:
                return cursor, read  # the rest next time
            rows = _page(r, _after(cursor), end, n, reverse=False)
            if rows:
                delta.take(rows)
                read += len(rows)
                cursor = _sid(rows[-1][0])
            if len(rows) < n:
                return last, read  # up to last: read (entries deleted meanwhile are gaps)

    def _expire(self, cutoff: float) -> None:
        # a bucket goes once it ends at or before the cutoff
        first_idx = math.floor(cutoff / self.bucket_s)
        for pw in self._pools.values():
            pw.expire(first_idx)

    # ---------------------------------------------------------------- view
    def view(self, policy: Policy, now: float | None = None) -> list[dict[str, Any]]:
        """Per-pool figures over the window ending at ``now``, from the buckets (no Redis):
        one dict per pool of ``policy``, in policy order, shaped as :func:`traffic_view`'s.
        ``truncated``/``covered_s``: the first update's backfill was cut at
        ``max_backfill`` and the window still reaches back before the oldest entry it
        took."""
        now = time.time() if now is None else float(now)
        cutoff = now - self.window_s
        out: list[dict[str, Any]] = []
        with self._lock:
            self._expire(cutoff)
            truncated = self._floor is not None and self._floor >= cutoff
            covered = (now - self._floor) if truncated and self._floor is not None else self.window_s
            for p in policy.pools:
                pw = self._pools.get(p.name)
                c = pw.c if pw is not None else [0] * _NC
                n = c[_REQ]
                cache = {"HIT": c[_HIT], "MISS": c[_MISS], "BYPASS": c[_BYPASS]}
                hot = (heapq.nsmallest(HOT_KEYS, pw.keys.items(), key=lambda kv: (-kv[1][_N], kv[0]))
                       if pw is not None else [])
                out.append({
                    "pool": p.name,
                    "balancer": p.balancer,
                    "window_s": self.window_s,
                    "covered_s": covered,
                    "requests": n,
                    "cache": cache,
                    "cache_ratio": {k: _ratio(v, n) for k, v in cache.items()},
                    "routed": c[_ROUTED],
                    "at_home": c[_AT_HOME],
                    "affinity_ratio": _ratio(c[_AT_HOME], c[_ROUTED]),
                    "failovers": c[_FAILOVERS],
                    "errors": c[_ERRORS],
                    "hot_keys": [{"key": key, "kind": w[_KIND], "requests": w[_N], "share": w[_N] / c[_KEYED],
                                  "home": w[_HOME], "nodes": dict(zip(w[_NODES::2], w[_NODES + 1::2]))}
                                 for key, w in hot],
                    "truncated": truncated,
                })
        return out

    def stats(self) -> dict[str, Any]:
        """State for tests and the benchmark: ``{"cursor", "lagging", "gaps", "updates",
        "entries_read", "buckets", "bucket_keys", "window_keys", "folded"}``."""
        with self._lock:
            return {
                "cursor": None if self._cursor is None else _fmt(self._cursor),
                "lagging": self.lagging,
                "gaps": self.gaps,
                "updates": self.updates,
                "entries_read": self.entries_read,
                "buckets": sum(len(pw.buckets) for pw in self._pools.values()),
                "bucket_keys": sum(len(b.keys) for pw in self._pools.values() for b in pw.buckets.values()),
                "window_keys": sum(len(pw.keys) for pw in self._pools.values()),
                "folded": sum(b.other for pw in self._pools.values() for b in pw.buckets.values()),
            }


def _ratio(n: int, d: int) -> float | None:
    return n / d if d else None


def traffic_view(r: redis.Redis, policy: Policy, window_s: float = 900,
                 max_entries: int = 50000, now: float | None = None) -> list[dict[str, Any]]:
    """Per-pool traffic over the newest request-log entries, read in one go (a one-shot
    :class:`TrafficTracker` without a key cap). The admin page keeps a tracker instead,
    which reads only the new entries on each refresh.

    Reads ``kvgate:log`` newest first (XREVRANGE, pages of 1000) until entries are older
    than ``now - window_s`` (by their ``ts``, the request's start) or ``max_entries``
    entries were taken; in that case each pool says ``truncated: True`` and ``covered_s``
    tells how far back the figures reach.

    A key's **home** is the entry's ``home`` field: the gateway's balancer logs the key's node
    on the pool's *home ring* (lua/kvgate/balancer/peers.lua), built from every node of the
    pool at its serving weight (the runtime's ``home_weight``,
    :func:`kvgate.fleet.weights.serving_weights`: the weight in force, or for a node not taking
    traffic — draining, drained, ejected, warming — its target weight). So a drained node's
    keys stay homed on it, and the requests a drain moved elsewhere count as *not at home*:
    that is the intent, since those keys' KV cache is on the home node, and the ratio shows
    what a drain (or a failed node) costs. With every node up, the home ring is the gateway's
    routing ring and a request is away from home only after a failover. Each entry is judged
    by the home in force when it was served. For ``round_robin`` and ``least_conn`` pools the
    same home ring is used; their affinity ratio is then about 1/nodes, by chance.

    Args:
        r: Redis client (``decode_responses`` either way).
        policy: the policy in force; entries of pools it does not have are ignored.
        window_s: how far back to read (seconds).
        max_entries: at most this many entries are read (all pools together).
        now: the window's end (default: ``time.time()``).

    Returns:
        One dict per pool of ``policy``, in policy order::

            {"pool", "balancer", "window_s", "covered_s", "requests",
             "cache": {"HIT", "MISS", "BYPASS"}, "cache_ratio": {...: float | None},
             "routed", "at_home", "affinity_ratio": float | None,
             "failovers", "errors",
             "hot_keys": [{"key", "kind", "requests", "share", "home", "nodes": {node: n}}],
             "truncated": bool}

        ``requests``: every entry of the pool in the window. ``routed``: entries served by
        a node (not a cache HIT) that carry a ``point`` and a ``home``; entries without one
        count in ``requests`` and ``cache`` only: those written before the gateway logged
        ``point`` or ``home`` (issue 10: *unknown*, no ring is rebuilt for them), and those
        without a route key (kind ``prefix`` in a ``round_robin`` or ``least_conn`` pool,
        whose key is not computed). ``at_home``: routed entries whose node is the key's home. ``failovers``: entries with ``tries >
        1`` (a second node was tried). ``errors``: status >= 500. ``hot_keys``: the 10 keys
        (16-hex hash of the route key, as logged) with most requests among routed and HIT
        entries that carry a key and a point; ``share`` is of all such requests of the pool;
        ``nodes`` counts where they were served (``"cache"`` for HITs); ``home`` is the newest
        home logged for the key (``""`` when only HITs or older entries were seen).

    Raises:
        redis.RedisError: Redis failed.
    """
    now = time.time() if now is None else float(now)
    max_entries = max(0, int(max_entries))
    tracker = TrafficTracker(window_s=window_s, max_backfill=max_entries, max_keys=max(MAX_KEYS, max_entries))
    tracker.update(r, policy, now=now)
    return tracker.view(policy, now=now)


def _resp_version(key: str) -> int | None:
    """``kvgate:resp:v12:default:ab…`` → 12; None for a key of another shape."""
    rest = key[len(RESP_PREFIX):]
    if not rest.startswith("v"):
        return None
    digits = rest[1:].split(":", 1)[0]
    return int(digits) if digits.isdigit() else None


def cache_stats(r: redis.Redis, namespace_version: int, scan_limit: int = 20000,
                sample: int = 1000) -> dict[str, Any]:
    """Response-cache entries in Redis: those of ``namespace_version`` (the policy's
    ``cache.namespace_version``, the ones the gateway reads) and *stale* ones, of any other
    version (left by an invalidation; they expire by their TTL).

    SCAN ``MATCH kvgate:resp:* COUNT 1000`` stops after ``scan_limit`` keys; the counts are
    then lower bounds. Memory is ``MEMORY USAGE`` of the first ``sample`` keys of each
    group (one pipeline), extrapolated to the group's count. ``estimated`` is True when the
    scan was cut or a group had more keys than were measured.

    Returns:
        ``{"namespace_version", "entries", "bytes", "stale_entries", "stale_bytes",
        "estimated"}``.

    Raises:
        redis.RedisError: Redis failed.
    """
    current: list[str] = []
    stale: list[str] = []
    seen: set[str] = set()
    cursor: int | str = 0
    cut = False
    while True:
        cursor, keys = r.scan(cursor=cursor, match=RESP_PREFIX + "*", count=1000)
        for raw in keys:
            key = _s(raw)
            if key in seen:
                continue  # SCAN may return a key twice
            if len(seen) >= scan_limit:
                cut = True
                break
            seen.add(key)
            v = _resp_version(key)
            if v is None:
                continue
            (current if v == namespace_version else stale).append(key)
        if cut or int(cursor) == 0:
            break

    def measure(keys: list[str]) -> tuple[int, bool]:
        picked = keys[:sample]
        if not picked:
            return 0, False
        pipe = r.pipeline(transaction=False)
        for k in picked:
            pipe.memory_usage(k)
        sizes = [s for s in pipe.execute() if isinstance(s, int)]  # None: expired meanwhile
        if not sizes:
            return 0, True
        total = sum(sizes)
        if len(sizes) == len(keys):
            return total, False
        return round(total / len(sizes) * len(keys)), True

    cur_bytes, cur_est = measure(current)
    stale_bytes, stale_est = measure(stale)
    return {
        "namespace_version": namespace_version,
        "entries": len(current),
        "bytes": cur_bytes,
        "stale_entries": len(stale),
        "stale_bytes": stale_bytes,
        "estimated": cut or cur_est or stale_est,
    }
