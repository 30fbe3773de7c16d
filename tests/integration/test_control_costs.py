"""Usage rollups and the cost report against real Redis (issue 13): the consumer group counts every
request-log entry exactly once — across a consumer killed between reading a batch and applying
it, a connection cut mid-batch, Redis down — and the report, the API and ``kvgate costs`` show
the sums, on a real stack with requests through the gateway."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
import requests

from ctlfixtures import MODEL, control_fleet, wait_until  # noqa: F401 - fixture
from gwfixtures import RedisServer, _start_redis, free_port
from kvgate import keys
from kvgate.costs.report import build_report
from kvgate.costs.rollup import FIELDS, GROUP, HOURS, STREAM, UsageConsumer, bucket_key
from kvgate.policy.loader import parse_policy_text

pytestmark = pytest.mark.integration

HOUR = int(time.time()) // 3600 * 3600
POLICY = parse_policy_text("""
version: 1
pools:
  - name: p
    models: [m]
    prefix_index: {chunk_chars: 2048, chars_per_token: 4}
    nodes:
      - {id: n1, url: "http://127.0.0.1:9001", simulate: true}
      - {id: n2, url: "http://127.0.0.1:9002", simulate: true}
usage: {retention_days: 2}
""")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _start_redis(tmp_path_factory.mktemp("costs"))
    yield server
    server.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> redis.Redis:
    c = redis.Redis.from_url(redis_server.url, decode_responses=True)
    c.flushdb()
    return c


def entry(i: int) -> dict[str, str]:
    """A log entry with the issue-13 fields: 3 tenants, every 7th a HIT, every 5th a 502 retried."""
    hit, bad = i % 7 == 0, i % 5 == 0 and i % 7
    return {"ts": f"{HOUR + i % 3000:.3f}", "pool": "p", "node": "cache" if hit else f"n{i % 2 + 1}",
            "status": "502" if bad else "200", "cache": "HIT" if hit else "MISS", "kind": "prefix", "fp": "",
            "key": "", "ms": "12", "point": "", "tries": "2" if bad else ("0" if hit else "1"), "home": "",
            "spill": "", "tenant": f"t{i % 3}", "key_id": f"k{i % 3}", "model": MODEL, "prompt": str(100 + i),
            "cached": "0" if hit else str(16 * (i % 4)), "completion": str(i % 9), "ttft": str(10 + i % 50),
            "batch": "", "blocks": ("%016x" % (i % 4)) + ("%016x" % i), "cost": "0" if hit else str(1000 + i),
            "saved_cache": str(500 + i) if hit else "0", "saved_prefix": "0" if hit else str(3 * (i % 4)),
            "saved_batch": "0"}


def xadd(r: redis.Redis, entries: list[dict[str, str]]) -> None:
    pipe = r.pipeline(transaction=False)
    for e in entries:
        pipe.xadd(STREAM, e)
    pipe.execute()


def expected(entries: list[dict[str, str]]) -> dict[str, int]:
    """Independent sums of the entries (not kvgate.costs.rollup.aggregate)."""
    hit = [e for e in entries if e["cache"] == "HIT"]
    miss = [e for e in entries if e["cache"] != "HIT"]
    return {"requests": len(entries), "hits": len(hit), "ok": sum(e["status"] == "200" for e in entries),
            "failed": sum(e["status"] == "502" for e in entries), "retried": sum(e["tries"] == "2" for e in entries),
            "prompt": sum(int(e["prompt"]) for e in miss), "cached": sum(int(e["cached"]) for e in miss),
            "completion": sum(int(e["completion"]) for e in miss),
            "avoided_prompt": sum(int(e["prompt"]) for e in hit),
            "avoided_completion": sum(int(e["completion"]) for e in hit),
            "cost": sum(int(e["cost"]) for e in entries),
            "cost_ok": sum(int(e["cost"]) for e in entries if e["status"] == "200"),
            "saved_cache": sum(int(e["saved_cache"]) for e in entries),
            "saved_prefix": sum(int(e["saved_prefix"]) for e in entries),
            "ttft_ms_sum": sum(int(e["ttft"]) for e in entries), "ttft_n": len(entries)}


def sums(r: redis.Redis) -> dict[str, int]:
    out = dict.fromkeys(FIELDS, 0)
    for key in r.zrange(HOURS, 0, -1):
        for f, v in r.hgetall(key).items():
            out[f] += int(v)
    return out


def state():
    return POLICY, {"p": 2}


def consumer(url: str, **kw) -> UsageConsumer:
    return UsageConsumer(url, state, batch=kw.pop("batch", 50), block_ms=kw.pop("block_ms", 100), **kw)


def test_every_entry_once_and_entries_before_the_group_count(r: redis.Redis, redis_server: RedisServer) -> None:
    entries = [entry(i) for i in range(300)]
    xadd(r, entries[:120])  # logged before the consumer group exists: counted too (group created at 0)
    c = consumer(redis_server.url)
    assert c.drain() == 120
    xadd(r, entries[120:])
    assert c.drain() == 180
    got = sums(r)
    assert {k: got[k] for k in expected(entries)} == expected(entries)
    assert got["unpriced"] == 0 and got["unknown_usage"] == 0
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    # the buckets: 3 tenants × 1 model × 1 pool × 1 hour, listed with their hour, with the retention TTL
    names = r.zrange(HOURS, 0, -1, withscores=True)
    assert sorted(names) == sorted((bucket_key(HOUR, f"t{t}", MODEL, "p"), float(HOUR)) for t in range(3))
    for key, _ in names:
        assert 2 * 86400 - 60 < r.ttl(key) <= 2 * 86400
    assert 2 * 86400 - 60 < r.ttl(HOURS) <= 2 * 86400
    # the round-robin baseline saw the 2 × 2 shared first blocks: some cached tokens, never above the prompt
    assert 0 < got["rr_cached"] <= got["prompt"]
    # a second consumer of the same group finds nothing to count again
    assert consumer(redis_server.url).drain() == 0
    assert sums(r) == got


def test_a_consumer_killed_between_read_and_apply_loses_and_repeats_nothing(r: redis.Redis,
                                                                            redis_server: RedisServer,
                                                                            tmp_path: Path) -> None:
    entries = [entry(i) for i in range(200)]
    xadd(r, entries)
    first = consumer(redis_server.url)
    first.step()  # one batch of 50 applied
    # a real process reads the next batch and is killed (SIGKILL) before it applies it
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_control_costs import consumer
        c = consumer({redis_server.url!r})
        print(len(c.read()), flush=True)
        time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "50"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert r.xpending(STREAM, GROUP)["pending"] == 50
    assert sums(r)["requests"] == 50
    # the control plane starts again: its consumer reads its own pending batch first, then the rest
    again = consumer(redis_server.url)
    assert again.drain() == 150
    got = sums(r)
    assert {k: got[k] for k in expected(entries)} == expected(entries)
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_a_connection_cut_between_read_and_apply_counts_the_batch_once(r: redis.Redis,
                                                                       redis_server: RedisServer) -> None:
    entries = [entry(i) for i in range(100)]
    xadd(r, entries)
    c = consumer(redis_server.url)
    batch = c.read()
    assert len(batch) == 50
    r.client_kill_filter(_type="normal", skipme=True)  # every connection but this one: the consumer's
    try:
        c.apply(batch)
    except redis.ConnectionError:
        c._pending = True  # what step() does
    c.drain()
    got = sums(r)
    assert {k: got[k] for k in expected(entries)} == expected(entries)


def test_entries_without_the_usage_fields_count_as_requests_with_unknown_usage(r: redis.Redis,
                                                                              redis_server: RedisServer) -> None:
    old = {f: "" for f in keys.LOG_FIELDS[:14]}
    old.update({"ts": f"{HOUR + 1:.3f}", "pool": "p", "node": "n1", "status": "200", "cache": "MISS", "tries": "1"})
    xadd(r, [old, old])
    consumer(redis_server.url).drain()
    b = r.hgetall(bucket_key(HOUR, "none", "none", "p"))
    assert b == {"requests": "2", "ok": "2", "unpriced": "2", "unknown_usage": "2"}


def test_redis_down_the_thread_retries_and_counts_once_back(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.costs")
    port = free_port()
    c = UsageConsumer(f"redis://127.0.0.1:{port}/0", state, block_ms=100)
    c.start()
    try:
        time.sleep(1.0)  # a few failed tries with back-off; the thread stays up
        assert c._thread is not None and c._thread.is_alive()
        downs = [m for m in caplog.messages if "Redis failed" in m]
        assert len(downs) == 1, caplog.messages  # logged once, not once per try
        server = _start_redis_on(tmp_path, port)
        try:
            rr = redis.Redis(port=port, decode_responses=True)
            entries = [entry(i) for i in range(30)]
            xadd(rr, entries)
            wait_until(lambda: c.applied == 30, "the consumer to apply the entries after Redis came back", 30)
            assert sums(rr)["requests"] == 30
            assert any("Redis is back" in m for m in caplog.messages)
        finally:
            server.stop()
    finally:
        c.stop()
    assert c._thread is not None and not c._thread.is_alive()


def _start_redis_on(base: Path, port: int) -> RedisServer:
    d = base / "redis-late"
    d.mkdir()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    server = RedisServer(port, proc, d)
    wait_until(lambda: _pings(port), "redis-server to answer", 10)
    return server


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port).ping())
    except redis.RedisError:
        return False


def test_report_from_real_rollups(r: redis.Redis, redis_server: RedisServer) -> None:
    entries = [entry(i) for i in range(90)]
    xadd(r, entries)
    consumer(redis_server.url).drain()
    rep = build_report(r, "tenant", 3600, now=HOUR + 3599)
    assert rep["since"] == HOUR - 3600 and rep["by"] == "tenant"
    assert {row["key"] for row in rep["rows"]} == {"t0", "t1", "t2"}
    want = expected(entries)
    t = rep["total"]
    assert t["requests"] == want["requests"] and t["prompt"] == want["prompt"]
    assert t["cost_usd"] == want["cost"] / 1e9 and t["saved_usd"]["cache"] == want["saved_cache"] / 1e9
    assert t["cost_per_ok_usd"] == pytest.approx(want["cost"] / 1e9 / want["ok"])
    assert sum(row["requests"] for row in rep["rows"]) == want["requests"]
    assert rep["series"][0]["hour"] == HOUR


# ---------------------------------------------------------------- the whole stack
def test_costs_api_and_cli_on_a_running_stack(control_fleet) -> None:  # noqa: F811 - fixture
    fleet = control_fleet(n=2)
    usage = []
    for i in range(3):
        resp = requests.post(fleet.gateway + "/v1/chat/completions", timeout=30, headers={"Cache-Control": "no-store"},
                             json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": f"q{i}"}]})
        assert resp.status_code == 200, resp.text
        usage.append(resp.json()["usage"])
    rr = redis.Redis(port=fleet.redis_port, decode_responses=True)
    wait_until(lambda: rr.xlen(STREAM) >= 3, "the gateway's log entries", 10)
    entries = [{**entry(i), "tenant": "team-x", "ts": f"{time.time():.3f}"} for i in range(40)]
    xadd(rr, entries)

    def caught_up() -> bool:
        info = {g["name"]: g for g in rr.xinfo_groups(STREAM)}.get(GROUP)
        return bool(info) and info["pending"] == 0 and info["last-delivered-id"] == rr.xinfo_stream(STREAM)["last-generated-id"]

    wait_until(caught_up, "the control plane's consumer to acknowledge every entry", 30)
    rep = fleet.api("GET", "/api/v1/costs", params={"by": "tenant", "since": "1h"}).json()
    rows = {row["key"]: row for row in rep["rows"]}
    assert set(rows) == {"team-x", "none"}, rep["rows"]
    want = expected(entries)
    assert rows["team-x"]["requests"] == 40 and rows["team-x"]["prompt"] == want["prompt"]
    assert rows["team-x"]["cost_usd"] == want["cost"] / 1e9
    # the gateway's own entries (no tenant: auth off): the engines' prompt tokens, exactly
    assert rows["none"]["requests"] == 3 and rows["none"]["prompt"] == sum(u["prompt_tokens"] for u in usage)
    assert rows["none"]["completion"] == sum(u["completion_tokens"] for u in usage)
    # kvgate costs --json prints the same object
    out = fleet.kvgate("costs", "--json", "--since", "1h", "--control-url", fleet.control, "--token", fleet.token)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    assert cli["rows"] == rep["rows"] and cli["total"] == rep["total"]
    csv_out = fleet.kvgate("costs", "--csv", "--by", "model", "--control-url", fleet.control, "--token", fleet.token)
    assert csv_out.returncode == 0 and csv_out.stdout.splitlines()[0].startswith("key,requests,ok,")
    assert csv_out.stdout.splitlines()[-1].startswith("total,43,")
    table = fleet.kvgate("costs", "--control-url", fleet.control, "--token", fleet.token)
    assert table.returncode == 0 and "team-x" in table.stdout and "total" in table.stdout
    # bad arguments: 400 in OpenAI's error shape
    for params in ({"by": "node"}, {"since": "yesterday"}):
        bad = fleet.api("GET", "/api/v1/costs", params=params)
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["code"] == "bad_request"
    cli_bad = fleet.kvgate("costs", "--since", "yesterday", "--control-url", fleet.control, "--token", fleet.token)
    assert cli_bad.returncode == 2 and "since must be a duration" in cli_bad.stderr


def test_pending_entries_trimmed_from_the_stream_are_acknowledged_not_counted(r: redis.Redis,
                                                                              redis_server: RedisServer) -> None:
    xadd(r, [entry(i) for i in range(10)])
    assert len(consumer(redis_server.url).read()) == 10  # read, never applied
    r.xtrim(STREAM, maxlen=0, approximate=False)  # the gateway's MAXLEN trimmed them meanwhile
    assert consumer(redis_server.url).drain() == 10
    assert r.xpending(STREAM, GROUP)["pending"] == 0 and sums(r)["requests"] == 0


def test_a_lost_group_is_made_again_after_the_last_applied_entry(r: redis.Redis, redis_server: RedisServer) -> None:
    xadd(r, [entry(i) for i in range(20)])
    consumer(redis_server.url).drain()
    r.xgroup_destroy(STREAM, GROUP)  # by hand; the rollups stay
    xadd(r, [entry(i) for i in range(20, 25)])
    assert consumer(redis_server.url).drain() == 5  # the 5 new ones, not the 20 again
    assert sums(r)["requests"] == 25


def test_two_consumers_of_one_name_at_once_count_each_entry_once(r: redis.Redis, redis_server: RedisServer) -> None:
    # an old control plane still stopping while the new one starts: both read the same pending batch
    xadd(r, [entry(i) for i in range(400)])
    assert len(consumer(redis_server.url).read()) == 50  # left pending by a killed one
    a, b = consumer(redis_server.url), consumer(redis_server.url)
    done: list[int] = []
    threads = [threading.Thread(target=lambda c=c: done.append(c.drain())) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(done) >= 400
    got = sums(r)
    want = expected([entry(i) for i in range(400)])
    assert {k: got[k] for k in want} == want
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_the_hour_index_forgets_buckets_past_their_retention(r: redis.Redis, redis_server: RedisServer) -> None:
    old = bucket_key(3600 * 10, "t0", MODEL, "p")  # an hour of 1970: long past any retention
    r.zadd(HOURS, {old: 3600 * 10})
    xadd(r, [entry(0)])
    assert consumer(redis_server.url).drain() == 1
    members = r.zrange(HOURS, 0, -1)
    assert old not in members and len(members) == 1, members
