"""When a node's in-flight count ends (kvgate_upstream_inflight, read by least_conn and the
drain): with its answer's last byte, not in the log phase. The log phase runs after the last
bytes were written, and after a lingering close (the client sent more than its request, or
keeps the connection), so a client that sent its next request at once found the node still
busy: under least_conn that request went elsewhere. In fresh-clone suite runs it went to a
node holding a stalled request, waited for proxy_read_timeout (30 s) and marked that node
failed, so every later request skipped it. A client abort neither marks its node failed nor
leaves a count behind. Real nginx (2 workers, least_conn) and mock engines, one stack."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Iterator

import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _wait, make_policy
from mockengine import Behaviour, MockEngine, start_mock_engines

GAUGE = "kvgate_upstream_inflight"


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[MockEngine]]]:
    base = tmp_path_factory.mktemp("inflight-release")
    with ExitStack() as stack:
        mocks = start_mock_engines(2)
        for m in mocks:
            stack.callback(m.stop)
        gw = _start_gateway(base, make_policy(mocks, None, balancer="least_conn", cache={"enabled": False}),
                            mocks, None)
        stack.callback(gw.stop)
        yield gw, mocks


def _body(content: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}).encode()


def _raw(gw: Gateway, content: str, extra: bytes = b"", close: bool = True) -> socket.socket:
    """A request on a raw connection (``extra``: bytes sent after it, which nginx must read
    and drop before it closes: a lingering close)."""
    host, port = gw.listen.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    body = _body(content)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + (b"Connection: close\r\n" if close else b"")
              + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body + extra)
    return s


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and the Content-Length body: the client has the whole answer (the
    connection stays open)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        assert got, buf
        buf += got
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        got = s.recv(65536)
        assert got, rest
        rest += got
    return int(lines[0].split()[1]), headers, rest[:n]


def _gauge(gw: Gateway) -> float:
    return gw.metric_sum(GAUGE)


def _served(gw: Gateway, i: int) -> str:
    r = requests.post(gw.url + "/v1/chat/completions", timeout=10, data=_body(f"next {i}"),
                      headers={"Content-Type": "application/json", "Connection": "close"})
    assert r.status_code == 200, r.text
    return r.headers["X-Kvgate-Node"]


def test_the_count_ends_with_the_answer_not_with_the_connection(lc) -> None:
    gw, _ = lc
    _wait(lambda: _gauge(gw) == 0, 5, "nothing in flight")
    # a client that sent a byte more than its request: nginx answers, then lingers (reads and
    # drops what comes) until the client closes; the log phase runs only then
    s = _raw(gw, "lingering", extra=b"\r\n")
    try:
        status, headers, _ = _read_response(s)
        assert status == 200
        node = headers["x-kvgate-node"]
        s.sendall(b"\r\n")  # more to drop: the lingering close goes on
        # the client has its whole answer: the node holds nothing for it any more
        _wait(lambda: _gauge(gw) == 0, 2, f"{node}'s count released while the connection lingers")
        # so least_conn's ties share the nodes again (each worker alternates them): with the
        # count still held, every request went to the other node
        served = {_served(gw, i) for i in range(8)}
        assert served == {"n1", "n2"}, served
        s.sendall(b"\r\n")
    finally:
        s.close()
    _wait(lambda: _gauge(gw) == 0, 5, "nothing in flight after the close")


def test_a_client_abort_is_no_node_failure_and_leaves_no_count(lc) -> None:
    gw, (n1, n2) = lc
    # the next request to reach either node is held there (no answer yet), then its client goes
    for m in (n1, n2):
        m.clear()
        m.script(Behaviour(stall_s=8))
    held = _raw(gw, "held", close=False)
    try:
        _wait(lambda: n1.inflight + n2.inflight == 1, 5, "the held request at a node")
        holder = n1 if n1.inflight else n2
        assert _gauge(gw) == 1
    finally:
        held.close()  # the client aborts: nginx answers nobody (499) and closes the node's connection
    for m in (n1, n2):
        m.clear()  # the other node's scripted stall goes
    _wait(lambda: _gauge(gw) == 0, 3, "the aborted request's count released")
    # not marked failed (a failure is skipped for 10 s by every worker): both nodes serve, the one
    # that held the aborted request included
    served = {_served(gw, i) for i in range(8)}
    assert holder.node_id in served and served == {"n1", "n2"}, served
    log = gw.nginx.error_log_tail(60)
    assert "upstream timed out" not in log and "upstream prematurely closed" not in log, log
