"""The replay's report arithmetic and the pooled ceiling, on hand-checkable numbers."""

import math

import pytest

from kvgate.bench.ceiling import pooled_ceiling
from kvgate.bench.replay import REPORT_KEYS, RequestResult, build_report


def counters(queries, hits, ttft_sum=0.0, ttft_count=0.0):
    return {"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits,
            "vllm:time_to_first_token_seconds_sum": ttft_sum, "vllm:time_to_first_token_seconds_count": ttft_count}


def test_report_from_counter_deltas():
    before = {"a": counters(1000, 100, 1.0, 2), "b": counters(500, 0)}
    after = {"a": counters(2000, 600, 3.0, 6), "b": counters(1500, 300, 2.0, 4)}
    results = [RequestResult(True, 200, ttft_s=t / 10) for t in range(1, 11)] + [RequestResult(False, 502)]
    r = build_report(results, before, after, ceiling=0.5)
    # deltas: a 1000 queries / 500 hits, b 1000 / 300 → 800 / 2000
    assert r.hit_ratio == pytest.approx(0.4)
    assert r.ratio_to_ceiling == pytest.approx(0.8)
    # prefill computed: a 500, b 700 → max / mean = 700 / 600
    assert r.prefill_tokens == {"a": 500, "b": 700}
    assert r.imbalance == pytest.approx(700 / 600, abs=1e-4)
    assert (r.requests_ok, r.requests_failed) == (10, 1)
    assert r.ttft_p50_s == pytest.approx(0.55)
    assert 0.99 <= r.ttft_p99_s <= 1.0
    assert r.engine_ttft_mean_s == pytest.approx((2.0 + 2.0) / (4 + 4))
    assert list(r.as_json()) == list(REPORT_KEYS)


def test_report_without_traffic_is_defined():
    r = build_report([], {"a": counters(0, 0)}, {"a": counters(0, 0)}, ceiling=0.0)
    assert r.hit_ratio == 0.0 and r.ratio_to_ceiling == 0.0 and r.imbalance == 0.0
    assert math.isnan(r.ttft_p50_s)


def test_pooled_ceiling_counts_shared_blocks_only():
    words = [f"w{i}" for i in range(200)]
    a = [{"role": "user", "content": " ".join(words)}]
    b = [{"role": "user", "content": " ".join(words[:100] + ["x"] * 100)}]
    # 202 tokens each (one template token + 200 words + the generation prompt): 12 full blocks
    res = pooled_ceiling([a, a, b], num_blocks=10_000, block_size=16)
    # a again: all 12 blocks hit ((202 - 1) // 16 = 12, vLLM's cap); b shares the first 101
    # tokens with a → 6 full blocks = 96 tokens
    assert (res.hits, res.queries) == (192 + 96, 3 * 202)
    assert res.ratio == pytest.approx(288 / 606)
    # 14 blocks: b's 6 new blocks evict 4 of a's least recently used tail blocks, so the
    # second a hits only its first 8 blocks (like vLLM, a prompt's tail blocks are the least
    # recently used of it, so a chain is evicted from its end)
    tiny = pooled_ceiling([a, b, a], num_blocks=14, block_size=16)
    assert tiny.hits == 96 + 8 * 16
