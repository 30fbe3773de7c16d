"""The admin page's per-node time series (kvgate.web.admin.history): counter increases and
resets, windows, gaps, rates, bounded memory, and concurrent use."""

from __future__ import annotations

import json
import threading

import pytest

from kvgate.web.admin.history import History
from kvgate.control.report import check_report

T0 = 1_700_000_000.0


def report(queries=None, hits=None, *, waiting=0, running=1, kv=0.5, start_time=None, gpu=None):
    engine = {"healthy": True, "waiting": waiting, "running": running, "kv_cache_usage": kv,
              "prefix_cache_queries": queries, "prefix_cache_hits": hits, "start_time": start_time}
    body = {"node_id": "n1", "ts": 0, "engine": engine}
    if gpu is not None:
        body["gpu"] = {"status": "ok", "devices": gpu}
    return check_report(body)          # the shape the control plane stores


def gw(requests: dict, errors: dict | None = None, ok: bool = True) -> dict:
    return {"ok": ok, "requests": requests, "errors": errors or {}, "inflight": {}, "failovers": {}}


# ------------------------------------------------------------------ reports → series

def test_hit_ratio_is_the_interval_increase_and_the_first_sample_has_none() -> None:
    h = History()
    h.add_report("n1", T0, report(1000, 200, waiting=3, running=5))
    h.add_report("n1", T0 + 2, report(1400, 500, waiting=1, running=6))   # +400 queries, +300 hits
    h.add_report("n1", T0 + 4, report(1400, 500))                         # nothing queried: a gap
    s = h.series("n1", now=T0 + 5)
    assert s["t"] == [T0, T0 + 2, T0 + 4]
    assert s["prefix_hit_ratio"] == [None, pytest.approx(0.75), None]
    assert s["waiting"] == [3, 1, 0] and s["running"] == [5, 6, 1]
    assert s["kv_cache_usage"] == [0.5, 0.5, 0.5]
    assert len({len(v) for v in s.values()}) == 1, "aligned arrays"
    json.dumps(s)                                                         # served as JSON as is


def test_a_counter_that_went_down_started_again_from_zero() -> None:
    h = History()
    h.add_report("n1", T0, report(5000, 4000))
    h.add_report("n1", T0 + 2, report(100, 30))          # engine restarted: Δ = new values
    h.add_report("n1", T0 + 4, report(300, 130))         # then ordinary increases again
    assert h.series("n1", now=T0 + 4)["prefix_hit_ratio"] == [None, pytest.approx(0.3), pytest.approx(0.5)]
    # only one counter going down is a restart too (both start from 0)
    h.add_report("n1", T0 + 6, report(400, 10))
    assert h.series("n1", now=T0 + 6)["prefix_hit_ratio"][-1] == pytest.approx(10 / 400)


def test_a_new_engine_start_time_is_a_restart_even_when_counters_climbed_past() -> None:
    h = History()
    h.add_report("n1", T0, report(100, 50, start_time=10.0))
    h.add_report("n1", T0 + 2, report(900, 90, start_time=500.0))   # restarted and already busy
    assert h.series("n1", now=T0 + 2)["prefix_hit_ratio"][-1] == pytest.approx(0.1)


def test_reports_without_engine_figures_are_gaps_and_keep_the_counters() -> None:
    h = History()
    h.add_report("n1", T0, report(1000, 100))
    h.add_report("n1", T0 + 2, check_report({"engine": {"healthy": False, "error": "refused"}}))
    h.add_report("n1", T0 + 4, check_report({}))                       # no engine part at all
    h.add_report("n1", T0 + 6, report(2000, 600))                      # Δ spans the silence
    s = h.series("n1", now=T0 + 6)
    assert s["waiting"] == [0, None, None, 0]
    assert s["prefix_hit_ratio"] == [None, None, None, pytest.approx(0.5)]


def test_gpu_figures() -> None:
    h = History()
    gib = 2**30
    h.add_report("n1", T0, report(gpu=[
        {"index": 0, "memory_used_bytes": 30 * gib, "memory_total_bytes": 80 * gib, "utilization_pct": 40},
        {"index": 1, "memory_used_bytes": 50 * gib, "memory_total_bytes": 80 * gib, "utilization_pct": 80}]))
    h.add_report("n1", T0 + 2, report(gpu=[]))
    s = h.series("n1", now=T0 + 2)
    assert s["gpu_util_pct"] == [pytest.approx(60.0), None]
    assert s["gpu_mem_frac"] == [pytest.approx(0.5), None]


def test_series_keeps_the_window_and_puts_gaps_in_silences() -> None:
    h = History(window_s=60, gap_s=10)
    for i in range(0, 100, 2):
        h.add_report("n1", T0 + i, report(waiting=i))
    h.add_report("n1", T0 + 130, report(waiting=130))   # 32 s without a report
    s = h.series("n1", now=T0 + 130)
    assert s["t"][0] > T0 + 130 - 60 and s["t"][-1] == T0 + 130
    assert s["t"] == sorted(s["t"])
    assert s["t"][-2] == pytest.approx(T0 + (98 + 130) / 2) and s["waiting"][-2] is None
    assert all(v[-2] is None for k, v in s.items() if k != "t")
    # later `now`: older samples leave the window; nothing in it, empty arrays
    assert h.series("n1", now=T0 + 185)["t"] == [T0 + 130]
    assert h.series("n1", now=T0 + 500) == {k: [] for k in s}
    # samples after `now` are not shown
    assert h.series("n1", now=T0 + 120)["t"][-1] == T0 + 98


def test_unknown_node_and_forget() -> None:
    h = History()
    assert h.series("nope", now=T0)["t"] == []
    assert h.rates("nope", now=T0) == {"req_s": None, "error_rate": None, "prefix_hit_ratio": None, "samples": 0}
    h.add_report("n1", T0, report(1, 1))
    h.add_gateway(T0, gw({"n1": 5}))
    assert h.nodes() == ["n1"]
    h.forget("n1")
    h.forget("n1")                                       # forgetting twice is fine
    assert h.nodes() == [] and h.series("n1", now=T0)["t"] == []


def test_memory_is_bounded() -> None:
    h = History(window_s=10_000, maxlen=50)
    for i in range(500):
        h.add_report("n1", T0 + i, report(i * 10, i))
        h.add_gateway(T0 + i, gw({"n1": i}))
    assert len(h.series("n1", now=T0 + 500)["t"]) == 50
    assert len(h._nodes["n1"].reports) == 50 and len(h._nodes["n1"].answers) == 50
    # and by the window, without any reading
    h = History(window_s=30)
    for i in range(500):
        h.add_report("n1", T0 + i, report(i * 10, i))
    assert len(h._nodes["n1"].reports) <= 31


def test_a_clock_that_went_back_starts_the_node_again() -> None:
    h = History()
    h.add_report("n1", T0 + 100, report(1000, 500))
    h.add_report("n1", T0 + 50, report(1100, 600))
    s = h.series("n1", now=T0 + 200)
    assert s["t"] == [T0 + 50] and s["prefix_hit_ratio"] == [None]


# ------------------------------------------------------------------ rates

def test_request_and_error_rates_over_the_last_seconds() -> None:
    h = History()
    h.add_gateway(T0, gw({"n1": 1000, "n2": 0}, {"n1": 10}))
    for i in range(1, 61):                                 # n1: 5 answers/s, one 5xx in 10
        h.add_gateway(T0 + i, gw({"n1": 1000 + 5 * i, "n2": 0}, {"n1": 10 + i // 2}))
    r = h.rates("n1", now=T0 + 60, over_s=60)
    assert r["req_s"] == pytest.approx(5.0)
    assert r["error_rate"] == pytest.approx(30 / 300)
    assert r["samples"] == 0 and r["prefix_hit_ratio"] is None
    r2 = h.rates("n2", now=T0 + 60)
    assert r2["req_s"] == 0.0 and r2["error_rate"] is None, "no answers: no error rate"
    # a shorter span
    assert h.rates("n1", now=T0 + 60, over_s=10)["req_s"] == pytest.approx(5.0)


def test_gateway_counters_reset_and_failed_scrapes() -> None:
    h = History()
    h.add_gateway(T0, gw({"n1": 500}, {"n1": 50}))
    assert h.rates("n1", now=T0)["req_s"] is None, "one snapshot: no rate yet"
    h.add_gateway(T0 + 1, gw({}, ok=False))               # a failed scrape: ignored
    h.add_gateway(T0 + 2, gw({"n1": 20}, {"n1": 2}))      # nginx restarted: Δ = 20, 2
    r = h.rates("n1", now=T0 + 2)
    assert r["req_s"] == pytest.approx(10.0) and r["error_rate"] == pytest.approx(0.1)
    h.add_gateway(T0 + 4, gw({"n1": 40}, {"n1": 2}))
    r = h.rates("n1", now=T0 + 4)
    assert r["req_s"] == pytest.approx(40 / 4) and r["error_rate"] == pytest.approx(2 / 40)


def test_prefix_hit_ratio_over_the_span_weights_by_queries() -> None:
    h = History()
    h.add_report("n1", T0, report(0, 0))
    h.add_report("n1", T0 + 2, report(100, 90))            # 90 %
    h.add_report("n1", T0 + 4, report(1000, 90))           # 0 % of 900
    h.add_report("n1", T0 + 100, report(1100, 190))        # 100 % of 100
    r = h.rates("n1", now=T0 + 5, over_s=60)
    assert r["prefix_hit_ratio"] == pytest.approx(90 / 1000) and r["samples"] == 3
    r = h.rates("n1", now=T0 + 100, over_s=60)
    assert r["prefix_hit_ratio"] == pytest.approx(1.0) and r["samples"] == 1
    assert h.rates("n1", now=T0 + 300, over_s=60)["samples"] == 0


# ------------------------------------------------------------------ threads

def test_concurrent_writers_and_readers() -> None:
    h = History(window_s=1e9)
    errors: list[BaseException] = []
    n = 400

    def writer(node: str) -> None:
        try:
            for i in range(n):
                h.add_report(node, T0 + i, report(i * 10, i * 5, waiting=i))
                h.add_gateway(T0 + i, gw({node: i * 2}))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(100):
                for node in h.nodes():
                    s = h.series(node, now=T0 + n)
                    assert len({len(v) for v in s.values()}) == 1
                    h.rates(node, now=T0 + n)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"n{k}",)) for k in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(4):
        s = h.series(f"n{k}", now=T0 + n)
        assert s["waiting"] == list(range(n))
        assert s["prefix_hit_ratio"][1:] == [pytest.approx(0.5)] * (n - 1)
        assert h.rates(f"n{k}", now=T0 + n, over_s=100)["req_s"] == pytest.approx(2.0)


def test_tenant_totals_are_the_windows_increases() -> None:
    h = History(window_s=900)
    snap = lambda req, lim: {"ok": True, "requests": {}, "errors": {}, "tenant_requests": req, "ratelimited": lim}
    h.add_gateway(T0, snap({"a": 100}, {}))                  # before this plane looked: not counted
    h.add_gateway(T0 + 1, snap({"a": 103, "b": 2}, {"b": 5}))  # b appears with its first requests
    h.add_gateway(T0 + 2, snap({"a": 1, "b": 4}, {"b": 6}))    # a's gateway restarted: from 0
    assert h.tenant_totals(now=T0 + 3) == {"a": {"requests": 4, "ratelimited": 0},
                                           "b": {"requests": 4, "ratelimited": 6}}
    assert h.tenant_totals(now=T0 + 2000) == {"a": {"requests": 0, "ratelimited": 0},
                                              "b": {"requests": 0, "ratelimited": 0}}
