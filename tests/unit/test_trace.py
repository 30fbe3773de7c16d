"""Trace rendering: rendered prompts share text exactly as far as their hash_ids agree."""

import json

import pytest

from kvgate.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, block_words, load_trace, render_messages


def req(ids, input_length=None, ts=0.0, i=0):
    return TraceRequest(i, ts, input_length or len(ids) * TRACE_BLOCK_TOKENS, 10, tuple(ids))


def test_block_text_is_deterministic_and_512_tokens():
    assert block_words(7) == block_words(7)
    assert len(block_words(7)) == TRACE_BLOCK_TOKENS
    assert block_words(7) != block_words(8)


def test_shared_prefix_follows_hash_ids():
    a = render_messages(req([0, 1, 2, 3]))
    b = render_messages(req([0, 1, 2, 9]))
    c = render_messages(req([0, 5, 2, 3]))
    assert a[0] == b[0] == c[0] and a[0]["role"] == "system"
    ua, ub, uc = a[1]["content"].split(), b[1]["content"].split(), c[1]["content"].split()
    assert ua[: 2 * TRACE_BLOCK_TOKENS] == ub[: 2 * TRACE_BLOCK_TOKENS]
    assert ua[2 * TRACE_BLOCK_TOKENS:] != ub[2 * TRACE_BLOCK_TOKENS:]
    assert ua[:16] != uc[:16]


def test_token_count_matches_input_length():
    r = req([0, 1, 2], input_length=2 * TRACE_BLOCK_TOKENS + 100)
    m = render_messages(r)
    total = sum(len(x["content"].split()) for x in m)
    assert total == r.input_length


def test_load_trace_sorts_and_limits(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(o) for o in [
        {"timestamp": 50, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 90, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    ]) + "\n")
    t = load_trace(p, limit=2)
    assert [r.hash_ids for r in t] == [(0, 2), (0, 1)]
    assert t[0].timestamp_s == pytest.approx(0.01)


def test_load_trace_bad_line_names_it(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace record"):
        load_trace(p)
