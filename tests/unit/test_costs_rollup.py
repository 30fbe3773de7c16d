"""Usage rollups (kvgate.costs.rollup): one request-log entry's increments and their sums per
tenant × model × pool × hour bucket, for every rule of the contract (issue 13)."""

from __future__ import annotations

from kvgate.costs.rollup import aggregate, bucket_key, entry_counts, parse_bucket_key

HOUR = 1_796_000_400  # an hour start (divisible by 3600)


def e(**kw: str) -> dict[str, str]:
    base = {"ts": f"{HOUR + 12.5:.3f}", "pool": "p", "node": "n1", "status": "200", "cache": "MISS", "tries": "1",
            "tenant": "team-a", "key_id": "k1", "model": "m", "prompt": "100", "cached": "32", "completion": "10",
            "ttft": "40", "batch": "", "blocks": "", "cost": "1000", "saved_cache": "0", "saved_prefix": "96",
            "saved_batch": "0"}
    base.update(kw)
    return base


def test_a_computed_answer_counts_its_tokens_money_and_ttft() -> None:
    assert entry_counts(e(), rr_cached=16) == {
        "requests": 1, "ok": 1, "prompt": 100, "cached": 32, "completion": 10, "rr_cached": 16, "cost": 1000,
        "cost_ok": 1000, "saved_prefix": 96, "ttft_ms_sum": 40, "ttft_n": 1}


def test_a_hit_counts_avoided_tokens_not_computed_ones() -> None:
    c = entry_counts(e(cache="HIT", node="cache", tries="0", prompt="100", cached="0", completion="10", cost="0",
                       saved_cache="2600", saved_prefix="0", ttft="2"))
    assert c == {"requests": 1, "ok": 1, "hits": 1, "avoided_prompt": 100, "avoided_completion": 10,
                 "saved_cache": 2600, "ttft_ms_sum": 2, "ttft_n": 1}


def test_failed_retried_and_unpriced() -> None:
    c = entry_counts(e(status="502", tries="2", cost="", saved_prefix="0", ttft=""))
    assert c["failed"] == 1 and c["retried"] == 1 and c["unpriced"] == 1
    assert "ok" not in c and "cost" not in c and "cost_ok" not in c and "ttft_n" not in c
    assert entry_counts(e(status="0"))["failed"] == 1  # no answer at all
    assert "failed" not in entry_counts(e(status="304"))
    # a failed request's cost is cost but not cost_ok: cost per successful request pays for it
    c = entry_counts(e(status="500", cost="700"))
    assert c["cost"] == 700 and "cost_ok" not in c


def test_an_entry_older_than_the_usage_fields_is_a_request_with_unknown_usage() -> None:
    old = {"ts": f"{HOUR + 1:.3f}", "pool": "p", "node": "n1", "status": "200", "cache": "MISS", "tries": "1",
           "tenant": ""}
    assert entry_counts(old, rr_cached=5) == {"requests": 1, "ok": 1, "unknown_usage": 1, "unpriced": 1}


def test_aggregate_sums_per_bucket_and_names_the_bucket() -> None:
    entries = [("1-0", e()), ("1-1", e(prompt="50", cached="0", cost="400", saved_prefix="0")),
               ("1-2", e(tenant="")), ("1-3", e(ts=f"{HOUR + 3600:.3f}")), ("1-4", e(model="org/m:q4"))]
    got = aggregate(entries, rr={"1-0": 16, "1-1": 0})
    a = got[bucket_key(HOUR, "team-a", "m", "p")]
    assert a["requests"] == 2 and a["prompt"] == 150 and a["cached"] == 32 and a["cost"] == 1400
    assert a["rr_cached"] == 16 and a["saved_prefix"] == 96
    assert got[bucket_key(HOUR, "none", "m", "p")]["requests"] == 1
    assert got[bucket_key(HOUR + 3600, "team-a", "m", "p")]["requests"] == 1
    assert sum(b["requests"] for b in got.values()) == 5
    k = bucket_key(HOUR, "team-a", "org/m:q4", "p")
    assert k == f"kvgate:usage:h:{HOUR}:team-a:org/m%3Aq4:p" and parse_bucket_key(k) == (HOUR, "team-a", "org/m:q4", "p")


def test_no_ts_uses_the_stream_id() -> None:
    f = e()
    del f["ts"]
    got = aggregate([(f"{(HOUR + 7200) * 1000 + 5}-0", f)])
    assert list(got) == [bucket_key(HOUR + 7200, "team-a", "m", "p")]


def test_no_affinity_is_claimed_without_logged_blocks() -> None:
    # a prompt shorter than one chunk logs no block: the baseline cannot model it, so round
    # robin is credited with everything the engine had cached (affinity 0 for it)
    assert entry_counts(e(blocks=""), rr_cached=None)["rr_cached"] == 32
    assert "rr_cached" not in entry_counts(e(cached=""), rr_cached=None)  # unknown usage: nothing
