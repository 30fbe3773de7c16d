"""Tenants and API keys at the gateway (issue 12 items 1, 6, 8): real nginx, real Redis, real
simulators; keys made by the control plane's own store (kvgate.control.apikeys)."""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from gwfixtures import (MODEL, Gateway, _start_gateway, _start_redis, _start_sims, _stop_all, make_policy,
                        wait_cached)
from kvgate.control.apikeys import ApiKeys
from kvgate.control.store import Store
from kvgate.policy.loader import parse_policy

pytestmark = pytest.mark.integration

TENANTS = [
    {"id": "default", "name": "Anyone"},
    {"id": "t1"},
    {"id": "t2"},
    {"id": "nomodels", "models": []},
]


def tenant_policy(sims, redis, auth: str = "optional", **gateway):
    data = make_policy(sims, redis).model_dump(mode="json")
    data["gateway"].update({"auth": auth, "auth_cache_ttl_s": 1, **gateway})
    data["tenants"] = TENANTS
    return parse_policy(data, "tenant-policy")


@pytest.fixture(scope="module")
def tgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, ApiKeys]]:
    base = tmp_path_factory.mktemp("tenants")
    from contextlib import ExitStack

    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(2, base)
        stack.callback(_stop_all, sims)
        gw = _start_gateway(base, tenant_policy(sims, redis), sims, redis)
        stack.callback(gw.stop)
        yield gw, ApiKeys(Store(redis.url))


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def error_of(r: requests.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_keyless_requests_are_the_default_tenants_and_keys_their_own(tgw):
    gw, keys = tgw
    r = gw.chat("hello from nobody", max_tokens=4)
    assert r.status_code == 200, r.text
    _, secret = keys.create("t1", "ci")
    r = gw.chat("hello from t1", max_tokens=4, headers=bearer(secret))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("header", [
    "Bearer kvg-not-a-key-at-all",          # unknown
    "Basic dXNlcjpwYXNz",                   # another scheme
    "Bearer",                               # no token
    "Bearer " + "a" * 6_000,                # a 6 kB key (past 8 kB nginx answers 400, below)
    "Bearer two tokens",
])
def test_bad_keys_get_401_invalid_api_key_without_the_key_echoed(tgw, header):
    gw, _ = tgw
    r = requests.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}]}, headers={"Authorization": header}, timeout=10)
    assert r.status_code == 401, r.text
    err = error_of(r)
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    if " " in header:
        token = header.split(" ", 1)[1]
        assert token[:20] not in r.text


def test_a_10_kb_authorization_header_gets_nginxs_400_in_openais_format(tgw):
    gw, _ = tgw
    r = gw.chat("x", headers={"Authorization": "Bearer " + "a" * 10_000})
    assert r.status_code == 400 and error_of(r)["code"] == "request_header_too_large"


def test_a_key_of_a_tenant_the_policy_no_longer_has_is_refused(tgw):
    gw, keys = tgw
    _, secret = keys.create("gone")  # no policy check here: as if the tenant was removed since
    r = gw.chat("x", max_tokens=4, headers=bearer(secret))
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


def _raw_post(gw: Gateway, headers: list[tuple[str, bytes]]) -> tuple[int, bytes]:
    host, port = gw.listen.rsplit(":", 1)
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_non_ascii_and_repeated_authorization_headers_are_refused(tgw):
    gw, keys = tgw
    _, secret = keys.create("t1")
    status, body = _raw_post(gw, [("Authorization", "Bearer kvg-\xe9\xe9".encode("latin-1"))])
    assert status == 401 and b'"invalid_api_key"' in body, body
    # nginx itself refuses a repeated Authorization header (400, in OpenAI's format)
    status, body = _raw_post(gw, [("Authorization", f"Bearer {secret}".encode())] * 2)
    assert status in (400, 401) and b'"code"' in body and secret.encode() not in body, body


def test_a_key_in_the_query_string_is_refused_and_never_logged(tgw):
    gw, keys = tgw
    _, secret = keys.create("t1")
    encoded = "k%76g" + secret[3:]  # percent-encoded "v": the same key once decoded
    for query in (f"api_key={secret}", f"x=1&key={secret}", f"q={secret}", f"q={encoded}", "api%5Fkey=x"):
        r = requests.post(gw.url + "/v1/chat/completions?" + query, json={"model": MODEL, "messages": [
            {"role": "user", "content": "x"}]}, headers=bearer(secret), timeout=10)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", r.text
        assert "query string" in error_of(r)["message"] and secret not in r.text
    time.sleep(1.2)  # the access log is flushed every second
    prefix = Path(gw.nginx.prefix)
    for log in (prefix / "logs").glob("*.log"):
        assert secret not in log.read_text(errors="replace"), log


def test_a_revoked_key_is_refused_within_the_cache_ttl(tgw):
    gw, keys = tgw
    rec, secret = keys.create("t2", "to revoke")
    assert gw.chat("before revoke", max_tokens=4, headers=bearer(secret)).status_code == 200
    keys.revoke(rec.id)
    deadline = time.monotonic() + 5
    while True:
        r = gw.chat("after revoke", max_tokens=4, headers=bearer(secret))
        if r.status_code == 401 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 401 and "revoked" in error_of(r)["message"], r.text
    # auth_cache_ttl_s is 1 here: well within the 5 s above (each worker forgets in 1 s)


def test_a_tenant_never_receives_another_tenants_cached_answer(tgw):
    gw, keys = tgw
    gw.redis.client().flushdb()
    _, s1 = keys.create("t1")
    _, s2 = keys.create("t2")
    body = {"temperature": 0, "max_tokens": 8, "seed": 7}
    r1 = gw.chat("the same cacheable question", headers=bearer(s1), **body)
    assert r1.status_code == 200 and r1.headers["X-Kvgate-Cache"] == "MISS"
    wait_cached(gw, 1)
    r2 = gw.chat("the same cacheable question", headers=bearer(s2), **body)
    assert r2.status_code == 200 and r2.headers["X-Kvgate-Cache"] == "MISS", "t2 got t1's answer"
    assert r2.json()["id"] != r1.json()["id"]
    resp_keys = sorted(k.decode() for k in wait_cached(gw, 2))
    assert len(resp_keys) == 2 and any(":t.t1:" in k for k in resp_keys) and any(":t.t2:" in k for k in resp_keys)
    r1b = gw.chat("the same cacheable question", headers=bearer(s1), **body)
    assert r1b.headers["X-Kvgate-Cache"] == "HIT" and r1b.json()["id"] == r1.json()["id"]
    # two keys of one tenant share its entries
    _, s1b = keys.create("t1", "second key")
    r1c = gw.chat("the same cacheable question", headers=bearer(s1b), **body)
    assert r1c.headers["X-Kvgate-Cache"] == "HIT"


def test_a_model_the_tenant_may_not_use_reads_as_unknown(tgw):
    gw, keys = tgw
    _, secret = keys.create("nomodels")
    r = gw.chat("x", headers=bearer(secret))
    unknown = requests.post(gw.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": [
        {"role": "user", "content": "x"}]}, timeout=10)
    assert r.status_code == 404 and unknown.status_code == 404
    assert error_of(r)["code"] == "model_not_found"
    assert error_of(r)["message"].replace("`m`", "`X`") == error_of(unknown)["message"].replace("`no-such-model`", "`X`")
    models = requests.get(gw.url + "/v1/models", headers=bearer(secret), timeout=10).json()
    assert models["data"] == []
    assert [m["id"] for m in requests.get(gw.url + "/v1/models", timeout=10).json()["data"]] == [MODEL]


def test_the_openai_sdk_works_with_a_tenant_key(tgw):
    openai = pytest.importorskip("openai")
    gw, keys = tgw
    _, secret = keys.create("t1", "sdk")
    client = openai.OpenAI(api_key=secret, base_url=gw.url + "/v1", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content
    bad = openai.OpenAI(api_key="kvg-wrong", base_url=gw.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_required_auth_and_redis_down(tmp_path: Path):
    """auth: required refuses keyless requests; with Redis stopped, a key the gateway saw valid
    keeps working (auth_stale_s) in every worker, also one that never saw it (kvgate_auth), and a
    key never seen gets 503 auth_unavailable, never a 5xx from nginx."""
    redis = _start_redis(tmp_path)
    sims = _start_sims(1, tmp_path)
    gw = None
    try:
        # four workers: the key below is seen by one of them only
        gw = _start_gateway(tmp_path, tenant_policy(sims, redis, auth="required", worker_processes=4), sims, redis)
        keys = ApiKeys(Store(redis.url))
        _, seen = keys.create("t1")
        _, unseen = keys.create("t1")
        r = gw.chat("no key", max_tokens=4)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert gw.chat("seen", max_tokens=4, headers=bearer(seen)).status_code == 200
        redis.stop()
        time.sleep(1.2)  # past auth_cache_ttl_s: the workers must ask Redis again
        for _ in range(16):  # each on a new connection: spread over the workers
            r = gw.chat("still served", max_tokens=4, headers=bearer(seen))
            assert r.status_code == 200, r.text
        r = gw.chat("never seen", max_tokens=4, headers=bearer(unseen))
        assert r.status_code == 503 and error_of(r)["code"] == "auth_unavailable" and r.headers["Retry-After"]
    finally:
        if gw:
            gw.stop()
        _stop_all(sims)
        redis.stop()


def test_the_tenant_is_in_the_request_log_and_the_metrics(tgw):
    gw, keys = tgw
    _, secret = keys.create("t2", "log")
    assert gw.chat("counted for t2", max_tokens=4, headers=bearer(secret)).status_code == 200
    assert gw.chat("counted for default", max_tokens=4).status_code == 200
    gw.wait_metric("kvgate_requests_total", gw.metric_sum("kvgate_requests_total", tenant="t2"), tenant="t2")
    assert gw.metric_sum("kvgate_requests_total", tenant="t2") >= 1
    assert gw.metric_sum("kvgate_requests_total", tenant="default") >= 1
    client = gw.redis.client()
    deadline = time.monotonic() + 5
    tenants: set[str] = set()
    while time.monotonic() < deadline and not {"t2", "default"} <= tenants:
        tenants = {fields.get(b"tenant", b"").decode() for _, fields in client.xrange("kvgate:log")}
        time.sleep(0.1)
    assert {"t2", "default"} <= tenants, tenants


def test_the_client_listener_does_not_show_the_tenants_metrics(tgw):
    """/metrics names every tenant (and its tokens and cost): with auth on, the client listener
    answers 404 in OpenAI's format; the internal listener (loopback only) serves it."""
    gw, _ = tgw
    assert gw.chat("one request", max_tokens=4).status_code == 200
    r = requests.get(gw.url + "/metrics", timeout=5)
    assert r.status_code == 404, r.text[:200]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "kvgate_requests_total" not in r.text
    assert gw.metric_sum("kvgate_requests_total", tenant="default") >= 1  # the internal listener's


def test_public_metrics_can_be_turned_on_and_defaults_to_auth_off():
    from kvgate.policy.loader import parse_policy_text

    base = "pools: [{name: p, models: [m], nodes: [{id: n1, url: 'http://127.0.0.1:8101'}]}]\n"
    assert parse_policy_text(base).public_metrics
    assert not parse_policy_text(base + "gateway: {auth: optional}\ntenants: [{id: default}]\n").public_metrics
    assert parse_policy_text(base + "gateway: {auth: optional, public_metrics: true}\n"
                             "tenants: [{id: default}]\n").public_metrics
