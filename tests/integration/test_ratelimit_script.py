"""kvgate.limits' Redis scripts (ADMIT, SETTLE) on a real Redis with a fake clock (issue 12
acceptance "Windows and TTLs"): the text is read from lua/kvgate/limits.lua, so the gateway
runs exactly what is tested here."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import pytest
import redis as redis_lib

from gwfixtures import _start_redis

pytestmark = pytest.mark.integration

SRC = (Path(__file__).resolve().parents[2] / "lua/kvgate/limits.lua").read_text()
ADMIT = re.search(r"_M\.ADMIT = \[\[\n(.*?)\]\]", SRC, re.S).group(1)
SETTLE = re.search(r"_M\.SETTLE = \[\[\n(.*?)\]\]", SRC, re.S).group(1)
MIN = 60_000


@pytest.fixture(scope="module")
def r(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_lib.Redis]:
    server = _start_redis(tmp_path_factory.mktemp("rl"))
    try:
        yield redis_lib.Redis(port=server.port, decode_responses=True)
    finally:
        server.stop()


def ms(day: int, hh: int, mm: int, ss: float = 0) -> int:
    return int(datetime(2026, 12, day, hh, mm, tzinfo=timezone.utc).timestamp() * 1000 + ss * 1000)


def admit(r, now: int, *buckets: tuple[str, str, int, int, object]) -> list[int]:
    """buckets: (key, kind, cap, window ms, cost or member)"""
    argv: list[object] = [now]
    for _, kind, cap, win, cost in buckets:
        argv += [kind, cap, win, cost]
    return r.eval(ADMIT, len(buckets), *[b[0] for b in buckets], *argv)


def ttls_ok(r, window_ms: int) -> None:
    for k in r.scan_iter("kvgate:rl:*"):
        ttl = r.pttl(k)
        assert 0 < ttl <= 2 * window_ms, (k, ttl)


def test_the_same_minute_of_another_day_starts_full(r) -> None:
    r.flushdb()
    tpm = ("kvgate:rl:t:tpm", "b", 1000, MIN)
    assert admit(r, ms(1, 10, 37), (*tpm, 900))[0] == 1
    assert admit(r, ms(1, 10, 37, 1), (*tpm, 200))[0] == 0  # 100 left + 1 s of refill < 200
    ttls_ok(r, MIN)
    assert admit(r, ms(2, 10, 37), (*tpm, 200)) == [1, 800]


def test_refill_is_continuous_and_a_refusal_says_when(r) -> None:
    r.flushdb()
    rpm = ("kvgate:rl:t:rpm", "b", 60, MIN, 1)
    t0 = ms(1, 12, 0)
    assert [admit(r, t0, rpm)[0] for _ in range(61)] == [1] * 60 + [0]
    assert admit(r, t0, rpm) == [0, 1, 1000, 0]  # one request per second: retry in 1 s
    assert admit(r, t0 + 1000, rpm)[0] == 1
    assert r.hget("kvgate:rl:t:rpm", "n") == "61"
    ttls_ok(r, MIN)


def test_all_or_nothing(r) -> None:
    r.flushdb()
    now = ms(1, 12, 0)
    rpm, tpm = ("kvgate:rl:t:rpm", "b", 100, MIN, 1), ("kvgate:rl:t:tpm", "b", 50, MIN, 40)
    assert admit(r, now, rpm, tpm)[0] == 1
    out = admit(r, now, rpm, tpm)  # tpm refuses (10 left): rpm must not be taken either
    assert out[:2] == [0, 2]
    assert float(r.hget("kvgate:rl:t:rpm", "t")) == 99 and r.hget("kvgate:rl:t:rpm", "n") == "1"


def test_a_failing_bucket_leaves_no_key_without_a_ttl(r) -> None:
    r.flushdb()
    r.set("kvgate:rl:t:tpm", "not a hash")  # a Redis error in the middle of the script
    with pytest.raises(redis_lib.ResponseError):
        admit(r, ms(1, 9, 0), ("kvgate:rl:t:rpm", "b", 10, MIN, 1), ("kvgate:rl:t:tpm", "b", 10, MIN, 1))
    assert not r.exists("kvgate:rl:t:rpm")
    r.delete("kvgate:rl:t:tpm")
    admit(r, ms(1, 9, 0), ("kvgate:rl:t:rpm", "b", 10, MIN, 1))
    ttls_ok(r, MIN)


def test_concurrency_slots_are_members_with_an_expiry(r) -> None:
    r.flushdb()
    now = ms(1, 8, 0)
    conc = ("kvgate:rl:t:concurrency", "c", 2, 600_000)
    assert admit(r, now, (*conc, "a"))[0] == 1
    assert admit(r, now, (*conc, "b"))[0] == 1
    assert admit(r, now, (*conc, "c"))[0] == 0
    r.zrem("kvgate:rl:t:concurrency", "a")  # what the settlement does
    assert admit(r, now, (*conc, "c"))[0] == 1
    # a slot whose gateway died frees when it expires
    assert admit(r, now + 600_001, (*conc, "d"))[0] == 1
    ttls_ok(r, 600_000)


def test_settle_gives_back_or_takes_more_and_never_overfills(r) -> None:
    r.flushdb()
    now = ms(1, 7, 0)
    key = "kvgate:rl:t:tpm"
    admit(r, now, (key, "b", 1000, MIN, 600))
    assert r.eval(SETTLE, 1, key, now, 1000, MIN, 450) == 850   # reserved 600, used 150
    assert r.eval(SETTLE, 1, key, now, 1000, MIN, -300) == 550  # used 300 more than reserved
    assert r.eval(SETTLE, 1, key, now, 1000, MIN, 10_000) == 1000  # never above the cap
    r.delete(key)
    assert r.eval(SETTLE, 1, key, now, 1000, MIN, 50) == 1000 and not r.exists(key)  # full: nothing to do
    ttls_ok(r, MIN)


def test_a_gateway_whose_clock_is_behind_refills_nothing(r) -> None:
    """Two gateways 2 s apart alternating on one bucket: still the bucket's rate (review
    finding: a ts moved back let the clock that is ahead refill the gap on every request)."""
    r.flushdb()
    rpm = ("kvgate:rl:t:rpm", "b", 60, MIN, 1)
    t0 = ms(1, 12, 0)
    admitted = 0
    for step in range(6000):  # 60 s, a request every 10 ms, gateways alternating
        now = t0 + step * 10 + (2000 if step % 2 else 0)
        admitted += admit(r, now, rpm)[0]
    assert 118 <= admitted <= 124, admitted  # the 60 of the burst + 60 a minute


def test_settle_of_a_large_excess_stays_within_bounds(r) -> None:
    r.flushdb()
    now = ms(1, 6, 0)
    key = "kvgate:rl:t:tpm"
    admit(r, now, (key, "b", 1000, MIN, 400))
    assert r.eval(SETTLE, 1, key, now, 1000, MIN, -5000) == -1000  # at most one window of debt
    assert 0 < r.pttl(key) <= 2 * MIN
