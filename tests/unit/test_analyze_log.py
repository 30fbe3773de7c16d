"""kvgate analyze on the gateway's own request log (issue 13 item 6): an exported JSONL and the
live kvgate:log stream on a real redis-server, and the predicted saving per lever, on a tiny
log whose hit ratios and savings are computed by hand in the comments."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path
from typing import Iterator

import pytest
import redis
from click.testing import CliRunner

from kvgate.analyze.cli import analyze, analyze_command
from kvgate.analyze.logexport import log_group, parse_since
from kvgate.analyze.workload import WorkloadError, load_workload
from kvgate.keys import LOG_FIELDS, LOG_STREAM

POLICY = "policies/demo.yaml"  # prices: input 200, cached 20, output 600 n$/token; batch_discount 0.5
BT = 512                       # demo pool's prefix_index: chunk_chars 2048 / chars_per_token 4.0
A, B, C, D = ("a" * 16, "b" * 16, "c" * 16, "d" * 16)
PROMPT = 2 * BT + 10           # two logged blocks, then a 10-token tail (both blocks may hit)
FULL = PROMPT * 200 + 5 * 600  # one request's full price, n$


def _entry(i: int, blocks: str, point: int, cache: str = "MISS", batch: str = "") -> dict:
    e = {f: "" for f in LOG_FIELDS}
    e.update(ts=f"{1_700_000_000 + i}.000", pool="default", node="n1", status="200", cache=cache, kind="session",
             key=f"{point:016x}", point=str(point), tries="1", tenant="team-a", model="demo-model",
             prompt=str(PROMPT), cached="0", completion="5", batch=batch, blocks=blocks)
    return e


# arrival order; round robin counts engine requests only (the HIT never reaches an engine):
#   r0 AB  rr n1 miss            chash home(P1) miss
#   r1 AB  rr n2 miss            chash hit 2 blocks
#   r2 AB  rr n1 hit 2 blocks    chash hit
#   r3 CD  rr n2 miss            chash home(P2) miss
#   r4 HIT (response cache: saves FULL, not modelled)
#   r5 CD  rr n1 miss (batch)    chash hit
#   r6 429 refused before a node: not modelled, not in the full price
LOG = [_entry(0, A + B, 11), _entry(1, A + B, 11), _entry(2, A + B, 11), _entry(3, C + D, 22),
       dict(_entry(4, A + B, 11, cache="HIT"), node="cache"), _entry(5, C + D, 22, batch="b1"),
       dict(_entry(6, C + D, 22), node="", status="429", prompt="", completion="")]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check_known_answers(doc: dict) -> None:
    assert doc["source"] == "log" and doc["requests"] == 7
    p = doc["predicted"]
    queries = 5 * PROMPT
    assert p["round_robin"]["hits"] == 2 * BT and p["round_robin"]["queries"] == queries
    assert p["round_robin"]["hit_ratio"] == round(2 * BT / queries, 4)
    # requests 1 s apart, each done in < 0.2 s: nothing in flight, chash_bounded never spills
    for b in ("chash", "chash_bounded", "pooled_ceiling"):
        assert p[b]["hits"] == 6 * BT, b
    s = doc["savings"]
    assert s["priced"] and s["prices_nusd_per_token"] == {"input": 200, "cached_input": 20, "output": 600}
    n = s["nusd"]
    assert n["full_price"] == 6 * FULL
    assert n["cache"] == FULL and s["cache_repeats"] == 1 and s["cache_identifiable"]
    assert n["prefix"]["round_robin"] == 2 * BT * 180
    assert n["prefix"]["chash"] == n["prefix"]["chash_bounded"] == 6 * BT * 180
    assert n["affinity"] == 4 * BT * 180
    assert n["batch"] == FULL // 2 and s["batch_requests"] == 1
    v = doc["verdict_saving_usd"]
    assert v["affinity"] == 4 * BT * 180 / 1e9
    assert v["share_of_full_price"] == round((FULL + 6 * BT * 180 + FULL // 2) / (6 * FULL), 4)


def test_an_exported_log_with_known_answers(tmp_path: Path) -> None:
    _check_known_answers(analyze(_write(tmp_path / "log.jsonl", LOG), nodes=2, policy=POLICY))


def test_the_log_is_recognised_by_content_and_a_bad_chain_is_an_error(tmp_path: Path) -> None:
    reqs = load_workload(_write(tmp_path / "log.jsonl", LOG), log_block_tokens=BT)
    assert [r.source for r in reqs] == ["log"] * 7
    assert [r.reached_engine for r in reqs] == [True, True, True, True, False, True, False]
    assert reqs[0].blocks == (A, B) and reqs[0].input_tokens == PROMPT and reqs[0].timestamp_s == 0
    assert reqs[4].cache_hit and reqs[5].batch and reqs[0].point == 11
    bad = dict(LOG[0], blocks="abc")
    with pytest.raises(WorkloadError, match="bad.jsonl:1"):
        load_workload(_write(tmp_path / "bad.jsonl", [bad]))
    # prompt unknown (""): the logged blocks' tokens
    assert load_workload(_write(tmp_path / "u.jsonl", [dict(LOG[0], prompt="")]),
                         log_block_tokens=BT)[0].input_tokens == 2 * BT


def test_a_trace_says_the_response_cache_is_not_identifiable(tmp_path: Path) -> None:
    rows = [{"timestamp": i * 1000, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]} for i in range(3)]
    s = analyze(_write(tmp_path / "t.jsonl", rows), nodes=2, policy=POLICY)["savings"]
    assert s["cache_identifiable"] is False and s["nusd"]["cache"] == 0 and "does not identify" in s["cache_note"]
    assert s["nusd"]["batch"] == 0 and s["batch_note"]


def test_chat_requests_exact_repeats_are_the_response_cache_lever(tmp_path: Path) -> None:
    msg = [{"role": "user", "content": "hello there"}]
    rows = [{"timestamp": 0, "messages": msg, "max_tokens": 7}, {"timestamp": 1000, "messages": msg, "max_tokens": 7},
            {"timestamp": 2000, "messages": [{"role": "user", "content": "other"}], "max_tokens": 7}]
    doc = analyze(_write(tmp_path / "c.jsonl", rows), nodes=2, policy=POLICY)
    reqs = load_workload(tmp_path / "c.jsonl")
    assert doc["savings"]["cache_repeats"] == 1
    assert doc["savings"]["nusd"]["cache"] == reqs[1].input_tokens * 200 + 7 * 600


def test_parse_since() -> None:
    assert parse_since("1h") == 3600 and parse_since("30m") == 1800 and parse_since(None) is None
    with pytest.raises(ValueError):
        parse_since("1w")


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=1).ping():
                    break
            except redis.RedisError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


def test_the_live_stream_and_its_export(redis_port: int, tmp_path: Path, monkeypatch) -> None:
    import kvgate.analyze.logexport as lx

    monkeypatch.setattr(lx, "PAGE", 4)  # two pages
    r = redis.Redis(port=redis_port)
    r.flushdb()
    for e in LOG:
        r.xadd(LOG_STREAM, e)
    url = f"redis://127.0.0.1:{redis_port}/0"
    _check_known_answers(analyze(url, nodes=2, policy=POLICY))
    out = tmp_path / "export.jsonl"
    res = CliRunner().invoke(log_group, ["export", "--redis", url, "--since", "1h", "--out", str(out)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 7 and all(x["id"] for x in lines) and lines[3]["blocks"] == C + D
    _check_known_answers(analyze(out, nodes=2, policy=POLICY))
    res = CliRunner().invoke(analyze_command, [url, "--nodes", "2", "--policy", POLICY, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["savings"]["nusd"]["affinity"] == 4 * BT * 180
    # the rich table names every lever
    res = CliRunner().invoke(analyze_command, [str(out), "--nodes", "2", "--policy", POLICY])
    assert res.exit_code == 0, res.output
    assert "response cache" in res.output and "affinity" in res.output and "batch" in res.output


def test_a_redis_that_is_down_is_a_clear_error() -> None:
    res = CliRunner().invoke(analyze_command, [f"redis://127.0.0.1:{_free_port()}/0", "--policy", POLICY])
    assert res.exit_code == 2 and "error: redis://" in res.output
