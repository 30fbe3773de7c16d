"""The batch worker (kvgate.batch.runner) against a real gateway (nginx + Lua, verifying the
batch principal), a real Redis and scriptable engines (mockengine: they count every request
and can stall or fail on demand).

- a batch completes: every custom_id exactly once, 200s with the gateway's request id, a
  transient 503 retried (engine requests = lines + retries), each document's lines sent back
  to back behind their leader;
- a duplicate custom_id fails the batch naming line 3 and ``req-1``; no engine request;
- expiry with partial results: 6 finish, 2 of an unknown model, 2 stalled past a 4 s window
  → ``expired``, counts 6/4/10, output = the 6, error file = 2 model errors + 2 batch_expired;
- the worker SIGKILLed mid-batch and restarted: the batch completes, no line that had
  succeeded is sent again, the engines' requests = the recorded sends.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis as redis_lib

from gwfixtures import _start_redis, free_port, make_policy, private_dir
from kvgate.analyze.routing import Ring, key_point
from kvgate.batch import records
from kvgate.batch.files import FileStore
from kvgate.batch.runner import Runner
from kvgate.batch.schedule import default_weights
from kvgate.nginxctl import Nginx
from kvgate.policy.batch import BatchConfig, window_seconds
from kvgate.render import default_lua_dir
from mockengine import Behaviour, start_mock_engines

pytestmark = pytest.mark.integration

MODEL = "m"
TOKEN = "test-admin-token"
CHAT = "/v1/chat/completions"
BATCH = {"max_in_flight": 8, "max_in_flight_per_node": 4, "poll_interval_s": 0.1, "retry_backoff_s": 0.1,
         "completion_windows": ["24h", "4s"], "max_attempts": 3}


class Env:
    def __init__(self, base: Path):
        self.base = base
        self.redis = _start_redis(base)
        self.mocks = start_mock_engines(2, default=Behaviour(stall_s=0.05))
        policy = make_policy(self.mocks, self.redis)
        self.policy = policy.model_copy(update={"batch": BatchConfig(**BATCH)})
        private = private_dir(base, "gw")
        shutil.copytree(default_lua_dir(), private / "lua")
        self.nginx = Nginx(private / "prefix", lua_dir=private / "lua", batch_secret=records.batch_secret(TOKEN))
        assert self.nginx.apply(self.policy) == "started"
        self.nginx.wait_ready(self.policy.gateway.listen)
        self.r = redis_lib.Redis(host="127.0.0.1", port=self.redis.port, decode_responses=True)
        self.data = base / "data"
        self.files = FileStore(self.data, self.r)
        self.ring = Ring(list(default_weights(self.policy).items()))

    def stop(self):
        self.nginx.stop(timeout=5)
        for m in self.mocks:
            m.stop()
        self.redis.stop()

    def clear(self):
        self.r.flushdb()
        for m in self.mocks:
            m.clear()
            m.set(stall_s=0.05)

    def requests(self) -> int:
        return sum(len(m.completions()) for m in self.mocks)

    def user_on(self, node: str, tag: str) -> str:
        """A ``user`` whose route key ``u:<user>`` has its home on ``node``."""
        for i in range(1000):
            if self.ring.home(key_point(f"u:{tag}{i}")) == node:
                return f"{tag}{i}"
        raise AssertionError(node)

    def submit(self, lines: list[dict], window: str = "24h", tenant: str = "") -> str:
        data = "\n".join(json.dumps(ln) for ln in lines).encode()
        f = self.files.create(tenant, io.BytesIO(data), "in.jsonl", "batch", max_bytes=10 ** 7)
        rec = records.new_record(batch_id=records.new_batch_id(), tenant=tenant, endpoint=CHAT,
                                 input_file_id=f["id"], completion_window=window, window_s=window_seconds(window),
                                 metadata=None)
        records.save_new(self.r, rec)
        return rec["id"]

    def wait(self, bid: str, statuses=records.TERMINAL, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = records.load(self.r, bid)
            if h["status"] in statuses:
                return h
            time.sleep(0.05)
        raise AssertionError(f"batch {bid} still {h['status']} ({h})")

    def content(self, h: dict, field: str) -> list[dict]:
        if not h[field]:
            return []
        with self.files.open(h["tenant"], h[field]) as fh:
            return [json.loads(x) for x in fh.read().decode().splitlines()]

    def policy_file(self) -> Path:
        p = self.base / "policy.json"
        p.write_text(json.dumps(self.policy.model_dump(mode="json", exclude_none=True)))
        return p


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("batchrun"))
    yield e
    e.stop()


@pytest.fixture
def worker(env):
    """An in-process worker on its own event loop thread; stopped at teardown."""
    env.clear()
    runner = Runner(lambda: env.policy, env.r, env.files, TOKEN, worker_id="t")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(runner.run(),), daemon=True)
    thread.start()
    yield runner
    loop.call_soon_threadsafe(runner.stop)
    thread.join(10)


def chat_line(cid: str, text: str, *, system: str | None = None, model: str = MODEL, user: str | None = None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    body = {"model": model, "max_tokens": 4, "messages": messages}
    if user:
        body["user"] = user
    return {"custom_id": cid, "method": "POST", "url": CHAT, "body": body}


def test_batch_completes_every_custom_id_once_with_retries(env, worker):
    docs = {d: f"Document {d}: " + "lorem ipsum " * 200 for d in range(3)}  # > prefix_chars
    lines = [chat_line(f"d{d}-q{q}", f"question {q}", system=docs[d]) for q in range(4) for d in range(3)]
    env.mocks[0].script(Behaviour(status=500))  # one transient failure on each engine's first request
    # (500: the gateway fails over 502-504 itself)
    env.mocks[1].script(Behaviour(status=500))
    bid = env.submit(lines)
    h = env.wait(bid, timeout=30)
    assert h["status"] == records.COMPLETED, h
    assert (h["total"], h["completed"], h["failed"]) == ("12", "12", "0")
    out = env.content(h, "output_file_id")
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)
    assert not h["error_file_id"]
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
        assert o["response"]["body"]["choices"][0]["message"]["content"].startswith("answer ")
    assert len({o["id"] for o in out}) == 12
    att = env.r.hgetall(records.run_prefix(bid) + "att")
    sends = sum(int(v) for v in att.values())
    engines = env.requests()
    assert engines == sends  # every send reached an engine once
    served = sum(1 for m in env.mocks if m.completions())
    assert sends == 12 + served  # each engine that got lines failed its first once: retried
    # the engines never saw the principal; every line came as batch priority through the gateway
    for m in env.mocks:
        for req in m.completions():
            assert "x-kvgate-batch" not in req.headers
    # each document's lines went to one engine, the leader alone first (its prefix prefilled once)
    for d in range(3):
        reqs = sorted((rq for m in env.mocks for rq in m.completions()
                       if rq.body["messages"][0]["content"] == docs[d]), key=lambda rq: rq.at)
        nodes = {m.node_id for m in env.mocks for rq in m.completions() if rq.body["messages"][0]["content"] == docs[d]}
        assert len(nodes) == 1
        assert reqs[1].at - reqs[0].at >= 0.04  # followers released once the leader answered
    # run keys end with a TTL
    assert all(env.r.ttl(k) > 0 for k in env.r.scan_iter(records.run_prefix(bid) + "*"))


def test_duplicate_custom_id_fails_naming_line_3_no_engine_request(env, worker):
    bid = env.submit([chat_line("req-1", "a"), chat_line("req-2", "b"), chat_line("req-1", "c")])
    h = env.wait(bid, timeout=10)
    assert h["status"] == records.FAILED
    errors = records.to_openai(h)["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors] == [(3, "duplicate_custom_id")]
    assert "req-1" in errors[0]["message"]
    missing = chat_line("x", "y")
    del missing["custom_id"]
    h2 = env.wait(env.submit([chat_line("a", "a"), missing]), timeout=10)
    assert h2["status"] == records.FAILED
    assert records.to_openai(h2)["errors"]["data"][0]["line"] == 2
    time.sleep(0.3)
    assert env.requests() == 0


def test_expiry_keeps_finished_lines(env, worker):
    fast_user, slow_user = env.user_on(env.mocks[0].node_id, "fast"), env.user_on(env.mocks[1].node_id, "slow")
    env.mocks[1].set(stall_s=30)
    lines = ([chat_line(f"ok-{i}", f"q{i}", user=fast_user) for i in range(6)]
             + [chat_line(f"bad-{i}", "q", model="no-such-model") for i in range(2)]
             + [chat_line(f"stall-{i}", f"s{i}", user=slow_user) for i in range(2)])
    bid = env.submit(lines, window="4s")
    h = env.wait(bid, timeout=15)
    assert h["status"] == records.EXPIRED
    obj = records.to_openai(h)
    assert obj["request_counts"] == {"total": 10, "completed": 6, "failed": 4}
    out = env.content(h, "output_file_id")
    err = env.content(h, "error_file_id")
    assert sorted(o["custom_id"] for o in out) == [f"ok-{i}" for i in range(6)]
    codes = Counter((e["response"] or {}).get("status_code") or e["error"]["code"] for e in err)
    assert codes == {404: 2, "batch_expired": 2}
    for e in err:
        if e["response"]:
            assert e["response"]["body"]["error"]["code"] == "model_not_found" and e["error"] is None
    ids = [o["custom_id"] for o in out + err]
    assert sorted(ids) == sorted(ln["custom_id"] for ln in lines)  # none missing or repeated
    assert not env.mocks[0].completions() or all(rq.body["model"] == MODEL for rq in env.mocks[0].completions())
    # the stalled lines' fleet-wide slots are free again
    assert env.r.zcard(records.PREFIX + "run:inflight") == 0


def _spawn_worker(env, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgate", "--run-dir", str(env.base / "run"), "batch-worker",
           "--policy", str(env.policy_file()), "--token", TOKEN, "--data-dir", str(env.data),
           "--lease-s", "1.5", "--worker-id", "sub"]
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "KVGATE_TOKEN": ""})


def test_worker_killed_mid_batch_and_restarted(env):
    env.clear()
    for m in env.mocks:
        m.set(stall_s=0.25)
    lines = [chat_line(f"k{i}", f"question {i}", user=f"user{i}") for i in range(24)]
    bid = env.submit(lines)
    log = env.base / "worker.log"
    proc = _spawn_worker(env, log)
    try:
        P = records.run_prefix(bid)
        deadline = time.monotonic() + 20
        while env.r.hlen(P + "res") < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert env.r.hlen(P + "res") >= 6, log.read_text()
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        done_before = set(env.r.hkeys(P + "res"))
        att_before = env.r.hgetall(P + "att")
        in_flight = int(env.r.zcard(P + "lease"))
        assert records.load(env.r, bid)["status"] == records.IN_PROGRESS
        proc = _spawn_worker(env, log)
        h = env.wait(bid, timeout=40)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert h["status"] == records.COMPLETED, log.read_text()
    out = env.content(h, "output_file_id")
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)
    att = env.r.hgetall(records.run_prefix(bid) + "att")
    for line in done_before:  # a line that had its result was never sent again
        assert att[line] == att_before[line]
    sends = sum(int(v) for v in att.values())
    time.sleep(0.3)  # the killed worker's last sends may still be arriving at the engines
    engines = env.requests()
    # every send is an engine request, except a send cut between claim and the wire by the kill
    assert sends - in_flight <= engines <= sends
    assert sends == len(lines) + sum(int(v) - 1 for v in att.values())
    assert sends <= len(lines) + in_flight  # only the lines in flight at the kill ran again


def test_cancel_lets_in_flight_finish_partial_output(env, worker):
    for m in env.mocks:
        m.set(stall_s=0.3)
    lines = [chat_line(f"c{i}", f"question {i}", user=f"cu{i}") for i in range(30)]
    bid = env.submit(lines)
    P = records.run_prefix(bid)
    deadline = time.monotonic() + 10
    while env.r.hlen(P + "res") < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert records.transition(env.r, bid, records.CANCELLING, allowed_from=[records.IN_PROGRESS])
    h = env.wait(bid, timeout=15)
    assert h["status"] == records.CANCELLED
    out = env.content(h, "output_file_id")
    assert 3 <= len(out) < 30 and int(h["completed"]) == len(out) and h["total"] == "30"
    assert len({o["custom_id"] for o in out}) == len(out)
    time.sleep(0.5)
    assert env.requests() == len(out)  # the lines in flight at the cancel finished; none started after
