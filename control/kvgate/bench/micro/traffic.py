"""Benchmark of the request-log analysis: :func:`~kvgate.web.admin.traffic.traffic_view` (the
whole window on every call) against :class:`~kvgate.web.admin.traffic.TrafficTracker` (the
window once, then only the new entries).

``python -m kvgate.bench.micro.traffic [--entries 50000] [--keys 5000] [--step 1000]``
starts a private ``redis-server`` (a free port, a temporary directory, no persistence),
fills ``kvgate:log`` with synthetic entries of one pool of 4 nodes (the shape
``lua/kvgate/reqlog.lua`` writes; route keys drawn with a Zipf-like skew, 90 % served at
home, some failovers and cache hits, spread over the last 14 minutes), and prints, best of
3 (wall and this process's CPU time, in ms):

* a full ``traffic_view`` (900 s window, up to 50,000 entries);
* a tracker's first ``update`` (the backfill of the window);
* an incremental ``update`` after ``--step`` new entries;
* ``view()`` (no Redis);

and the tracker's memory (``tracemalloc``: what its state holds after the backfill, and
the peak during it), with a worst case: ``--worst`` entries each with a new key, more than
the key cap per bucket.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

import redis

from ...policy.loader import parse_policy
from ...policy.model import Policy
from ...web.admin.traffic import STREAM, TrafficTracker, traffic_view

NODES = 4
WINDOW_S = 900.0
SPAN_S = 840.0


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_redis() -> Iterator[redis.Redis]:
    """A throw-away redis-server on a free port of 127.0.0.1, in a temporary directory."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (the benchmark starts its own)")
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as d:
        port = _free_port()
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port, socket_timeout=30, decode_responses=True)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"redis-server did not start on port {port}")
                    time.sleep(0.05)
            yield client
        finally:
            proc.terminate()
            proc.wait(10)


def bench_policy() -> Policy:
    return parse_policy({"version": 1, "pools": [{"name": "bench", "models": ["m"], "nodes": [
        {"id": f"n{i}", "url": f"http://127.0.0.1:{19001 + i}"} for i in range(NODES)]}]})


class Filler:
    """Synthetic request-log entries, written in pipelines of 1000."""

    def __init__(self, policy: Policy, keys: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.nodes = [n.id for n in policy.pools[0].nodes]
        self.keys = []
        for i in range(keys):
            route_key = f"s:bench-{i}"
            point = zlib.crc32(route_key.encode())  # the gateway's point (ngx.crc32_long)
            # the home the gateway would log: any fixed node per key does for the figures' cost
            self.keys.append((f"{point:016x}", str(point), self.nodes[point % NODES]))
        # Zipf-like popularity: key i drawn with weight 1 / (i + 1)
        self.cum = []
        total = 0.0
        for i in range(keys):
            total += 1.0 / (i + 1)
            self.cum.append(total)
        self.distinct = 0

    def fields(self, ts: float, distinct: bool = False) -> dict[str, str]:
        rng = self.rng
        if distinct:
            self.distinct += 1
            route_key = f"s:distinct-{self.distinct}"
            point = zlib.crc32(route_key.encode())
            key, point_s, home = f"{point:016x}", str(point), self.nodes[point % NODES]
        else:
            i = min(len(self.cum) - 1, self._pick(rng.random() * self.cum[-1]))
            key, point_s, home = self.keys[i]
        x = rng.random()
        node, cache, tries, status = home, "BYPASS", "1", "200"
        if x < 0.10:
            node, cache, tries = "cache", "HIT", "0"
        elif x < 0.15:
            node, tries = self.nodes[(self.nodes.index(home) + 1) % NODES], "2"  # failed over
        elif x < 0.16:
            node, status, tries = "", "502", "2"
        return {"ts": f"{ts:.3f}", "pool": "bench", "node": node, "status": status, "cache": cache,
                "kind": "session", "fp": "", "key": key, "ms": "120", "point": point_s, "tries": tries,
                "home": "" if cache == "HIT" else home}

    def _pick(self, v: float) -> int:
        lo, hi = 0, len(self.cum)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cum[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def fill(self, r: redis.Redis, n: int, t0: float, t1: float, distinct: bool = False) -> None:
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd(STREAM, self.fields(t0 + (t1 - t0) * i / max(1, n - 1), distinct))
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()


def best_of(n: int, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(best wall ms, best CPU ms of this process) of ``n`` runs of ``fn`` (after ``setup``)."""
    wall, cpu = [], []
    for _ in range(n):
        if setup is not None:
            setup()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append((time.process_time() - c0) * 1000)
        wall.append((time.perf_counter() - w0) * 1000)
    return min(wall), min(cpu)


def memory(fn: Callable[[], TrafficTracker]) -> tuple[int, int]:
    """(bytes the returned tracker's state holds, peak bytes while ``fn`` ran)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        tracker = fn()
        current, peak = tracemalloc.get_traced_memory()
        del tracker
        after, _ = tracemalloc.get_traced_memory()
        return current - after, peak
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.bench.micro.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=50000)
    ap.add_argument("--keys", type=int, default=5000)
    ap.add_argument("--step", type=int, default=1000, help="new entries before the incremental update")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worst", type=int, default=100000,
                    help="entries of the worst case (each a new key; read without a backfill limit)")
    args = ap.parse_args(argv)
    policy = bench_policy()
    filler = Filler(policy, args.keys)
    rows: list[tuple[str, float, float, str]] = []

    with private_redis() as r:
        now = time.time()
        t0 = time.perf_counter()
        filler.fill(r, args.entries, now - SPAN_S, now)
        print(f"filled {args.entries} entries ({args.keys} keys, {NODES} nodes) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

        full = traffic_view(r, policy, window_s=WINDOW_S)
        rows.append(("traffic_view (full window)", *best_of(args.runs, lambda: traffic_view(
            r, policy, window_s=WINDOW_S)), f"{full[0]['requests']} entries"))

        def backfilled() -> TrafficTracker:
            t = TrafficTracker(window_s=WINDOW_S)
            t.update(r, policy)
            return t

        holder: dict[str, TrafficTracker] = {}
        rows.append(("tracker.update() first: backfill", *best_of(
            args.runs, lambda: holder.__setitem__("t", backfilled())), f"{holder['t'].stats()['entries_read']} read"))
        tracker = holder["t"]
        got = tracker.view(policy)
        assert got[0]["requests"] == full[0]["requests"] and got[0]["at_home"] == full[0]["at_home"], (got, full)

        def more() -> None:
            t = time.time()
            filler.fill(r, args.step, t - 1, t)

        before = tracker.stats()["entries_read"]
        rows.append((f"tracker.update() after {args.step} new", *best_of(
            args.runs, lambda: tracker.update(r, policy), setup=more),
            f"{(tracker.stats()['entries_read'] - before) // args.runs} read per update"))
        rows.append(("tracker.view()", *best_of(args.runs, lambda: tracker.view(policy)), "no Redis"))
        check = traffic_view(r, policy, window_s=WINDOW_S, max_entries=10 ** 7)[0]
        mine = tracker.view(policy)[0]
        same = all(mine[k] == check[k] for k in ("requests", "cache", "routed", "at_home", "failovers", "errors"))

        print(f"{'':38} {'wall ms':>9} {'CPU ms':>9}")
        for name, wall, cpu, note in rows:
            print(f"{name:38} {wall:9.1f} {cpu:9.1f}   {note}")
        print(f"incremental view equals a fresh traffic_view: {same}")

        held, peak = memory(backfilled)
        s = backfilled().stats()
        print(f"tracker memory after the backfill: {held / 1e6:.2f} MB held, {peak / 1e6:.2f} MB peak during it "
              f"({s['buckets']} buckets, {s['bucket_keys']} key records in buckets, {s['window_keys']} in the "
              f"window sum)")

        # worst case: every entry a new key, more than the cap per bucket
        r.delete(STREAM)
        now = time.time()
        filler.fill(r, args.worst, now - SPAN_S, now, distinct=True)

        def unbounded() -> TrafficTracker:
            t = TrafficTracker(window_s=WINDOW_S, max_backfill=10 ** 7)
            t.update(r, policy)
            return t

        held, peak = memory(unbounded)
        s = unbounded().stats()
        records = s["bucket_keys"] + s["window_keys"]
        per = held / max(1, records)
        slots = (int(WINDOW_S / tracker.bucket_s) + 1) * tracker.max_keys
        print(f"worst case, {args.worst} distinct keys in {SPAN_S:.0f} s: {held / 1e6:.2f} MB held, "
              f"{peak / 1e6:.2f} MB peak ({s['buckets']} buckets capped at {tracker.max_keys} keys: "
              f"{s['bucket_keys']} + {s['window_keys']} key records, {per:.0f} B each; "
              f"{s['folded']} requests folded); bound for a full window: {slots} keys per pool, "
              f"{2 * slots * per / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
