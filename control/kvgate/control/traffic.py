"""Traffic figures for the admin page, read from the gateway's request log and cache in Redis.

:func:`traffic_view` reads the newest entries of the request-log stream ``kvgate:log``
(written by ``lua/kvgate/reqlog.lua``: ``ts pool node status cache kind fp key ms point
tries``) and gives, per pool: cache outcomes, the **affinity ratio** (share of routed
requests served by their route key's *home* node on nginx's consistent-hash ring, rebuilt
by :mod:`kvgate.ring` from the entry's ``point``), failovers, 5xx errors and the hottest
route keys. :func:`cache_stats` counts the response-cache entries (``kvgate:resp:v<N>:*``)
of the current and of older namespace versions, and their memory.

Both raise :class:`redis.RedisError` when Redis fails; the caller decides what to show.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import redis

from ..policy.model import Policy
from ..render import WEIGHT_SCALE
from ..ring import Ring, pool_ring

STREAM = "kvgate:log"
"""The request-log stream (``reqlog.lua``'s ``_M.STREAM``)."""

RESP_PREFIX = "kvgate:resp:"
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


def _float(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def home_weights(policy: Policy, weights: Mapping[str, int]) -> dict[str, int]:
    """The weights of the ring that defines a key's *home*: the weights in force, except
    that a node at 0 (down: draining, drained, ejected, joining, warming) counts at its base
    weight × ``WEIGHT_SCALE``, as if it were up."""
    out: dict[str, int] = {}
    for node in policy.nodes():
        w = int(weights.get(node.id, node.weight * WEIGHT_SCALE))
        out[node.id] = w if w > 0 else node.weight * WEIGHT_SCALE
    return out


FIELDS = ("ts", "pool", "node", "status", "cache", "kind", "key", "point", "tries")
"""The entry fields read (``fp`` and ``ms`` are not needed here)."""

_SEP = "\x1f"

# One page of XREVRANGE, each entry packed into one string "id US ts US pool ...": redis-py's
# pure-Python parser would otherwise spend most of the time on the 22 strings of every entry
# (50,000 entries: ~5 s instead of well under one). Run per page, so Redis is never blocked
# for long.
_PAGE_SCRIPT = """
local rows = redis.call('XREVRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
local names = {%s}
local out = {}
for i = 1, #rows do
    local f = rows[i][2]
    local m = {}
    for j = 1, #f, 2 do m[f[j]] = f[j + 1] end
    local parts = {rows[i][1]}
    for k = 1, #names do parts[k + 1] = m[names[k]] or '' end
    out[i] = table.concat(parts, '\\31')
end
return out
""" % ", ".join(f"'{f}'" for f in FIELDS)


def _page(r: redis.Redis, end: str, start: str) -> list[tuple[str, dict[str, str]]]:
    """(id, fields) of up to PAGE entries from ``end`` down to ``start``, newest first."""
    try:
        rows = r.eval(_PAGE_SCRIPT, 1, STREAM, end, start, PAGE)
    except redis.ResponseError:
        # scripting refused (a managed Redis without EVAL): the plain command
        return [(_s(i), {_s(k): _s(v) for k, v in raw.items()})
                for i, raw in r.xrevrange(STREAM, max=end, min=start, count=PAGE)]
    out = []
    for row in rows:
        parts = _s(row).split(_SEP)
        if len(parts) == len(FIELDS) + 1:
            out.append((parts[0], dict(zip(FIELDS, parts[1:]))))
    return out


def _read_log(r: redis.Redis, cutoff: float, max_entries: int) -> tuple[list[dict[str, str]], bool]:
    """Entries of the stream with ``ts >= cutoff``, newest first, at most ``max_entries``;
    and whether ``max_entries`` cut the window (another in-window entry was left)."""
    out: list[dict[str, str]] = []
    end = "+"
    # ids are Redis's clock at the flush, after the request's start (ts): nothing older
    # than this id can be in the window
    start = str(max(0, int((cutoff - CLOCK_SKEW_S) * 1000)))
    while True:
        batch = _page(r, end, start)
        if not batch:
            return out, False
        for entry_id, fields in batch:
            ts = _float(fields.get("ts", ""))
            if ts is None:  # no usable ts: the stream id's time (ms) stands in
                ts = int(entry_id.split("-", 1)[0]) / 1000.0
            if ts < cutoff:
                continue  # started before the window (a long stream, logged at its end)
            if len(out) >= max_entries:
                return out, True
            fields["ts"] = repr(ts)
            out.append(fields)
        end = "(" + batch[-1][0]


def _ratio(n: int, d: int) -> float | None:
    return n / d if d else None


def traffic_view(r: redis.Redis, policy: Policy, weights: Mapping[str, int], window_s: float = 900,
                 max_entries: int = 50000, now: float | None = None) -> list[dict[str, Any]]:
    """Per-pool traffic over the newest request-log entries.

    Reads ``kvgate:log`` newest first (XREVRANGE, pages of 1000) until entries are older
    than ``now - window_s`` (by their ``ts``, the request's start) or ``max_entries``
    entries were taken; in that case each pool says ``truncated: True`` and ``covered_s``
    tells how far back the figures reach.

    A key's **home** is its node on a ring built from every node of the pool at its weight
    in force (``weights``: node id → nginx weight, the control plane's
    ``plane.applied.weights``; a node missing from it counts at base weight × 100), except
    that a node at weight 0 (down: draining, drained, ejected, warming...) keeps its base
    weight × 100 on that ring. So a drained node's keys stay homed on it, and the requests a
    drain moved elsewhere count as *not at home*: that is the intent, since those keys' KV
    cache is on the home node, and the ratio shows what a drain (or a failed node) costs.
    With every node up, the home ring is nginx's own ring and a request is away from home
    only after a failover or a weight change (keys moved since the entry was logged: entries
    are judged against the weights in force now). For ``round_robin`` and ``least_conn``
    pools the same ring is used; their affinity ratio is then about 1/nodes, by chance.

    Args:
        r: Redis client (``decode_responses`` either way).
        policy: the policy in force; entries of pools it does not have are ignored.
        weights: nginx weights in force per node id (0 = down).
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
        a node (not a cache HIT) that carry a ``point``; entries without one count in
        ``requests`` and ``cache`` only: those written before the gateway logged
        ``point``, and those without a route key (kind ``prefix`` in a ``round_robin`` or
        ``least_conn`` pool, whose key is not computed). ``at_home``:
        routed entries whose node is the key's home. ``failovers``: entries with ``tries >
        1`` (a second node was tried). ``errors``: status >= 500. ``hot_keys``: the 10 keys
        (16-hex hash of the route key, as logged) with most requests among routed and HIT
        entries that carry a key and a point; ``share`` is of all such requests of the pool;
        ``nodes`` counts where they were served (``"cache"`` for HITs).

    Raises:
        redis.RedisError: Redis failed.
    """
    now = time.time() if now is None else float(now)
    cutoff = now - float(window_s)
    entries, truncated = _read_log(r, cutoff, max(0, int(max_entries)))
    oldest = min((float(e["ts"]) for e in entries), default=None)
    covered = (now - oldest) if truncated and oldest is not None else float(window_s)

    hw = home_weights(policy, weights)
    rings: dict[str, Ring] = {p.name: pool_ring(policy, p.name, hw) for p in policy.pools}
    node_ids = {p.name: {n.id for n in p.nodes} for p in policy.pools}

    acc: dict[str, dict[str, Any]] = {
        p.name: {"requests": 0, "cache": Counter(), "routed": 0, "at_home": 0, "failovers": 0, "errors": 0,
                 "keyed": 0, "keys": {}}
        for p in policy.pools
    }
    homes: dict[tuple[str, int], str] = {}
    for e in entries:
        a = acc.get(e.get("pool", ""))
        if a is None:
            continue  # a pool that left the policy
        pool = e["pool"]
        a["requests"] += 1
        cache = e.get("cache", "")
        if cache in CACHE_OUTCOMES:
            a["cache"][cache] += 1
        status = _int(e.get("status", ""))
        if status is not None and status >= 500:
            a["errors"] += 1
        tries = _int(e.get("tries", ""))
        if tries is not None and tries > 1:
            a["failovers"] += 1
        point = _int(e.get("point", ""))
        if point is None:
            continue
        node = e.get("node", "")
        hit = cache == "HIT"
        if not hit and node in ("", "cache"):
            continue  # no node answered (every node failed)
        home = homes.get((pool, point))
        if home is None:
            home = homes[(pool, point)] = rings[pool].home(point)
        if not hit:
            a["routed"] += 1
            if node == home and node in node_ids[pool]:
                a["at_home"] += 1
        key = e.get("key", "")
        if key:
            a["keyed"] += 1
            k = a["keys"].get(key)
            if k is None:
                # newest first: the first entry seen gives the key's latest kind
                k = a["keys"][key] = {"key": key, "kind": e.get("kind", ""), "requests": 0, "home": home,
                                      "nodes": Counter()}
            k["requests"] += 1
            k["nodes"]["cache" if hit else node] += 1

    out: list[dict[str, Any]] = []
    for p in policy.pools:
        a = acc[p.name]
        n = a["requests"]
        cache = {c: a["cache"][c] for c in CACHE_OUTCOMES}
        hot = sorted(a["keys"].values(), key=lambda k: (-k["requests"], k["key"]))[:HOT_KEYS]
        out.append({
            "pool": p.name,
            "balancer": p.balancer,
            "window_s": float(window_s),
            "covered_s": covered,
            "requests": n,
            "cache": cache,
            "cache_ratio": {c: _ratio(v, n) for c, v in cache.items()},
            "routed": a["routed"],
            "at_home": a["at_home"],
            "affinity_ratio": _ratio(a["at_home"], a["routed"]),
            "failovers": a["failovers"],
            "errors": a["errors"],
            "hot_keys": [{**k, "share": k["requests"] / a["keyed"], "nodes": dict(k["nodes"])} for k in hot],
            "truncated": truncated,
        })
    return out


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
