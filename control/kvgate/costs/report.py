"""The cost report (issue 13 item 4): the rollups of an interval, grouped by one dimension.

``build_report(r, by="tenant", since_s=86400)`` reads the buckets of ``kvgate:usage:hours``
whose hour overlaps the interval (rollups are hourly: the interval starts at the hour holding
``now − since``) and returns the object ``GET /api/v1/costs``, ``kvgate costs --json`` and the
admin page's Costs tab show::

    {"since": <unix s, an hour start>, "until": <unix s>, "by": "tenant",
     "rows": [{"key": "team-a", "requests", "ok", "failed", "hits", "retried", "unpriced", "unknown_usage",
               "prompt", "cached", "completion", "avoided_prompt", "avoided_completion", "rr_cached",
               "cost_usd", "saved_usd": {"cache", "prefix", "affinity", "batch"}, "cost_per_ok_usd",
               "hit_ratio", "prefix_hit_ratio", "rr_prefix_hit_ratio", "ttft_ms_mean"}, ...],   # by cost, highest first
     "total": {the same fields, "key": "total"},
     "series": [{"hour": <unix s>, "by": {"team-a": <cost usd>, ...}}, ...]}          # oldest first

Rules (every sum in integers — tokens, nano-dollars — dollars only in the output):

* ``cost_usd``: Σ cost of every request, failed and retried ones included;
  ``cost_per_ok_usd`` = that ÷ ``ok`` (None without a successful request): the cost of a
  successful request, paying for the ones that failed.
* ``saved_usd.cache``: hits' avoided requests at full price; ``prefix``: cached tokens × (input −
  cached input price); ``batch``: the batch discount.
* ``saved_usd.affinity``: the part of ``prefix`` above the round-robin baseline, per bucket
  ``saved_prefix × max(0, cached − rr_cached) ÷ cached`` (floor, n$), then summed.
* ``hit_ratio`` = hits ÷ requests (response cache); ``prefix_hit_ratio`` = cached ÷ prompt
  (engines); ``rr_prefix_hit_ratio`` = rr_cached ÷ prompt (the baseline's, same requests).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import redis

from ..policy.pricing import NANO_PER_USD
from .rollup import FIELDS, HOURS, parse_bucket_key

BY = ("tenant", "model", "pool", "day", "hour")
MAX_SINCE_S = 3660 * 86400
_SINCE = re.compile(r"^\s*(\d{1,9})\s*([smhdw]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> int:
    """``"24h"`` → 86400: a duration ``<n>[s|m|h|d|w]`` (a bare number: seconds), 1 s .. 3660 days.

    Raises:
        ValueError: anything else (the API answers 400).
    """
    m = _SINCE.match(text or "")
    if not m:
        raise ValueError(f"since must be a duration such as 24h, 7d, 90m or 3600 (seconds), got {text[:40]!r}")
    s = int(m.group(1)) * _UNIT[m.group(2)]
    if not 1 <= s <= MAX_SINCE_S:
        raise ValueError(f"since must be between 1 s and {MAX_SINCE_S // 86400} days, got {text[:40]!r}")
    return s


def check_by(by: str) -> str:
    """``by`` if it is one of :data:`BY`; raises ValueError (→ 400) otherwise."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, got {str(by)[:40]!r}")
    return by


def _usd(nusd: int) -> float:
    return nusd / NANO_PER_USD


def group_key(by: str, hour: int, tenant: str, model: str, pool: str) -> str:
    """The row key of a bucket: the tenant, model or pool, the UTC day ``YYYY-MM-DD`` or hour ``YYYY-MM-DDTHH:00Z``."""
    if by == "tenant":
        return tenant
    if by == "model":
        return model
    if by == "pool":
        return pool
    t = datetime.fromtimestamp(hour, tz=timezone.utc)
    return t.strftime("%Y-%m-%d") if by == "day" else t.strftime("%Y-%m-%dT%H:00Z")


def affinity_nusd(b: dict[str, int]) -> int:
    """A bucket's affinity saving, n$: ``saved_prefix × max(0, cached − rr_cached) // cached``."""
    cached = b.get("cached", 0)
    if cached <= 0:
        return 0
    return b.get("saved_prefix", 0) * max(0, cached - b.get("rr_cached", 0)) // cached


def row(key: str, s: dict[str, int]) -> dict[str, Any]:
    """One report row from summed integer fields (with ``affinity`` in n$ already summed per bucket)."""
    g = s.get
    ok, req, prompt = g("ok", 0), g("requests", 0), g("prompt", 0)
    return {
        "key": key,
        **{f: g(f, 0) for f in ("requests", "ok", "failed", "hits", "retried", "unpriced", "unknown_usage",
                                "prompt", "cached", "completion", "avoided_prompt", "avoided_completion",
                                "rr_cached")},
        "cost_usd": _usd(g("cost", 0)),
        "saved_usd": {"cache": _usd(g("saved_cache", 0)), "prefix": _usd(g("saved_prefix", 0)),
                      "affinity": _usd(g("affinity", 0)), "batch": _usd(g("saved_batch", 0))},
        "cost_per_ok_usd": _usd(g("cost", 0)) / ok if ok else None,
        "hit_ratio": g("hits", 0) / req if req else None,
        "prefix_hit_ratio": g("cached", 0) / prompt if prompt else None,
        "rr_prefix_hit_ratio": g("rr_cached", 0) / prompt if prompt else None,
        "ttft_ms_mean": g("ttft_ms_sum", 0) / g("ttft_n", 0) if g("ttft_n", 0) else None,
    }


def summarize(buckets: dict[str, dict[str, int]], by: str, since: int, until: int) -> dict[str, Any]:
    """The report object from bucket hashes ``{bucket key: {field: int}}`` (pure; see the module)."""
    check_by(by)
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total: dict[str, int] = defaultdict(int)
    series: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for bkey, b in buckets.items():
        hour, tenant, model, pool = parse_bucket_key(bkey)
        if hour + 3600 <= since or hour > until:
            continue
        k = group_key(by, hour, tenant, model, pool)
        aff = affinity_nusd(b)
        for acc in (groups[k], total):
            for f in FIELDS:
                acc[f] += b.get(f, 0)
            acc["affinity"] += aff
        series[hour][k] += b.get("cost", 0)
    rows = [row(k, v) for k, v in groups.items()]
    rows.sort(key=lambda x: (-x["cost_usd"], -x["requests"], x["key"]))
    return {"since": since, "until": until, "by": by, "rows": rows, "total": row("total", total),
            "series": [{"hour": h, "by": {k: _usd(v) for k, v in sorted(series[h].items())}}
                       for h in sorted(series)]}


def read_buckets(r: redis.Redis, since: int, until: int) -> dict[str, dict[str, int]]:
    """The bucket hashes listed in ``kvgate:usage:hours`` with an hour in ``[since, until]``
    (expired ones are skipped). Raises redis.RedisError."""
    names = [k.decode() if isinstance(k, bytes) else k for k in r.zrangebyscore(HOURS, since, until)]
    out: dict[str, dict[str, int]] = {}
    for i in range(0, len(names), 500):
        pipe = r.pipeline(transaction=False)
        for k in names[i:i + 500]:
            pipe.hgetall(k)
        for k, h in zip(names[i:i + 500], pipe.execute()):
            if h:
                out[k] = {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in h.items()}
    return out


def build_report(r: redis.Redis, by: str = "tenant", since_s: int = 86400, now: float | None = None) -> dict[str, Any]:
    """The report of the last ``since_s`` seconds grouped ``by`` (see the module). Raises
    ValueError (a bad ``by``), redis.RedisError."""
    check_by(by)
    until = int(now if now is not None else time.time())
    since = (until - since_s) // 3600 * 3600
    return summarize(read_buckets(r, since, until), by, since, until)
