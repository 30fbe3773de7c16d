"""The Batch API end to end, as a tenant uses it (issue 14's acceptance): the real ``kvgate up``
stack (Redis, simulators, nginx, the control plane, the batch worker), the unchanged OpenAI
Python SDK pointed at the gateway, tenants' own API keys.

- every ``custom_id`` comes back exactly once, each a real chat completion from an engine;
- two tenants' batches at once, both with ``custom_id: "req-1"``, one asking for APPLE and one
  for BANANA: each output carries its own answer (the same as the engine gives that prompt);
- the operator sees both (``kvgate batches list``, ``GET /api/v1/batches``, the Batches page);
- the request log marks batch lines (its ``batch`` field) and the cost records price them at
  the batch discount.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import pytest
import requests

from ctlfixtures import MODEL, control_fleet_module, wait_until  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

TENANTS = """
tenants:
  - {id: default}
  - {id: fruit-a, name: Fruit A}
  - {id: fruit-b, name: Fruit B}
  - {id: narrow, name: One request at a time, limits: {concurrency: 1}}
batch: {max_in_flight: 8, max_in_flight_per_node: 4, poll_interval_s: 0.2, retry_backoff_s: 0.2, lease_s: 2,
        completion_windows: ["24h", "1h"]}
"""
PRICES = """
    prices: {input_usd_per_1m_tokens: 0.20, cached_input_usd_per_1m_tokens: 0.02, output_usd_per_1m_tokens: 0.60,
             batch_discount: 0.5}
"""


@pytest.fixture(scope="module")
def stack(control_fleet_module):  # noqa: F811
    fleet = control_fleet_module(n=2, gateway_extra=", auth: required", extra=TENANTS, pool_extra=PRICES)
    keys = {}
    for t in ("fruit-a", "fruit-b", "narrow"):
        r = fleet.api("POST", "/api/v1/keys", json={"tenant": t, "name": "e2e"})
        assert r.status_code == 201, r.text
        keys[t] = r.json()["secret"]
    fleet.keys = keys
    return fleet


def client(fleet, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.gateway + "/v1", api_key=fleet.keys[tenant], max_retries=0, timeout=60)


def line(custom_id: str, content: str, max_tokens: int = 8) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def upload(c: openai.OpenAI, lines: list[dict]):
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return c.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")


def run_to_end(c: openai.OpenAI, batch_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    b = c.batches.retrieve(batch_id)
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status} after {timeout} s"
        time.sleep(0.2)
        b = c.batches.retrieve(batch_id)
    return b


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def test_sdk_unchanged_every_custom_id_once(stack):
    c = client(stack, "fruit-a")
    lines = [line(f"q-{i}", f"question number {i} about the shared report") for i in range(12)]
    f = upload(c, lines)
    assert f.purpose == "batch" and f.bytes > 0
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "e2e"})
    assert b.status == "validating" and b.metadata == {"job": "e2e"}
    b = run_to_end(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (12, 12, 0)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.output_file_id
    out = jsonl(c.files.content(b.output_file_id).text)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    for x in out:
        assert x["id"].startswith("batch_req_") and x["error"] is None
        resp = x["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["prompt_tokens"] > 0
    # OpenAI's model and usage: the succeeded lines' tokens summed
    assert b.model == MODEL
    assert b.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out) > 0
    assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    # the listing the SDK pages through
    assert b.id in [x.id for x in c.batches.list(limit=10).data]


def test_two_tenants_same_custom_id_get_their_own_answers(stack):
    asks = {"fruit-a": "Name a fruit: APPLE", "fruit-b": "Name a fruit: BANANA"}
    clients = {t: client(stack, t) for t in asks}
    # what the engine answers each prompt (deterministic at temperature 0), asked live
    expected = {}
    for t, content in asks.items():
        r = requests.post(stack.gateway + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {stack.keys[t]}", "Cache-Control": "no-store"},
                          json=line("x", content)["body"])
        assert r.status_code == 200, r.text
        expected[t] = r.json()["choices"][0]["message"]["content"]
    assert expected["fruit-a"] != expected["fruit-b"]
    batches = {}
    for t, content in asks.items():
        f = upload(clients[t], [line("req-1", content)])
        batches[t] = clients[t].batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id
    for t in asks:
        b = run_to_end(clients[t], batches[t])
        assert b.status == "completed", b
        out = jsonl(clients[t].files.content(b.output_file_id).text)
        assert [x["custom_id"] for x in out] == ["req-1"]
        assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == expected[t]
    # neither tenant reaches the other's batch or files
    other = clients["fruit-b"]
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batches["fruit-a"])
    a = clients["fruit-a"].batches.retrieve(batches["fruit-a"])
    with pytest.raises(openai.NotFoundError):
        other.files.content(a.output_file_id)
    # the operator sees both
    listed = stack.api("GET", "/api/v1/batches").json()["batches"]
    tenants = {b["id"]: b["tenant"] for b in listed}
    assert tenants[batches["fruit-a"]] == "fruit-a" and tenants[batches["fruit-b"]] == "fruit-b"
    cli = stack.kvgate("batches", "list", "--tenant", "fruit-b")
    assert cli.returncode == 0 and batches["fruit-b"] in cli.stdout and batches["fruit-a"] not in cli.stdout
    page = stack.api("GET", "/admin/batches").json()  # the page's figures (a Bearer caller gets JSON)
    assert {batches["fruit-a"], batches["fruit-b"]} <= {b["id"] for b in page["batches"]}


def test_batch_lines_are_logged_and_priced_at_the_discount(stack):
    import redis as redis_lib

    c = client(stack, "fruit-a")
    f = upload(c, [line("cost-1", "a question whose price we check, once")])
    b = run_to_end(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="1h").id)
    assert b.status == "completed", b
    r = redis_lib.Redis(port=stack.redis_port)

    def entry():
        for _id, fields in r.xrevrange("kvgate:log", count=200):
            e = {k.decode(): v.decode() for k, v in fields.items()}
            if e.get("batch") == b.id:
                return e
        return None

    e = wait_until(entry, "the batch line in the request log", timeout=10)
    assert e["tenant"] == "fruit-a" and e["status"] == "200"
    p, cached, comp = int(e["prompt"]), int(e["cached"] or 0), int(e["completion"])
    full = (p - cached) * 200 + cached * 20 + comp * 600  # n$ at the pool's prices
    assert int(e["cost"]) == full // 2 and int(e["saved_batch"]) == full - full // 2


def test_cancel_in_flight_keeps_finished_lines(stack):
    c = client(stack, "fruit-b")
    lines = [line(f"slow-{i}", f"a long answer number {i}", max_tokens=200) for i in range(40)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 2, "two lines done", timeout=30)
    cancelled = c.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled")
    b = run_to_end(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    assert 2 <= b.request_counts.completed < 40
    out = jsonl(c.files.content(b.output_file_id).text) if b.output_file_id else []
    assert len(out) == b.request_counts.completed
    assert len({x["custom_id"] for x in out}) == len(out)


def test_worker_and_control_plane_killed_mid_batch_nothing_runs_twice(stack):
    """SIGKILL the batch worker and the control plane mid-batch, restart them with `kvgate up`:
    the batch completes, every custom_id once, and the engines answered exactly one request per
    line (a line in flight at the kill was aborted at the engine, never counted; one whose answer
    was lost with the worker is answered again by the response cache, not by an engine)."""
    c = client(stack, "fruit-a")
    lines = [line(f"crash-{i}", f"a long report, part {i}", max_tokens=300) for i in range(30)]
    nodes = sorted(stack.node_ports)
    before = sum(stack.engine_counter(n) for n in nodes)
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, "five lines done", timeout=30)
    for name in ("batch-worker", "control"):
        os.kill(int((stack.run_dir / "pids" / f"{name}.pid").read_text()), signal.SIGKILL)
    import redis as redis_lib
    done_at_kill = int(redis_lib.Redis(port=stack.redis_port).hget(f"kvgate:batch:b:{b.id}", "completed"))
    assert 5 <= done_at_kill < 30, "the kill must land mid-batch"
    up = stack.kvgate("up", str(stack.policy_path))
    assert up.returncode == 0, up.stdout + up.stderr
    b = run_to_end(c, b.id, timeout=90)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (30, 0)
    out = jsonl(c.files.content(b.output_file_id).text)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    wait_until(lambda: sum(stack.engine_counter(n) for n in nodes) - before >= 30, "the engines' counters")
    time.sleep(0.5)
    assert sum(stack.engine_counter(n) for n in nodes) - before == 30


def test_a_tenants_own_rate_limit_slows_its_batch_and_fails_no_line(stack):
    """The worker sends up to 8 lines at once; tenant `narrow` may have one request in flight.
    The gateway refuses the others (429 rate_limit_exceeded, Retry-After): the worker waits for
    the tenant's limit instead of spending the lines' attempts, and every line completes."""
    def refused() -> float:
        text = requests.get(f"http://127.0.0.1:{stack.internal_port}/metrics", timeout=5).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                   if x.startswith("kvgate_ratelimited_total{") and 'tenant="narrow"' in x)

    c = client(stack, "narrow")
    lines = [line(f"n-{i}", f"one at a time, line {i}", max_tokens=30) for i in range(12)]
    b = run_to_end(c, c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                                       completion_window="24h").id, timeout=90)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (12, 0)
    assert refused() > 0, "the limit was never reached: the test proves nothing"
