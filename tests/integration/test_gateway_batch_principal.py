"""The batch principal at the gateway (issue 14; CONTRACT "The batch principal"): the Batch API's
worker sends each line with ``X-Kvgate-Batch`` (signed by :func:`kvgate.batch.records.sign_principal`
with the secret the control plane renders into kvgate.json), instead of a tenant's key. Real nginx,
Redis and a mock engine that shows what it received."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, _stop_all, _wait, make_policy
from kvgate import keys
from kvgate.batch.records import batch_secret, sign_principal
from kvgate.control.apikeys import ApiKeys
from kvgate.control.store import Store
from kvgate.policy.loader import parse_policy
from mockengine import start_mock_engines

pytestmark = pytest.mark.integration

SECRET = batch_secret("test-admin-token")
BATCH = "batch_0123456789abcdef01234567"
PRICES = {"input_usd_per_1m_tokens": 2.0, "cached_input_usd_per_1m_tokens": 0.2, "output_usd_per_1m_tokens": 6.0,
          "batch_discount": 0.5}
P_IN, P_OUT = 2000, 6000  # n$ per token
TENANTS = [{"id": "default"}, {"id": "t1"}, {"id": "t2"}]


@pytest.fixture(scope="module")
def bgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, ApiKeys]]:
    """One mock engine, Redis, a gateway with tenants (auth required), prices and the batch secret."""
    base = tmp_path_factory.mktemp("batchp")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        mocks = start_mock_engines(1, "b")
        stack.callback(_stop_all, mocks)
        data = make_policy(mocks, redis, pool={"prices": PRICES}).model_dump(mode="json")
        data["gateway"].update({"auth": "required"})
        data["tenants"] = TENANTS
        gw = _start_gateway(base, parse_policy(data, "batch-policy"), mocks, redis, batch_secret=SECRET)
        stack.callback(gw.stop)
        yield gw, ApiKeys(Store(redis.url))


def header(line: int = 0, tenant: str = "t1", expires: int | None = None, secret: str = SECRET,
           batch_id: str = BATCH) -> dict[str, str]:
    return {"X-Kvgate-Batch": sign_principal(secret, batch_id, line, tenant,
                                             int(time.time()) + 3600 if expires is None else expires)}


def post(gw: Gateway, headers: dict[str, str], content: str = "hello") -> requests.Response:
    return requests.post(gw.url + "/v1/chat/completions", timeout=30, headers=headers,
                         json={"model": MODEL, "messages": [{"role": "user", "content": content}]})


def entries(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange(keys.LOG_STREAM)]


def entry_for(gw: Gateway, n: int) -> dict[str, str]:
    """The one entry logged after the first ``n - 1`` (the test's only routed request)."""
    _wait(lambda: len(entries(gw)) >= n, 10, f"{n} request-log entries")
    time.sleep(0.2)  # (each worker flushes its own entries: a late one would show here)
    (entry,) = entries(gw)[n - 1:]
    return entry


def test_a_signed_line_is_its_tenants_request_logged_with_its_batch_and_discount(bgw):
    gw, _ = bgw
    mock = gw.sims[0]
    mock.clear()
    n = len(entries(gw))
    value = header(line=7)["X-Kvgate-Batch"]
    r = post(gw, {"X-Kvgate-Batch": value}, "batch line seven")
    assert r.status_code == 200, r.text
    assert len(r.headers["X-Request-Id"]) == 32  # nginx's $request_id, on every answer
    # neither the header nor any credential reaches the engine
    got = mock.completions()[-1].headers
    assert "x-kvgate-batch" not in got and "authorization" not in got
    e = entry_for(gw, n + 1)
    assert (e["tenant"], e["batch"], e["key_id"]) == ("t1", BATCH, "")
    p, c = int(e["prompt"]), int(e["completion"])
    full = p * P_IN + c * P_OUT
    assert (int(e["cost"]), int(e["saved_batch"])) == (full // 2, full - full // 2)
    # the header's value is in no log
    for log in ("error.log", "access.log"):
        path = gw.nginx.prefix / "logs" / log
        assert value not in (path.read_text() if path.exists() else "")


def test_a_key_sent_beside_the_header_does_not_reach_the_engine_and_the_header_wins(bgw):
    gw, keys_ = bgw
    _, secret = keys_.create("t2", "beside")
    mock = gw.sims[0]
    mock.clear()
    n = len(entries(gw))
    r = post(gw, {**header(tenant="t1"), "Authorization": f"Bearer {secret}"}, "both")
    assert r.status_code == 200, r.text
    assert "authorization" not in mock.completions()[-1].headers
    assert entry_for(gw, n + 1)["tenant"] == "t1"


def _refused(r: requests.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    assert "X-Request-Id" in r.headers


@pytest.mark.parametrize("make", [
    lambda: header(secret=batch_secret("another-token")),                      # bad mac
    lambda: header(expires=int(time.time()) - 1),                               # expired
    lambda: header(tenant="ghost"),                                             # unknown tenant
    lambda: header(tenant=""),                                                  # anonymous with auth on
    lambda: {"X-Kvgate-Batch": header()["X-Kvgate-Batch"][:-1] + "0"},         # one hex digit changed
    lambda: {"X-Kvgate-Batch": header()["X-Kvgate-Batch"].replace(".t1.", ".t2.")},  # tenant swapped
    lambda: {"X-Kvgate-Batch": "v1.batch_x.0.t1"},                              # malformed
    lambda: {"X-Kvgate-Batch": ""},                                             # empty
], ids=["bad-mac", "expired", "unknown-tenant", "anonymous", "mac-digit", "tenant-swapped", "malformed", "empty"])
def test_a_bad_header_is_401_and_reaches_no_engine(bgw, make):
    gw, _ = bgw
    mock = gw.sims[0]
    mock.clear()
    _refused(post(gw, make()))
    assert mock.completions() == []


def test_a_bad_header_is_refused_even_with_a_valid_key(bgw):
    gw, keys_ = bgw
    _, secret = keys_.create("t1", "valid")
    _refused(post(gw, {**header(secret=batch_secret("x")), "Authorization": f"Bearer {secret}"}))


def test_batch_lines_are_cached_in_their_tenants_scope(bgw):
    gw, keys_ = bgw
    assert gw.redis is not None
    gw.redis.client().delete(*gw.redis.client().keys("kvgate:resp:*") or ["none"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "cache me"}], "temperature": 0}

    def send(headers: dict[str, str]) -> requests.Response:
        return requests.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)

    assert send(header(line=1)).headers["X-Kvgate-Cache"] == "MISS"
    _wait(lambda: bool(gw.redis.client().keys("kvgate:resp:*")), 5, "the cache entry")
    assert send(header(line=2)).headers["X-Kvgate-Cache"] == "HIT"
    # t1's live clients share it (one tenant, one scope); t2's batch does not
    _, secret = keys_.create("t1", "live")
    assert send({"Authorization": f"Bearer {secret}"}).headers["X-Kvgate-Cache"] == "HIT"
    assert send(header(line=3, tenant="t2")).headers["X-Kvgate-Cache"] == "MISS"


def test_no_secret_refuses_every_header_and_auth_off_takes_the_anonymous_tenant(tmp_path: Path):
    with ExitStack() as stack:
        redis = _start_redis(tmp_path)
        stack.callback(redis.stop)
        mocks = start_mock_engines(1, "o")
        stack.callback(_stop_all, mocks)
        off = _start_gateway(tmp_path, make_policy(mocks, redis), mocks, redis, batch_secret=SECRET)
        stack.callback(off.stop)
        unsigned = _start_gateway(tmp_path, make_policy(mocks, redis), mocks, redis)
        stack.callback(unsigned.stop)
        r = post(off, header(tenant=""))
        assert r.status_code == 200, r.text
        e = entry_for(off, 1)
        assert (e["tenant"], e["batch"]) == ("", BATCH)
        _refused(post(off, header(tenant="t1")))       # auth off: no tenant but the anonymous one
        _refused(post(unsigned, header(tenant="")))    # no batch_secret rendered: refused
        assert post(unsigned, {}).status_code == 200   # and nothing else changes
