"""What nginx itself refuses before any Lua runs is answered in OpenAI's format too (issue 9,
item 8): HTTP/2+ on the HTTP/1.1 listener (505), an unknown Transfer-Encoding (501), TRACE
(405) and a direct request to one of the gateway's internal error locations (404)."""

from __future__ import annotations

import json
import socket

import pytest

from gwfixtures import Gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from contextlib import ExitStack

    from gwfixtures import _start_gateway, make_policy
    from mockengine import start_mock_engines

    base = tmp_path_factory.mktemp("nginx-errors")
    with ExitStack() as stack:
        mocks = start_mock_engines(1, "e")
        stack.callback(mocks[0].stop)
        g = _start_gateway(base, make_policy(mocks, None, cache={"enabled": False}), mocks, None)
        stack.callback(g.stop)
        yield g


def _exchange(gw: Gateway, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = gw.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            if n == 0:
                break
            out, body = out + rest[:n], rest[n + 2:]
        body = out
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("raw, status, code", [
    (b"POST /v1/chat/completions HTTP/2.0\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}", 505,
     "http_version_not_supported"),
    (b"POST /v1/chat/completions HTTP/9.9\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}", 505,
     "http_version_not_supported"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: gzip\r\n\r\n", 501,
     "unsupported_transfer_encoding"),
    (b"TRACE /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n\r\n", 405, "method_not_allowed"),
    (b"GET /kvgate/errors/400 HTTP/1.1\r\nHost: gw\r\n\r\n", 404, "not_found"),
    (b"GET /kvgate/errors/status?x=1 HTTP/1.1\r\nHost: gw\r\n\r\n", 404, "not_found"),
], ids=["http2", "http9.9", "te-gzip", "trace", "internal-400", "internal-status"])
def test_nginx_own_refusals_are_openai_json(gw: Gateway, raw: bytes, status: int, code: str) -> None:
    got, headers, body = _exchange(gw, raw)
    assert got == status, body
    assert headers["content-type"].startswith("application/json"), (headers, body)
    err = json.loads(body)["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"], err
    if code == "not_found":
        assert err["message"].startswith("Unknown path /kvgate/errors/") and "?" not in err["message"]
    assert gw.sims[0].completions() == []


def test_metrics_and_health_requests_leave_no_warning_in_the_error_log(gw: Gateway) -> None:
    # the log phase runs for every location and reads $kvgate_ctx, which only the completions
    # location sets: a scrape every few seconds must not write a warning line each time
    import requests

    for path in ("/metrics", "/kvgate/health", "/v1/models", "/nowhere"):
        requests.get(gw.url + path, timeout=5)
    internal = gw.policy.gateway.internal_listen
    requests.get(f"http://{internal}/metrics", timeout=5)
    log = (gw.nginx.prefix / "logs" / "error.log").read_text()
    assert "uninitialized" not in log, log[-2000:]
