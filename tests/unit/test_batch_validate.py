"""kvgate.batch.validate: a batch input file checked before any inference."""

from __future__ import annotations

import json

from kvgate.batch.validate import MAX_ERRORS, validate_input
from kvgate.policy.loader import parse_policy

CHAT = "/v1/chat/completions"


def policy(**batch):
    return parse_policy({
        "version": 1,
        "gateway": {"auth": "required"},
        "pools": [{"name": "a", "models": ["m", "m2"], "nodes": [{"id": "n1", "url": "http://127.0.0.1:1"}]},
                  {"name": "b", "models": ["e"], "nodes": [{"id": "n2", "url": "http://127.0.0.1:2"}]}],
        "tenants": [{"id": "acme"}, {"id": "small", "models": ["m"]}],
        "batch": batch,
    }, "test")


def line(cid="req-1", model="m", url=CHAT, method="POST", **extra):
    obj = {"custom_id": cid, "method": method, "url": url,
           "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
    obj.update(extra)
    return json.dumps(obj)


def run(*lines, endpoint=CHAT, tenant="acme", pol=None):
    return validate_input("\n".join(lines).encode(), endpoint=endpoint, policy=pol or policy(), tenant=tenant)


def test_good_file_lines_in_order_with_pools():
    v = run(line("a"), "", line("b", model="e"), line("c", model="m2"))
    assert v.ok and v.total == 3 and not v.refused
    assert [(ln.index, ln.custom_id, ln.pool, ln.lineno) for ln in v.lines] == \
        [(0, "a", "a", 1), (1, "b", "b", 3), (2, "c", "a", 4)]


def test_duplicate_custom_id_names_line_3_and_the_id():
    v = run(line("req-1"), line("req-2"), line("req-1"))
    assert not v.ok and not v.lines
    assert len(v.errors) == 1
    err = v.errors[0]
    assert err["code"] == "duplicate_custom_id" and err["line"] == 3 and err["param"] == "custom_id"
    assert "req-1" in err["message"] and "line 1" in err["message"]


def test_missing_and_bad_custom_id():
    bad = json.loads(line())
    del bad["custom_id"]
    v = run(line("a"), json.dumps(bad), line(""), json.dumps({**bad, "custom_id": 7}))
    assert [(e["code"], e["line"]) for e in v.errors] == [
        ("missing_required_parameter", 2), ("invalid_custom_id", 3), ("invalid_custom_id", 4)]


def test_structure_errors_each_named():
    v = run("not json", "[1]", line("m", method="GET"), line("u", url="/v1/other"),
            line("e", url="/v1/embeddings"), json.dumps({"custom_id": "b", "method": "POST", "url": CHAT, "body": 3}),
            json.dumps({"custom_id": "n", "method": "POST", "url": CHAT, "body": {"messages": []}}))
    assert [(e["code"], e["line"]) for e in v.errors] == [
        ("invalid_json_line", 1), ("invalid_json_line", 2), ("invalid_method", 3), ("invalid_url", 4),
        ("mismatched_endpoint", 5), ("invalid_body", 6), ("missing_required_parameter", 7)]
    assert "'e'" in v.errors[4]["message"]  # the custom_id is named


def test_unknown_model_line_refused_not_fatal():
    v = run(line("a"), line("b", model="nope"), line("c", model="e"), tenant="small")
    assert v.ok and [ln.custom_id for ln in v.lines] == ["a", "b", "c"]
    # nope: served by no pool; e: served, but tenant small may use only m
    assert set(v.refused) == {1, 2}
    assert v.refused[1]["error"]["code"] == "model_not_found"


def test_every_model_unknown_fails_the_file():
    v = run(line("a", model="x"), line("b", model="y"))
    assert not v.ok and [(e["code"], e["line"]) for e in v.errors] == [("model_not_found", 1), ("model_not_found", 2)]


def test_tenant_not_in_policy_may_use_every_model():
    v = run(line("a", model="e"), tenant="")
    assert v.ok and v.lines[0].pool == "b"


def test_limits():
    v = run(line("a"), line("b"), line("c"), pol=policy(max_lines=2))
    assert [(e["code"], e["line"]) for e in v.errors] == [("too_many_lines", 3)]
    big = ("\n".join(line(f"x{i}") for i in range(20))).encode()
    v = validate_input(big, endpoint=CHAT, policy=policy(max_file_bytes=1024), tenant="acme")
    assert v.errors[0]["code"] == "file_too_large" and v.errors[0]["line"] is None
    assert run("", "  ").errors[0]["code"] == "empty_file"
    assert validate_input(b"\xff\xfe", endpoint=CHAT, policy=policy(), tenant="acme").errors[0]["code"] == \
        "invalid_file_encoding"


def test_errors_capped():
    v = run(*["x"] * (MAX_ERRORS + 50))
    assert len(v.errors) == MAX_ERRORS


def test_a_byte_order_mark_and_crlf_are_not_content():
    data = ("\ufeff" + line("a") + "\r\n" + line("b") + "\r\n").encode()
    v = validate_input(data, endpoint=CHAT, policy=policy(), tenant="acme")
    assert v.ok and [ln.custom_id for ln in v.lines] == ["a", "b"]


def test_a_file_that_fails_counts_no_request():
    v = run(*[line(f"r{i}") for i in range(5)], pol=policy(max_lines=3))
    assert not v.ok and v.errors[0]["code"] == "too_many_lines" and v.total == 0
