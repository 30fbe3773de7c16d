"""kvgate bench gateway: the bodies it sends and the table it prints (the benchmark itself
needs wrk, nginx, Redis and minutes: run it by hand, figures in docs/benchmarks.md)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvgate.bench import gateway as g


def test_bodies_are_valid_chat_requests_of_the_size_asked() -> None:
    for size in g.SIZES.values():
        for temp, vary in ((0, "seed"), (0.7, "max_tokens")):
            head, tail = g.chat_body(size, temp, vary)
            body = json.loads(head + "17" + tail)
            assert body[vary] == 17 and body["temperature"] == temp and body["model"] == g.MODEL
            assert [m["role"] for m in body["messages"]] == ["system", "user"]
            assert 0.9 * size <= len(head + tail) <= 1.1 * size
    # a miss is cacheable (temperature 0, a seed), a bypass is not (no seed, temperature 0.7)
    assert "seed" not in json.loads(g.chat_body(2048, 0.7, "max_tokens")[0] + "1}")
    answer = json.loads(g.ANSWER)
    assert answer["choices"][0]["finish_reason"] == "stop" and "usage" in answer


def test_table_ratios_against_bare_nginx_and_the_best_peer() -> None:
    r = g.Report()
    r.rows[("bare", "2KB")] = [g.Result(10000, 0.5, 2.0, 50000, 10)]
    r.rows[("kvgate miss", "2KB")] = [g.Result(6000, 1.0, 4.0, 30000, 60), g.Result(4000, 1.2, 5.0, 20000, 80)]
    r.rows[("kvgate hit", "2KB")] = [g.Result(7500, 0.8, 3.0, 37500, 50)]
    r.rows[("vllm-router", "2KB")] = [g.Result(5000, 1.0, 3.0, 25000, 70)]
    r.rows[("sglang-router", "2KB")] = [g.Result(2500, 2.0, 6.0, 12500, 90)]
    r.one[("bare", "2KB")] = [g.Result(1000, 0.05, 1.0, 1000)]
    r.one[("kvgate miss", "2KB")] = [g.Result(900, 0.10, 2.5, 900)]
    r.hit_share["2KB"] = 1.0
    text = g.render(r, ["2KB"], "header")
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| 2KB")}
    assert "| 5,000 | 0.500 | 1.00 |" in rows["kvgate miss"]  # median of 6000 and 4000
    assert "| +1.50 |" in rows["kvgate miss"]  # one connection's p99 over bare nginx's
    assert "| 1.50 |" in rows["kvgate hit"]  # against vllm-router, the best peer
    assert "2KB: hit/miss 1.50" in text


def test_command_is_registered() -> None:
    from kvgate.cli import main

    res = CliRunner().invoke(main, ["bench", "gateway", "--help"])
    assert res.exit_code == 0 and "--peers-venv" in res.output
