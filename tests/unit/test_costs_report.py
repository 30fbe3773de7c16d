"""The cost report's arithmetic (kvgate.costs.report.summarize): grouping, the affinity split of the
prefix saving, cost per successful request with failures paid, dollars only at the end."""

from __future__ import annotations

import pytest

from kvgate.costs.report import affinity_nusd, check_by, parse_since, summarize
from kvgate.costs.rollup import bucket_key

H = 1_796_000_400  # an hour start, 2026-11-30T01:00Z


def buckets() -> dict[str, dict[str, int]]:
    return {
        bucket_key(H, "team-a", "m", "p"): {"requests": 10, "ok": 8, "failed": 2, "hits": 2, "prompt": 1000,
                                            "cached": 400, "rr_cached": 100, "completion": 100,
                                            "cost": 3_000_000_001, "saved_prefix": 1200, "saved_cache": 70,
                                            "avoided_prompt": 50, "ttft_ms_sum": 300, "ttft_n": 6},
        bucket_key(H + 3600, "team-a", "m", "p"): {"requests": 2, "ok": 2, "prompt": 200, "cached": 30,
                                                   "rr_cached": 50, "cost": 1_000_000_000, "saved_prefix": 90},
        bucket_key(H, "team-b", "m", "q"): {"requests": 1, "ok": 0, "failed": 1, "cost": 5, "saved_batch": 3},
    }


def test_affinity_is_the_prefix_saving_above_round_robin_per_bucket() -> None:
    assert affinity_nusd({"saved_prefix": 1200, "cached": 400, "rr_cached": 100}) == 900
    assert affinity_nusd({"saved_prefix": 90, "cached": 30, "rr_cached": 50}) == 0  # round robin did better
    assert affinity_nusd({"saved_prefix": 10, "cached": 3, "rr_cached": 1}) == 6  # floor(10 * 2 / 3)
    assert affinity_nusd({"saved_prefix": 0, "cached": 0}) == 0


def test_by_tenant_rows_total_and_series() -> None:
    rep = summarize(buckets(), "tenant", H, H + 7200)
    a, b = rep["rows"]  # highest cost first
    assert a["key"] == "team-a" and b["key"] == "team-b"
    assert a["requests"] == 12 and a["ok"] == 10 and a["prompt"] == 1200 and a["cached"] == 430
    assert a["cost_usd"] == 4.000000001
    # affinity summed per bucket (900 + 0), not from the sums (1290 * (430 - 150) / 430 = 840)
    assert a["saved_usd"] == {"cache": 70e-9, "prefix": 1290e-9, "affinity": 900e-9, "batch": 0.0}
    assert a["cost_per_ok_usd"] == pytest.approx(4.000000001 / 10)
    assert a["hit_ratio"] == 2 / 12 and a["prefix_hit_ratio"] == 430 / 1200 and a["ttft_ms_mean"] == 50
    assert b["cost_per_ok_usd"] is None and b["saved_usd"]["batch"] == 3e-9
    t = rep["total"]
    assert t["key"] == "total" and t["requests"] == 13 and t["cost_usd"] == (4_000_000_006) / 1e9
    assert t["saved_usd"]["affinity"] == 900e-9
    assert rep["series"] == [{"hour": H, "by": {"team-a": 3.000000001, "team-b": 5e-9}},
                             {"hour": H + 3600, "by": {"team-a": 1.0}}]


def test_by_pool_day_hour_and_the_interval() -> None:
    assert [r["key"] for r in summarize(buckets(), "pool", H, H + 7200)["rows"]] == ["p", "q"]
    day = summarize(buckets(), "day", H, H + 7200)["rows"]
    assert [(r["key"], r["requests"]) for r in day] == [("2026-11-30", 13)]
    hours = summarize(buckets(), "hour", H, H + 7200)["rows"]
    assert [(r["key"], r["requests"]) for r in hours] == [("2026-11-30T01:00Z", 11), ("2026-11-30T02:00Z", 2)]
    later = summarize(buckets(), "tenant", H + 3600, H + 7200)
    assert later["total"]["requests"] == 2


def test_empty_report() -> None:
    rep = summarize({}, "model", H, H + 10)
    assert rep["rows"] == [] and rep["series"] == [] and rep["total"]["requests"] == 0
    assert rep["total"]["cost_per_ok_usd"] is None and rep["total"]["hit_ratio"] is None


def test_since_and_by_are_checked() -> None:
    assert parse_since("24h") == 86400 and parse_since("7d") == 604800 and parse_since("90m") == 5400
    assert parse_since("3600") == 3600 and parse_since("2w") == 1209600
    for bad in ("", "-1h", "1y", "abc", "0", "h", "99999d"):
        with pytest.raises(ValueError):
            parse_since(bad)
    assert check_by("day") == "day"
    with pytest.raises(ValueError, match="by must be one of tenant, model, pool, day, hour"):
        check_by("node")
