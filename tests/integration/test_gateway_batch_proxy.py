"""The Batch API's routes on the client listener (issue 14; CONTRACT "Batch API routing"):
``/v1/files*`` and ``/v1/batches*`` go to the control plane (``control.listen``) as they come,
Authorization included and none of the completions stages run; a control plane that is down is a
503 in OpenAI's format. Real nginx; the control plane is a small recording HTTP server here."""

from __future__ import annotations

import http.client
import json
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Iterator

import pytest
import requests

from gwfixtures import Gateway, _start_gateway, _start_redis, free_port, make_policy
from kvgate.policy.loader import parse_policy
from kvgate.render import MULTIPART_SLACK_BYTES

pytestmark = pytest.mark.integration


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    size: int


@dataclass
class FakeControl:
    """Answers every request 200 with ``{"object": "echo", "path", "bytes"}`` and records it."""

    port: int
    seen: list[Seen] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    def start(self) -> "FakeControl":
        plane = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                size = 0
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while True:
                        n = int(self.rfile.readline().split(b";")[0], 16)
                        if n == 0:
                            self.rfile.readline()
                            break
                        size += len(self.rfile.read(n))
                        self.rfile.readline()
                else:
                    left = int(self.headers.get("Content-Length") or 0)
                    while left:
                        got = len(self.rfile.read(min(left, 1 << 20)))
                        size, left = size + got, left - got
                plane.seen.append(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                       size))
                out = json.dumps({"object": "echo", "path": self.path, "bytes": size}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.send_header("X-Fake-Control", "1")
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, FakeControl]]:
    """A gateway (auth required, no engine needed) whose control.listen is a FakeControl, not started."""
    base = tmp_path_factory.mktemp("bproxy")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        port = free_port()
        # an engine nobody serves: these routes never reach one
        nowhere = SimpleNamespace(node_id="n1", url=f"http://127.0.0.1:{free_port()}")
        data = make_policy([nowhere], redis).model_dump(mode="json")  # type: ignore[list-item]
        data["gateway"]["auth"] = "required"
        data["tenants"] = [{"id": "t1"}]
        data["control"] = {"listen": f"127.0.0.1:{port}"}
        data["batch"] = {"max_file_bytes": MAX_FILE_BYTES}
        gw = _start_gateway(base, parse_policy(data, "proxy-policy"), [], redis)
        stack.callback(gw.stop)
        fake = FakeControl(port)
        stack.callback(fake.stop)
        yield gw, fake


def test_control_plane_down_is_a_503_in_openais_format(proxied):
    gw, fake = proxied
    fake.stop()
    for method, path in (("POST", "/v1/files"), ("GET", "/v1/files/file-abc/content"), ("GET", "/v1/batches"),
                         ("POST", "/v1/batches/batch_x/cancel")):
        r = requests.request(method, gw.url + path, timeout=10, headers={"Authorization": "Bearer kvg-x"})
        assert r.status_code == 503, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["code"], err["type"]) == ("control_plane_unavailable", "server_error")
        assert r.headers["Retry-After"] == "5" and len(r.headers["X-Request-Id"]) == 32


def test_requests_pass_through_with_their_key_and_a_request_id(proxied):
    gw, fake = proxied
    fake.start()
    fake.seen.clear()
    try:
        up = requests.post(gw.url + "/v1/files", timeout=30, headers={"Authorization": "Bearer kvg-tenant-key"},
                           files={"file": ("in.jsonl", b'{"custom_id": "a"}\n' * 100_000)}, data={"purpose": "batch"})
        assert up.status_code == 200, up.text
        assert up.headers["X-Fake-Control"] == "1"
        got = fake.seen[-1]
        assert (got.method, got.path) == ("POST", "/v1/files")
        assert got.headers["authorization"] == "Bearer kvg-tenant-key"  # the control plane checks it
        assert got.headers["x-request-id"] == up.headers["X-Request-Id"]
        assert got.size == int(up.request.headers["Content-Length"]) > 1_900_000
        # a keyless request is the control plane's to refuse (no auth stage ran here)
        listed = requests.get(gw.url + "/v1/batches?limit=2&after=batch_1", timeout=10)
        assert listed.status_code == 200 and listed.json()["path"] == "/v1/batches?limit=2&after=batch_1"
        assert "authorization" not in fake.seen[-1].headers
        gone = requests.delete(gw.url + "/v1/files/file-abc", timeout=10)
        assert gone.status_code == 200 and fake.seen[-1].method == "DELETE"
        # chunked uploads stream through too
        chunked = requests.post(gw.url + "/v1/files", data=iter([b"x" * 65536] * 40), timeout=30)
        assert chunked.status_code == 200 and chunked.json()["bytes"] == 65536 * 40
    finally:
        fake.stop()


MAX_FILE_BYTES = 64 * 1024 * 1024


def _declared(gw: Gateway, path: str, length: int) -> tuple[int, dict]:
    host, port = gw.listen.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Length", str(length))
        conn.putheader("Content-Type", "application/octet-stream")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_size_limits_the_policys_file_limit_for_files_1_mib_for_batches(proxied):
    gw, _ = proxied
    limit = MAX_FILE_BYTES + MULTIPART_SLACK_BYTES  # batch.max_file_bytes + the multipart framing
    status, body = _declared(gw, "/v1/files", limit + 1)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(limit) in body["error"]["message"]
    status, body = _declared(gw, "/v1/batches", 2 * 1024 * 1024)
    assert status == 413 and "1048576" in body["error"]["message"]


def test_other_paths_are_still_the_gateways(proxied):
    gw, _ = proxied
    for path in ("/v1/filesystem", "/v1/batchesx", "/v1/unknown"):
        r = requests.get(gw.url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        assert len(r.headers["X-Request-Id"]) == 32
