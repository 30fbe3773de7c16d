"""The batch worker (``kvgate batch-worker``): runs the lines of open batches through the
gateway, prefix-grouped, on spare capacity (issue 14, Build 4).

One loop per worker process (:meth:`Runner.run`, asyncio), several workers may run against
one Redis. Every round (``batch.poll_interval_s``, or sooner when a line finishes) it reads
``kvgate:batch:open`` (earliest ``expires_at`` first) and for each batch:

* ``validating`` → one worker takes the batch's plan lock, validates the input file
  (:mod:`kvgate.batch.validate`; a bad file → ``failed`` with ``errors``, no line is sent),
  builds the schedule (:mod:`kvgate.batch.schedule`) into the batch's run keys and moves it to
  ``in_progress``;
* ``in_progress`` → lines are claimed and sent; when every line has a result the batch is
  finalized (``finalizing`` → ``completed``); at ``expires_at`` it is finalized ``expired``
  (unfinished lines → ``batch_expired`` in the error file);
* ``cancelling`` → no line is claimed any more; once the lines in flight are answered (or their
  leases ran out) it is finalized ``cancelled`` with the partial output;
* ``finalizing`` left by a worker that died → finalized again (same file ids: the files are
  rewritten atomically, never duplicated).

**Run keys** (``kvgate:batch:run:<batch_id>:``, all given a TTL of :data:`RUN_KEYS_TTL_S` when
the batch ends): ``cid`` hash line → custom_id; ``node`` hash line → schedule node;
``nodes`` set; ``q:<node>`` list of line indices to send (group leaders and single lines, in
schedule order; a leader's answer moves its ``f:<leader>`` followers to the front); ``att``
hash line → attempts (sends); ``res`` hash line → the line's final result (JSON, written once:
``HSETNX``); ``lease`` zset line → lease deadline (ms); ``retry`` zset line → not before (ms);
``closed`` (set when finalizing starts: nothing is recorded after it); ``fin`` hash of the
output/error file ids chosen; ``lock:plan`` / ``lock:fin`` (SET NX EX). Fleet-wide in-flight
counts: zsets ``kvgate:batch:run:inflight`` and ``kvgate:batch:run:inflight:<node>`` (member
``<batch>|<line>``, score = lease deadline: a dead worker's entries age out).

**Exactly once.** Claiming (a Lua script) pops a line only if it has no result and puts it under
a lease; the worker renews its leases every ``lease/3`` s. A worker that dies leaves its leases
to expire: the next claim puts those lines back at the front of their queue (their attempt
counter keeps counting the lost sends). Recording (a Lua script) writes the result only if the
line has none and the batch is not closed, and counts it in the batch's ``completed`` /
``failed`` in the same step; a line with a result is never claimed again, so a succeeded line
is never sent again — not on retry, not after a restart.

**Retries.** 429, 5xx, timeouts and connection errors are retried after ``retry_backoff_s × 2^(n-1)``
up to ``batch.max_attempts`` sends; then (and for any other status) the line's last answer goes
to the error file.

**Spare capacity.** The worker keeps a concurrency limit between 1 and ``batch.max_in_flight``
(AIMD: slow start +1 per success until the first back-off, then +1/limit; halved — at most once
per second — on a 429, a 5xx, a timeout, or an engine reporting more than
``batch.queue_backoff`` waiting requests in ``kvgate:load:<pool>``). A node whose engine queues
above ``queue_backoff`` gets no new line; at most ``batch.max_in_flight_per_node`` lines are
in flight on one node and ``batch.max_in_flight`` in all, counted across every worker.

**Metrics** (the worker's own ``/metrics``, ``--metrics-listen``): ``kvgate_batch_lines_total
{tenant,result}`` (result: ``succeeded``, ``failed``, ``expired``, ``retried``),
``kvgate_batch_lines_in_flight``, ``kvgate_batch_concurrency_limit``,
``kvgate_batch_group_size`` (histogram of the schedule's group sizes, the seed's "average batch
size"), ``kvgate_batch_batches_total{result}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..addr import http_url
from ..keys import NODE_LOAD_FIELDS, node_load_key
from ..policy.model import Policy
from . import records
from .files import FileStore, resolve_data_dir
from .schedule import plan
from .validate import validate_input

log = logging.getLogger("kvgate.batch")

RUN_KEYS_TTL_S = 86400
"""How long a finished batch's run keys are kept (for inspection), seconds."""
LEASE_S = 30.0
"""A claimed line's lease; renewed every third of it while the request runs."""
LOCK_S = 60
"""Plan and finalize locks (a worker that died holding one is replaced after this)."""
GLOBAL = records.PREFIX + "run:inflight"
EXPIRES_GRACE_S = 600
"""The principal stays valid this long past the batch's expiry (contract: expires_at + 600)."""
PRINCIPAL_HEADER = records.PRINCIPAL_HEADER
SWEEP_S = 3600.0
"""How often a worker removes files on disk that Redis no longer knows."""
TRANSIENT = frozenset({408, 409, 425, 429})
"""Statuses retried besides every 5xx (429: limits; 408/425: timing)."""
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}

# ---------------------------------------------------------------------------- Lua
_CLAIM = """
local P, G = KEYS[1], KEYS[2]
local bkey, batch, node = KEYS[3], ARGV[1], ARGV[2]
local now, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_all, max_node = tonumber(ARGV[5]), tonumber(ARGV[6])
local function requeue(line)
  redis.call('ZREM', G, batch .. '|' .. line)
  local n = redis.call('HGET', P .. 'node', line)
  if n then redis.call('ZREM', G .. ':' .. n, batch .. '|' .. line) end
  if redis.call('HEXISTS', P .. 'res', line) == 0 and n then
    redis.call('LPUSH', P .. 'q:' .. n, line)
  end
end
local lost = redis.call('ZRANGEBYSCORE', P .. 'lease', '-inf', now)
for _, line in ipairs(lost) do
  redis.call('ZREM', P .. 'lease', line)
  requeue(line)
end
local due = redis.call('ZRANGEBYSCORE', P .. 'retry', '-inf', now)
for _, line in ipairs(due) do
  redis.call('ZREM', P .. 'retry', line)
  requeue(line)
end
if redis.call('EXISTS', P .. 'closed') == 1 or redis.call('HGET', bkey, 'status') ~= 'in_progress' then
  return {-3, #lost}
end
redis.call('ZREMRANGEBYSCORE', G, '-inf', now)
redis.call('ZREMRANGEBYSCORE', G .. ':' .. node, '-inf', now)
if redis.call('ZCARD', G) >= max_all then return {-1, #lost} end
if redis.call('ZCARD', G .. ':' .. node) >= max_node then return {-2, #lost} end
while true do
  local line = redis.call('LPOP', P .. 'q:' .. node)
  if not line then return {0, #lost} end
  if redis.call('HEXISTS', P .. 'res', line) == 0 and redis.call('ZSCORE', P .. 'lease', line) == false then
    local att = redis.call('HINCRBY', P .. 'att', line, 1)
    redis.call('ZADD', P .. 'lease', now + lease, line)
    redis.call('ZADD', G, now + lease, batch .. '|' .. line)
    redis.call('ZADD', G .. ':' .. node, now + lease, batch .. '|' .. line)
    return {1, #lost, tonumber(line), att}
  end
end
"""

_RENEW = """
local P, G, batch, deadline = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV do
  local line = ARGV[i]
  if redis.call('ZSCORE', P .. 'lease', line) then
    redis.call('ZADD', P .. 'lease', 'XX', deadline, line)
    local m = batch .. '|' .. line
    redis.call('ZADD', G, 'XX', deadline, m)
    local nd = redis.call('HGET', P .. 'node', line)
    if nd then redis.call('ZADD', G .. ':' .. nd, 'XX', deadline, m) end
    n = n + 1
  end
end
return n
"""

# KEYS: run prefix, global, batch hash; ARGV: batch, line, result json, ok(1/0), retry_at ms (or "")
_RECORD = """
local P, G, bkey = KEYS[1], KEYS[2], KEYS[3]
local batch, line, res, ok, retry_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
redis.call('ZREM', P .. 'lease', line)
local m = batch .. '|' .. line
redis.call('ZREM', G, m)
local node = redis.call('HGET', P .. 'node', line)
if node then redis.call('ZREM', G .. ':' .. node, m) end
if redis.call('EXISTS', P .. 'closed') == 1 then return -1 end
if redis.call('HEXISTS', P .. 'res', line) == 1 then return 0 end
if retry_at ~= '' then
  redis.call('ZADD', P .. 'retry', tonumber(retry_at), line)
  return 2
end
redis.call('HSET', P .. 'res', line, res)
redis.call('HINCRBY', bkey, ok == '1' and 'completed' or 'failed', 1)
local f = redis.call('LRANGE', P .. 'f:' .. line, 0, -1)
if #f > 0 and node then
  for i = #f, 1, -1 do redis.call('LPUSH', P .. 'q:' .. node, f[i]) end
  redis.call('DEL', P .. 'f:' .. line)
end
return 1
"""


# ---------------------------------------------------------------------------- metrics
class WorkerMetrics:
    """The worker's metrics on a private registry (served by ``--metrics-listen``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.lines = Counter("kvgate_batch_lines", "Batch lines by tenant and result (succeeded, failed, expired: "
                             "final; retried: a send that will be tried again).", ["tenant", "result"], registry=r)
        self.in_flight = Gauge("kvgate_batch_lines_in_flight", "Batch lines this worker has in flight.", registry=r)
        self.limit = Gauge("kvgate_batch_concurrency_limit", "This worker's adaptive concurrency limit.", registry=r)
        self.group_size = Histogram("kvgate_batch_group_size", "Lines per prefix group of the schedules built "
                                    "(the lines sent back to back to one node).",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=r)
        self.batches = Counter("kvgate_batch_batches", "Batches this worker finished, by final status.",
                               ["result"], registry=r)
        self.rate_limited = Counter("kvgate_batch_rate_limited", "Lines the gateway refused for their tenant's own "
                                    "rate limit (retried after Retry-After, not counted as attempts).",
                                    ["tenant"], registry=r)


# ---------------------------------------------------------------------------- helpers
def rate_limit_wait(status: int, headers: Mapping[str, str], payload: Any) -> float | None:
    """Seconds to wait when the gateway refused a line for the tenant's own rate limit (429
    ``rate_limit_exceeded`` with ``Retry-After``; kvgate.limits), else None. A 429 without
    ``Retry-After`` (a request larger than the bucket: waiting never helps) is None too."""
    if status != 429:
        return None
    code = payload.get("error", {}).get("code") if isinstance(payload, dict) else None
    after = headers.get("Retry-After")
    if code != "rate_limit_exceeded" or after is None:
        return None
    try:
        wait = float(after)
    except ValueError:
        return None
    return min(max(wait, 0.05), 300.0)


def _now_ms() -> int:
    return int(time.time() * 1000)


def data_dir_of(policy: Policy, run_dir: Path) -> Path:
    """The Batch API's data folder (:func:`kvgate.batch.files.resolve_data_dir`, as the control plane's)."""
    return resolve_data_dir(policy.batch.data_dir, run_dir)


@dataclass
class _Batch:
    """A batch this worker knows: its record, lines (from the input file) and nodes."""

    id: str
    rec: dict[str, str]
    nodes: list[str] = field(default_factory=list)
    bodies: dict[int, tuple[str, dict[str, Any]]] | None = None
    """line → (url, body), loaded from the input file when the first line is sent."""
    node_pool: dict[str, str] = field(default_factory=dict)


@dataclass
class Concurrency:
    """AIMD concurrency limit between 1 and ``maximum`` (see the module)."""

    maximum: int
    value: float = 1.0
    slow_start: bool = True
    last_cut: float = 0.0

    def grow(self) -> None:
        self.value = min(float(self.maximum), self.value + (1.0 if self.slow_start else 1.0 / self.value))

    def cut(self, now: float | None = None) -> bool:
        """Halve (at most once a second); True when it did."""
        t = time.monotonic() if now is None else now
        if t - self.last_cut < 1.0:
            return False
        self.last_cut = t
        self.slow_start = False
        self.value = max(1.0, self.value / 2)
        return True

    @property
    def slots(self) -> int:
        return max(1, int(self.value))


class Runner:
    """One batch worker.

    Args:
        policy_loader: returns the policy in force (called every round: a changed policy file
            takes effect without a restart).
        r: Redis client with ``decode_responses=True``.
        files: the file store (input files, output/error files).
        admin_token: the admin token; the gateway's batch-principal secret derives from it.
        worker_id: a name for logs (default: host pid and random hex).
        gateway_url: override of the gateway's client address (default ``policy.gateway.listen``).
        metrics: a :class:`WorkerMetrics` (default: a new one).
        weights: returns node id → home-ring weight (None: the policy's weights).
        lease_s: a claimed line's lease (seconds): how soon a dead worker's lines run again.
    """

    def __init__(self, policy_loader: Callable[[], Policy], r: redis.Redis, files: FileStore, admin_token: str, *,
                 worker_id: str | None = None, gateway_url: str | None = None,
                 metrics: WorkerMetrics | None = None,
                 weights: Callable[[], Mapping[str, int] | None] | None = None, lease_s: float = LEASE_S):
        self.load_policy = policy_loader
        self.policy = policy_loader()
        self.r = r
        self.files = files
        self.secret = records.batch_secret(admin_token)
        self.worker_id = worker_id or f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}"
        self.gateway_url = gateway_url
        self.metrics = metrics or WorkerMetrics()
        self.weights = weights or (lambda: None)
        self.lease_s = float(lease_s)
        self.limit = Concurrency(self.policy.batch.max_in_flight,
                                 value=float(min(self.policy.batch.max_in_flight, max(1, len(self.policy.nodes())))))
        self.batches: dict[str, _Batch] = {}
        self.tasks: dict[tuple[str, int], asyncio.Task] = {}
        self.node_busy: dict[str, int] = {}
        self.tenant_hold: dict[str, float] = {}
        """Tenant → monotonic time before which no new line of theirs starts (their own rate
        limit answered 429 with Retry-After: the batch waits for the bucket, it does not fail)."""
        self._claim = r.register_script(_CLAIM)
        self._renew = r.register_script(_RENEW)
        self._record = r.register_script(_RECORD)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ loop
    def _sweep(self) -> None:
        """Housekeeping, every SWEEP_S: files on disk without a record in Redis (and half-written
        temporaries) older than an hour are removed (FileStore.purge_orphans)."""
        try:
            n = self.files.purge_orphans()
        except (redis.RedisError, OSError) as exc:
            log.warning("file sweep: %s", exc)
            return
        if n:
            log.info("file sweep: removed %d files that Redis no longer knows", n)

    def stop(self) -> None:
        """Ask :meth:`run` to return (lines in flight are abandoned: their leases expire)."""
        self._stop.set()
        self._wake.set()

    async def run(self, *, until_idle: bool = False) -> None:
        """Work until :meth:`stop` (or, ``until_idle``, until no batch is open)."""
        cfg = self.policy.batch
        connector = aiohttp.TCPConnector(limit=max(8, cfg.max_in_flight * 2))
        async with aiohttp.ClientSession(connector=connector) as session:
            self.session = session
            renew = asyncio.create_task(self._renew_loop())
            next_sweep = 0.0
            try:
                while not self._stop.is_set():
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + SWEEP_S
                        self._sweep()
                    try:
                        open_ids = self.round()
                    except redis.RedisError as exc:
                        log.warning("redis: %s (retrying)", exc)
                        open_ids = ["?"]
                    if until_idle and not open_ids and not self.tasks:
                        return
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.policy.batch.poll_interval_s)
                    except asyncio.TimeoutError:
                        pass
            finally:
                renew.cancel()
                for t in list(self.tasks.values()):
                    t.cancel()
                await asyncio.gather(renew, *self.tasks.values(), return_exceptions=True)

    def round(self) -> list[str]:
        """One pass over the open batches; starts sends as tasks of the running event loop.
        Returns the open batch ids. (Redis calls are synchronous: sub-millisecond round trips,
        at most ``max_in_flight`` sends to serve.)"""
        try:
            self.policy = self.load_policy()
        except Exception as exc:  # keep the last good policy
            log.warning("policy: %s (keeping the previous one)", exc)
        self.limit.maximum = self.policy.batch.max_in_flight
        self.metrics.limit.set(self.limit.value)
        ids = self.r.zrange(records.OPEN, 0, -1)
        now = time.time()
        loads = self._loads(now)
        for bid in ids:
            rec = records.load(self.r, bid)
            if rec is None:
                self.r.zrem(records.OPEN, bid)
                continue
            status = rec["status"]
            try:
                if status == records.VALIDATING:
                    self._plan(rec)
                elif status == records.IN_PROGRESS:
                    if now >= int(rec["expires_at"] or 0):
                        self._finalize(rec, records.EXPIRED)
                    elif int(self.r.hlen(records.run_prefix(bid) + "res")) >= int(rec["total"] or 0):
                        if records.transition(self.r, bid, records.FINALIZING, allowed_from=[records.IN_PROGRESS]):
                            rec["status"] = records.FINALIZING
                            self._finalize(rec, records.COMPLETED)
                    else:
                        self._dispatch(rec, loads)
                elif status == records.CANCELLING:
                    # no line is claimed any more (the claim script checks the status); the
                    # lines in flight finish and are recorded, then the batch is finalized
                    if self._in_flight(bid) == 0:
                        self._finalize(rec, records.CANCELLED)
                elif status == records.FINALIZING:
                    self._finalize(rec, records.COMPLETED)
                elif status in records.TERMINAL:
                    self.r.zrem(records.OPEN, bid)
            except redis.RedisError:
                raise
            except Exception:  # one bad batch never stops the worker
                log.exception("batch %s: unexpected error (will retry)", bid)
        return ids

    # ------------------------------------------------------------------ load
    def _loads(self, now: float) -> dict[str, float]:
        """node id → its engine's last reported ``waiting`` (fresh reports only), and
        ``*<pool>`` → the pool's mean."""
        out: dict[str, float] = {}
        wi = NODE_LOAD_FIELDS.index("waiting")
        for pool in self.policy.pools:
            vals = []
            for node, value in (self.r.hgetall(node_load_key(pool.name)) or {}).items():
                parts = value.split()
                try:
                    received, interval = float(parts[0]), float(parts[1])
                    if now - received > 3 * interval or parts[wi] == "-":
                        continue
                    out[node] = float(parts[wi])
                    vals.append(out[node])
                except (ValueError, IndexError):
                    continue
            if vals:
                out["*" + pool.name] = sum(vals) / len(vals)
        return out

    # ------------------------------------------------------------------ plan
    def _plan(self, rec: dict[str, str]) -> None:
        bid = rec["id"]
        P = records.run_prefix(bid)
        if not self.r.set(P + "lock:plan", self.worker_id, nx=True, ex=LOCK_S):
            return
        try:
            try:
                with self.files.open(rec["tenant"], rec["input_file_id"]) as fh:
                    data = fh.read()
            except Exception as exc:  # FileNotFound: deleted or expired meanwhile
                err = {"code": "invalid_file", "message": f"The input file cannot be read: "
                       f"{getattr(exc, 'message', exc)}", "param": "input_file_id", "line": None}
                records.transition(self.r, bid, records.FAILED, allowed_from=[records.VALIDATING],
                                   fields={"errors": [err]})
                self.metrics.batches.labels(records.FAILED).inc()
                return
            v = validate_input(data, endpoint=rec["endpoint"], policy=self.policy, tenant=rec["tenant"])
            if not v.ok:
                records.transition(self.r, bid, records.FAILED, allowed_from=[records.VALIDATING],
                                   fields={"errors": v.errors, "total": v.total})
                self.metrics.batches.labels(records.FAILED).inc()
                log.info("batch %s failed validation: %d errors (first: line %s %s)", bid, len(v.errors),
                         v.errors[0].get("line"), v.errors[0]["code"])
                return
            runnable = [(ln.index, ln.url, ln.body, ln.pool) for ln in v.lines if ln.pool is not None]
            try:
                weights = self.weights()
            except Exception:
                weights = None
            sched = plan(runnable, self.policy, weights)
            for n in sched.sizes:
                self.metrics.group_size.observe(n)
            self._clear_run_keys(bid)
            with self.r.pipeline(transaction=True) as p:
                p.hset(P + "cid", mapping={str(ln.index): ln.custom_id for ln in v.lines})
                for node, groups in sched.queues.items():
                    p.sadd(P + "nodes", node)
                    p.hset(P + "node", mapping={str(i): node for g in groups for i in g.lines})
                    p.rpush(P + "q:" + node, *[g.lines[0] for g in groups])
                    for g in groups:
                        if len(g.lines) > 1:
                            p.rpush(P + f"f:{g.lines[0]}", *g.lines[1:])
                for index, body in v.refused.items():
                    p.hset(P + "res", str(index), json.dumps({"ok": False, "status_code": 404, "request_id": None,
                                                               "body": body}))
                p.hset(records.batch_key(bid), mapping={"completed": 0, "failed": len(v.refused)})
                p.execute()
            for _ in v.refused:
                self.metrics.lines.labels(rec["tenant"], "failed").inc()
            model = next((ln.body.get("model") for ln in v.lines), "")
            if records.transition(self.r, bid, records.IN_PROGRESS, allowed_from=[records.VALIDATING],
                                  fields={"total": v.total, "model": model}):
                log.info("batch %s: %d lines in %d groups on %d nodes (%d refused)", bid, v.total,
                         len(sched.sizes), len(sched.queues), len(v.refused))
        finally:
            self.r.delete(P + "lock:plan")

    def _clear_run_keys(self, bid: str) -> None:
        keys = list(self.r.scan_iter(records.run_prefix(bid) + "*", count=1000))
        keys = [k for k in keys if not k.endswith(":lock:plan")]
        if keys:
            self.r.delete(*keys)

    # ------------------------------------------------------------------ dispatch
    def _in_flight(self, bid: str) -> int:
        """Lines of the batch under a live lease (any worker)."""
        return int(self.r.zcount(records.run_prefix(bid) + "lease", _now_ms(), "+inf"))

    def _dispatch(self, rec: dict[str, str], loads: Mapping[str, float]) -> None:
        bid = rec["id"]
        if self.tenant_hold.get(rec["tenant"], 0.0) > time.monotonic():
            return  # the tenant's rate limit is spent: its lines wait for the bucket
        b = self.batches.get(bid)
        if b is None:
            b = self.batches[bid] = _Batch(bid, rec, nodes=sorted(self.r.smembers(records.run_prefix(bid) + "nodes")))
        b.rec = rec
        cfg = self.policy.batch
        P = records.run_prefix(bid)
        busy_nodes: set[str] = set()
        for node in b.nodes:
            if loads.get(node, 0.0) > cfg.queue_backoff:
                busy_nodes.add(node)
        if busy_nodes and self.limit.cut():
            log.info("engines queueing (%s): batch concurrency %.1f", ",".join(sorted(busy_nodes)), self.limit.value)
        empty: set[str] = set(busy_nodes)
        while len(self.tasks) < self.limit.slots and len(empty) < len(b.nodes):
            for node in b.nodes:
                if node in empty or len(self.tasks) >= self.limit.slots:
                    continue
                if self.node_busy.get(node, 0) >= cfg.max_in_flight_per_node:
                    empty.add(node)
                    continue
                res = self._claim(keys=[P, GLOBAL, records.batch_key(bid)],
                                  args=[bid, node, _now_ms(), int(self.lease_s * 1000), cfg.max_in_flight,
                                        cfg.max_in_flight_per_node])
                code = int(res[0])
                if int(res[1]):
                    log.info("batch %s: %d lines back from expired leases", bid, int(res[1]))
                if code == 1:
                    line, attempt = int(res[2]), int(res[3])
                    self._start(b, node, line, attempt)
                elif code in (-1, -3):
                    return
                else:
                    empty.add(node)

    def _start(self, b: _Batch, node: str, line: int, attempt: int) -> None:
        self.node_busy[node] = self.node_busy.get(node, 0) + 1
        self.metrics.in_flight.inc()
        key = (b.id, line)
        task = asyncio.get_running_loop().create_task(self._send(b, node, line, attempt))
        self.tasks[key] = task
        task.add_done_callback(lambda _t: self._done(key, node))

    # ------------------------------------------------------------------ sending
    def _bodies(self, b: _Batch) -> dict[int, tuple[str, dict[str, Any]]]:
        if b.bodies is None:
            with self.files.open(b.rec["tenant"], b.rec["input_file_id"]) as fh:
                data = fh.read()
            out: dict[int, tuple[str, dict[str, Any]]] = {}
            k = 0
            for raw in data.decode("utf-8-sig").split("\n"):  # as validate.py reads it
                if not raw.strip():
                    continue
                obj = json.loads(raw)
                out[k] = (obj["url"], obj["body"])
                k += 1
            b.bodies = out
        return b.bodies

    async def _send(self, b: _Batch, node: str, line: int, attempt: int) -> None:
        cfg = self.policy.batch
        tenant = b.rec["tenant"]
        result: dict[str, Any]
        transient = False
        try:
            bodies = self._bodies(b)
            url, body = bodies[line]
            body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            expires = int(b.rec["expires_at"]) + EXPIRES_GRACE_S
            headers = {PRINCIPAL_HEADER: records.sign_principal(self.secret, b.id, line, tenant, expires),
                       "X-Kvgate-Priority": "batch", "Content-Type": "application/json"}
            base = self.gateway_url or http_url(self.policy.gateway.listen)
            # gateway.tls (docs/tls.md): this host's own gateway over HTTPS, its certificate not
            # verified (it may name the public host, not the loopback address connected to here)
            local_tls = not self.gateway_url and self.policy.gateway.tls is not None
            if local_tls:
                base = "https" + base.removeprefix("http")
            timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
            assert self.session is not None
            async with self.session.post(base + url, data=json.dumps(body), headers=headers,
                                         timeout=timeout, ssl=not local_tls) as resp:
                raw = await resp.read()
                try:
                    payload: Any = json.loads(raw)
                except ValueError:
                    payload = raw.decode("utf-8", "replace")
                result = {"ok": 200 <= resp.status < 300, "status_code": resp.status,
                          "request_id": resp.headers.get("X-Request-Id"), "body": payload}
                transient = resp.status >= 500 or resp.status in TRANSIENT
                limited = rate_limit_wait(resp.status, resp.headers, payload)
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            limited = None
            code = "request_timeout" if isinstance(exc, asyncio.TimeoutError) else "connection_error"
            result = {"ok": False, "status_code": None, "request_id": None, "body": None,
                      "error": {"code": code, "message": f"The request through the gateway failed: "
                                f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"}}
            transient = True
        except Exception as exc:  # a line we cannot even build (the input file vanished)
            limited = None
            log.exception("batch %s line %d", b.id, line)
            result = {"ok": False, "status_code": None, "request_id": None, "body": None,
                      "error": {"code": "internal_error", "message": f"kvgate could not send this line: {exc}"}}
        retry_at = ""
        if limited is not None:
            # the tenant's own limit: not a failure of the line. Every line of the tenant waits
            # for the bucket (Retry-After), and the retry does not count against max_attempts:
            # the completion window bounds how long a batch may wait.
            self.limit.cut()
            self.tenant_hold[tenant] = max(self.tenant_hold.get(tenant, 0.0), time.monotonic() + limited)
            retry_at = str(_now_ms() + int(1000 * limited))
            self.metrics.rate_limited.labels(tenant).inc()
            try:
                self.r.hincrby(records.run_prefix(b.id) + "att", str(line), -1)  # this send was no attempt
            except redis.RedisError:
                pass
        elif transient and not result["ok"]:
            self.limit.cut()
            if attempt < cfg.max_attempts:
                retry_at = str(_now_ms() + int(1000 * cfg.retry_backoff_s * 2 ** (attempt - 1)))
        elif result["ok"]:
            self.limit.grow()
        try:
            n = int(self._record(keys=[records.run_prefix(b.id), GLOBAL, records.batch_key(b.id)],
                                 args=[b.id, line, json.dumps(result), "1" if result["ok"] else "0", retry_at]))
        except redis.RedisError as exc:
            log.warning("batch %s line %d: result not recorded (%s); the lease will expire and it runs again",
                        b.id, line, exc)
            n = -2
        if n == 1:
            self.metrics.lines.labels(tenant, "succeeded" if result["ok"] else "failed").inc()
        elif n == 2:
            self.metrics.lines.labels(tenant, "retried").inc()

    def _done(self, key: tuple[str, int], node: str) -> None:
        self.tasks.pop(key, None)
        self.node_busy[node] = max(0, self.node_busy.get(node, 0) - 1)
        self.metrics.in_flight.dec()
        self._wake.set()

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            by_batch: dict[str, list[int]] = {}
            for bid, line in list(self.tasks):
                by_batch.setdefault(bid, []).append(line)
            for bid, lines in by_batch.items():
                try:
                    self._renew(keys=[records.run_prefix(bid), GLOBAL],
                                args=[bid, _now_ms() + int(self.lease_s * 1000), *lines])
                except redis.RedisError as exc:
                    log.warning("lease renewal failed: %s", exc)

    # ------------------------------------------------------------------ finalize
    def _finalize(self, rec: dict[str, str], final: str) -> None:
        """Write the output and error files and move the batch to ``final`` (completed,
        expired or cancelled). Idempotent: a second worker (or a restart) redoes it with the
        same file ids."""
        bid = rec["id"]
        P = records.run_prefix(bid)
        if not self.r.set(P + "lock:fin", self.worker_id, nx=True, ex=LOCK_S):
            return
        try:
            self.r.set(P + "closed", "1")
            if final == records.EXPIRED:
                self._abandon(bid)
            # lines still under a lease (stalled ones, any worker's) free their fleet-wide slots
            nodes = self.r.hgetall(P + "node")
            for line in self.r.zrange(P + "lease", 0, -1):
                m = f"{bid}|{line}"
                self.r.zrem(GLOBAL, m)
                if line in nodes:
                    self.r.zrem(f"{GLOBAL}:{nodes[line]}", m)
            cids = self.r.hgetall(P + "cid")
            results = self.r.hgetall(P + "res")
            total = int(rec.get("total") or len(cids))
            ok_lines: list[dict[str, Any]] = []
            err_lines: list[dict[str, Any]] = []
            expired = 0
            for i in range(total):
                cid = cids.get(str(i))
                raw = results.get(str(i))
                if raw is None:
                    if final == records.EXPIRED:
                        expired += 1
                        err_lines.append({"id": records.new_line_id(), "custom_id": cid, "response": None,
                                          "error": dict(EXPIRED_ERROR)})
                    continue
                res = json.loads(raw)
                response = ({"status_code": res["status_code"], "request_id": res.get("request_id"),
                             "body": res.get("body")} if res.get("status_code") is not None else None)
                line = {"id": records.new_line_id(), "custom_id": cid, "response": response,
                        "error": res.get("error") if not res["ok"] else None}
                (ok_lines if res["ok"] else err_lines).append(line)
            ids = self.r.hgetall(P + "fin")
            if not ids:
                self.r.hsetnx(P + "fin", "output", records.new_file_id())
                self.r.hsetnx(P + "fin", "error", records.new_file_id())
                ids = self.r.hgetall(P + "fin")
            tenant = rec["tenant"]
            out_id = err_id = ""
            if ok_lines:
                out_id = self.files.write_output(tenant, f"{bid}_output.jsonl", ok_lines, file_id=ids["output"])["id"]
            if err_lines:
                err_id = self.files.write_output(tenant, f"{bid}_error.jsonl", err_lines, file_id=ids["error"])["id"]
            fields = {"output_file_id": out_id, "error_file_id": err_id, "completed": len(ok_lines),
                      "failed": len(err_lines), "total": total,
                      "usage": records.usage_of(x["response"]["body"] for x in ok_lines if x["response"])}
            if final == records.COMPLETED:
                done = records.transition(self.r, bid, records.COMPLETED, allowed_from=[records.FINALIZING],
                                          fields=fields)
            elif final == records.EXPIRED:
                done = records.transition(self.r, bid, records.EXPIRED, allowed_from=[records.IN_PROGRESS],
                                          fields=fields)
            else:
                done = records.transition(self.r, bid, records.CANCELLED, allowed_from=[records.CANCELLING],
                                          fields=fields)
            if done:
                for _ in range(expired):
                    self.metrics.lines.labels(tenant, "expired").inc()
                self.metrics.batches.labels(final).inc()
                for k in self.r.scan_iter(P + "*", count=1000):
                    self.r.expire(k, RUN_KEYS_TTL_S)
                self.batches.pop(bid, None)
                log.info("batch %s %s: %d succeeded, %d failed (%d expired)", bid, final, len(ok_lines),
                         len(err_lines), expired)
        finally:
            self.r.delete(P + "lock:fin")

    def _abandon(self, bid: str) -> None:
        for (b, _line), task in list(self.tasks.items()):
            if b == bid:
                task.cancel()
