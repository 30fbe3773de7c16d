"""The admin page's Costs page (issue 13 item 5): ``/admin/costs`` and ``/admin/costs.json``.

What it shows, all from :func:`kvgate.costs.report.build_report` (the object ``kvgate costs
--json`` and ``GET /api/v1/costs`` print, so the figures are the same) over ``?since=`` (default
``24h``), grouped by tenant:

* a table per tenant: requests, ok, tokens (prompt, cached, completion), cost, saved by lever
  (cache, prefix, affinity, batch) and cost per successful request (failed and retried requests'
  cost included), with the total row;
* cost over time stacked by tenant (the report's hourly ``series``), savings by lever;
* the four-quadrant view: the last hour's requests read from the request log (``kvgate:log``,
  fields ``prompt`` and ``cost``: tokens and integer nano-dollars), input tokens × cost per
  request, split at the medians of the priced requests (policy-free: the split moves with the
  traffic), the share of requests in each quadrant and the "expensive and long" one (above
  both medians) highlighted. A request with either field unknown (``""``) is left out and counted.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from flask import jsonify, render_template, request

from ... import keys as contract
from ..auth import require_admin
from ..errors import error_page, json_error, wants_json
from ..state import services
from .views import bp

QUADRANT_WINDOW_S = 3600
QUADRANT_MAX = 5000
"""The scatter plot reads at most this many of the newest log entries of the last hour."""


def report(r: Any, since_s: int) -> dict[str, Any]:
    """The cost report by tenant of the last ``since_s`` s (the contract's object; see
    :mod:`kvgate.costs.report`). Raises redis.RedisError."""
    from ...costs.report import build_report
    return build_report(r, "tenant", since_s)


def fmt_usd(v: float | None) -> str:
    """Dollars for the page: ``-`` for None, 2 decimals from $1, else 3 significant digits
    (``$0.00000779``: one request's cost is often a fraction of a cent)."""
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 1:
        return f"${v:,.2f}"
    if abs(v) >= 0.01:
        return f"${v:.4f}"
    digits = 2 - int(math.floor(math.log10(abs(v))))
    return f"${v:.{digits}f}"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _median(xs: list[int]) -> float:
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def last_hour(r: Any, now: float | None = None, count: int = QUADRANT_MAX) -> tuple[list[tuple[int, int]], int]:
    """The last hour's request-log entries as ``[(prompt tokens, cost n$)]`` (newest first, at most
    ``count``) and how many entries were left out because a field was unknown. Raises redis.RedisError."""
    now = time.time() if now is None else now
    start = int((now - QUADRANT_WINDOW_S) * 1000)
    points, unknown = [], 0
    for _id, fields in r.xrevrange(contract.LOG_STREAM, max="+", min=str(start), count=count):
        f = {_s(k): _s(v) for k, v in fields.items()}
        p, c = f.get("prompt", ""), f.get("cost", "")
        if p.isdigit() and c.isdigit():
            points.append((int(p), int(c)))
        else:
            unknown += 1
    return points, unknown


def quadrants(points: list[tuple[int, int]]) -> dict[str, Any]:
    """The four-quadrant view of ``[(prompt tokens, cost n$)]``: ``{"n", "split": {"tokens",
    "cost_usd"} (the medians), "shares": {"short_cheap", "short_expensive", "long_cheap",
    "long_expensive"} (0..1), "points": [[tokens, cost usd], ...]}``. A point on a median counts
    below it (long = tokens > median, expensive = cost > median)."""
    if not points:
        return {"n": 0, "split": None, "shares": None, "points": []}
    mt, mc = _median([p for p, _ in points]), _median([c for _, c in points])
    counts = {"short_cheap": 0, "short_expensive": 0, "long_cheap": 0, "long_expensive": 0}
    for p, c in points:
        counts[("long" if p > mt else "short") + ("_expensive" if c > mc else "_cheap")] += 1
    n = len(points)
    return {"n": n, "split": {"tokens": mt, "cost_usd": mc / 1e9},
            "shares": {k: v / n for k, v in counts.items()},
            "points": [[p, c / 1e9] for p, c in points]}


def costs_view(r: Any, since_s: int, report_fn: Callable[[Any, int], dict[str, Any]] = report,
               now: float | None = None) -> dict[str, Any]:
    """The page's figures: ``{"report": <the cost report>, "quadrants": quadrants(...),
    "unknown": <log entries without prompt or cost>}``. Raises redis.RedisError."""
    rep = report_fn(r, since_s)
    points, unknown = last_hour(r, now)
    return {"report": rep, "quadrants": quadrants(points), "unknown": unknown}


def _refuse(status: int, title: str, message: str, type_: str, code: str):
    """A refused page: OpenAI's error shape for scripts (``costs.json``, Bearer), else the HTML error page."""
    return json_error(status, message, type_, code) if wants_json() else error_page(title, message, status)


def _figures():
    import redis

    from ...costs.report import parse_since
    since = request.args.get("since", "24h")
    try:
        since_s = parse_since(since)
    except ValueError as exc:
        return None, since, _refuse(400, "Bad request", str(exc), "invalid_request_error", "bad_request")
    try:
        return costs_view(services().store.r, since_s), since, None
    except redis.RedisError as exc:
        return None, since, _refuse(503, "Redis unavailable", f"the cost report could not be read: {exc}",
                                    "server_error", "redis_unavailable")


@bp.get("/costs")
@require_admin
def costs():
    data, since, refused = _figures()
    if refused is not None:
        return refused
    if wants_json():
        return jsonify(data)
    return render_template("admin/costs.html", page="costs", since=since, usd=fmt_usd, **data)


@bp.get("/costs.json")
@require_admin
def costs_json():
    data, _since, refused = _figures()
    return refused if refused is not None else jsonify(data)
