"""The push client of the gateway's dynamic config (kvgate.gateway.dynamic): the secret file, the
wire shapes and how each failure reads. The gateway's side (lua/kvgate/config_api.lua) is tested
against real nginx in tests/integration/test_control_dynamic.py; here a stub answers as it does."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from socketserver import UnixStreamServer

import pytest

from kvgate.gateway import dynamic


class _Stub(BaseHTTPRequestHandler):
    answers: list[tuple[int, bytes]] = []
    seen: list[dict] = []

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.seen.append({"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                          "body": self.rfile.read(n) if n else b""})
        status, body = self.answers.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *_a) -> None:
        pass

    def address_string(self) -> str:  # a unix socket has no (host, port)
        return "stub"


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    _Stub.answers, _Stub.seen = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_secret_is_created_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "push.secret"
    first = dynamic.ensure_secret(path)
    assert len(first) == 64 and int(first, 16) >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert dynamic.ensure_secret(path) == first
    assert dynamic.secret_sha256(first) == __import__("hashlib").sha256(first.encode()).hexdigest()
    path.write_text("\n")
    with pytest.raises(ValueError, match="no push secret"):
        dynamic.ensure_secret(path)


def test_push_sends_the_document_with_the_secret(stub: str) -> None:
    _Stub.answers = [(200, b'{"version": 7, "digest": "abc"}')]
    doc = {"pools": {"p": {"balancer": "chash", "nodes": {"a": {"weight": 100, "state": "active"}}}},
           "cache": {"namespace_version": 1}}
    assert dynamic.push(stub, "s3cret", doc) == (7, "abc")
    seen = _Stub.seen[0]
    assert (seen["method"], seen["path"], seen["auth"]) == ("POST", "/kvgate/config", "Bearer s3cret")
    assert json.loads(seen["body"]) == doc


def test_current_reads_the_runtime_in_force(stub: str) -> None:
    answer = {"version": 3, "digest": "d", "runtime": {"pools": {}, "cache": {"namespace_version": 1}}, "loads": 2}
    _Stub.answers = [(200, json.dumps(answer).encode())]
    assert dynamic.current(stub, "s") == answer
    assert _Stub.seen[0]["method"] == "GET" and _Stub.seen[0]["auth"] == "Bearer s"


def test_a_refused_document_names_the_field(stub: str) -> None:
    _Stub.answers = [(400, json.dumps({"error": {"message": "weight must be an integer >= 0", "type":
                                                 "invalid_request_error", "param": "pools.p.nodes.a.weight"}}).encode())]
    with pytest.raises(dynamic.PushRefused, match=r"400: weight must be an integer >= 0 \(at pools\.p\.nodes\.a\.weight\)") as info:
        dynamic.push(stub, "s", {"pools": {}})
    assert info.value.status == 400 and info.value.param == "pools.p.nodes.a.weight"


def test_a_wrong_secret_and_odd_answers_are_refusals(stub: str) -> None:
    _Stub.answers = [(401, b'{"error": {"message": "bad credentials", "type": "authentication_error"}}'),
                     (502, b"<html>bad gateway</html>"), (200, b'{"ok": true}')]
    with pytest.raises(dynamic.PushRefused, match="401: bad credentials"):
        dynamic.push(stub, "wrong", {})
    with pytest.raises(dynamic.PushRefused, match="502: <html>bad gateway"):
        dynamic.push(stub, "s", {})
    with pytest.raises(dynamic.PushRefused, match="without version/digest"):
        dynamic.push(stub, "s", {})


def test_nothing_listening_is_unreachable_quickly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(dynamic.GatewayUnreachable, match=f"127.0.0.1:{port}"):
        dynamic.push(f"127.0.0.1:{port}", "s", {}, timeout=0.5)


def test_silent_gateway_times_out() -> None:
    with socket.socket() as s:  # accepts (backlog), never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(dynamic.GatewayUnreachable, match="timed out"):
            dynamic.current(f"127.0.0.1:{s.getsockname()[1]}", "s", timeout=0.3)


def test_unix_socket_listener(tmp_path: Path) -> None:
    class Server(UnixStreamServer, HTTPServer):
        def server_bind(self) -> None:  # HTTPServer's would read a (host, port)
            UnixStreamServer.server_bind(self)
            self.server_name, self.server_port = "localhost", 0

    path = str(tmp_path / "internal.sock")
    server = Server(path, _Stub)
    _Stub.answers, _Stub.seen = [(200, b'{"version": 1, "digest": "x"}')], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert dynamic.push(f"unix:{path}", "s", {}) == (1, "x")
    finally:
        server.shutdown()
        server.server_close()


def test_bad_listen_address() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        dynamic.push("nowhere", "s", {})
