"""Bad input is answered by the gateway in OpenAI's error format; no node sees it."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gwfixtures import MODEL, Gateway, sims_total

SUCCESS = "vllm:request_success_total"
GOOD = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}' % MODEL


def _post(gw: Gateway, body: bytes | str, headers: dict | None = None, path: str = "/v1/chat/completions"):
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    return requests.post(gw.url + path, data=body, headers=h, timeout=10)


CASES = {
    "malformed-json": (dict(body='{"model": "m", "messages": ['), 400, "invalid_json"),
    "not-an-object": (dict(body='["model"]'), 400, "invalid_json"),
    "missing-model": (dict(body='{"messages": []}'), 400, "missing_model"),
    "text-plain": (dict(body=GOOD, headers={"Content-Type": "text/plain"}), 400, "invalid_content_type"),
    "oversized": (dict(body='{"model": "m", "pad": "' + "x" * 70000 + '"}'), 413, "request_too_large"),
    "unknown-model": (dict(body=GOOD.replace(f'"{MODEL}"', '"gpt-nope"')), 404, "model_not_found"),
    "long-session": (dict(body=GOOD, headers={"X-Session-Id": "s" * 300}), 400, "invalid_session_id"),
    "control-char-session": (dict(body=GOOD, headers={"X-Session-Id": "a\x01b"}), 400, "invalid_session_id"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_rejected_at_the_gateway(fleet_clean: Gateway, case: str) -> None:
    kwargs, status, code = CASES[case]
    before = sims_total(fleet_clean.sims, SUCCESS), sims_total(fleet_clean.sims, "vllm:prompt_tokens_total")
    bad_before = fleet_clean.metric_sum("kvgate_bad_requests_total", status=str(status))
    r = _post(fleet_clean, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert "param" in err
    if code == "model_not_found":
        assert err["param"] == "model"
    after = sims_total(fleet_clean.sims, SUCCESS), sims_total(fleet_clean.sims, "vllm:prompt_tokens_total")
    assert after == before
    fleet_clean.wait_metric("kvgate_bad_requests_total", bad_before + 1, status=str(status))


def test_oversized_chunked_body_is_413(fleet_clean: Gateway) -> None:
    def gen():
        yield b'{"model": "m", "pad": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    r = requests.post(fleet_clean.url + "/v1/chat/completions", data=gen(),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_content_type_with_parameters_is_fine(fleet_clean: Gateway) -> None:
    r = _post(fleet_clean, GOOD, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_unknown_path_and_method(fleet_clean: Gateway) -> None:
    r = requests.get(fleet_clean.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(fleet_clean.url + "/v1/chat/completions", timeout=5)
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_parse_and_count(fleet_clean: Gateway) -> None:
    before = fleet_clean.metric_sum("kvgate_requests_total", status="200", route_key_kind="session")
    for i in range(3):
        assert fleet_clean.chat(f"m{i}", headers={"X-Session-Id": "metrics"}, max_tokens=1).status_code == 200
    assert fleet_clean.chat("fb", max_tokens=1).status_code == 200  # prefix key
    r = requests.get(fleet_clean.url + "/metrics", timeout=5)
    assert r.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("kvgate_requests", "kvgate_upstream_response_seconds", "kvgate_failovers",
                 "kvgate_cache_errors", "kvgate_bad_requests", "kvgate_route_key_fallback"):
        assert name in families, sorted(families)
    assert families["kvgate_upstream_response_seconds"].type == "histogram"
    fleet_clean.wait_metric("kvgate_requests_total", before + 3, status="200", route_key_kind="session")
    nodes = {s.labels["node"] for s in families["kvgate_requests"].samples}
    assert nodes <= {s.node_id for s in fleet_clean.sims} | {"cache", "none"}
    count = fleet_clean.metric_sum("kvgate_upstream_response_seconds_count")
    inf = fleet_clean.metric_sum("kvgate_upstream_response_seconds_bucket", le="+Inf")
    assert count == inf > 0
    # per series: buckets in numeric order, +Inf last, cumulative
    series: dict[tuple, list[tuple[str, float]]] = {}
    for s in families["kvgate_upstream_response_seconds"].samples:
        if s.name.endswith("_bucket"):
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            series.setdefault(key, []).append((s.labels["le"], s.value))
    assert series
    for buckets in series.values():
        bounds = [float(le) for le, _ in buckets]
        assert bounds == sorted(bounds) and buckets[-1][0] == "+Inf", buckets
        values = [v for _, v in buckets]
        assert values == sorted(values), buckets


def test_fallback_route_key_is_counted(start_sims, start_gateway) -> None:
    gw = start_gateway(start_sims(2, prefix="b"), None, pool={"affinity": ["session"]})
    r = gw.chat("no session header", max_tokens=1)
    assert r.status_code == 200 and r.headers["X-Kvgate-Route-Key-Kind"] == "fallback"
    gw.wait_metric("kvgate_route_key_fallback_total", 1, pool="default")
    gw.wait_metric("kvgate_requests_total", 1, route_key_kind="fallback")


def test_header_and_uri_overflows_answer_in_openai_format(fleet_clean: Gateway) -> None:
    url = fleet_clean.url + "/v1/chat/completions"
    big_header = requests.post(url, data="{}", headers={"Content-Type": "application/json", "X-Big": "a" * 9000},
                               timeout=10)
    assert big_header.status_code == 400
    assert big_header.json()["error"]["code"] == "request_header_too_large"
    long_uri = requests.post(url + "?x=" + "a" * 9000, data="{}", headers={"Content-Type": "application/json"},
                             timeout=10)
    assert long_uri.status_code == 414
    assert long_uri.json()["error"]["code"] == "uri_too_long"
