"""A scriptable OpenAI-compatible upstream for failure tests: the engine that misbehaves on demand.

The simulator (``kvgate sim``) behaves like a healthy vLLM replica; this mock is its
counterpart for the cases a real fleet produces and a simulator should not: a node that
cuts a stream, resets the connection, stalls, sends an SSE error event, answers 500 to
everything, returns incomplete bodies, or checks an API key like ``vllm serve --api-key``.
It runs in the test process (a ``ThreadingHTTPServer`` on a free loopback port), logs
every request it receives (:attr:`MockEngine.requests`) and puts a unique nonce in every
completion it generates, so a test can tell "the engine computed this" from "the cache
replayed that".

Behaviour is a :class:`Behaviour`: the default (:attr:`MockEngine.default`) applies to
every request unless one is queued with :meth:`MockEngine.script` (first in, first out,
one per completion request). ``/health`` answers ``health_status``; ``/metrics`` is 404
unless ``metrics=True`` (then vLLM's ``num_requests_running`` / ``num_requests_waiting``
gauges with the mock's own in-flight count), so by default it is "a plain OpenAI server"
(TGI, llama.cpp, …) whose engine figures cannot be read.

It has the ``node_id`` / ``url`` / ``alive()`` / ``stop()`` shape of
:class:`gwfixtures.Sim`, so ``make_policy`` and ``start_gateway`` take a list of mocks
as they take simulators.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import pytest

MODEL = "m"


@dataclass
class Behaviour:
    """How the mock answers one completion request.

    Attributes:
        status: HTTP status of the answer; anything but 200 sends an OpenAI error body
            (``server_error`` for 5xx) unless ``raw`` is given.
        raw: bytes sent as the whole body (``Content-Type: application/json`` unless
            ``content_type`` says otherwise), for odd bodies.
        content_type: Content-Type of a ``raw`` body.
        finish_reason: each choice's ``finish_reason``; None leaves it null (non-streaming)
            or never sends it (streaming).
        choices: number of choices; 0 answers ``"choices": []``.
        reasoning: a ``reasoning_content`` (and ``reasoning``) text carried next to the
            content, as reasoning models served by vLLM send it.
        chunks: content pieces of a streamed answer (the nonce is in the first).
        chunk_delay_s: pause before each streamed piece.
        stall_s: pause before anything is sent (headers included).
        cut_after: a stream is closed (no terminating chunk, no ``[DONE]``) after this
            many content pieces.
        pause_after: a stream pauses ``pause_s`` after this many content pieces (a node that
            goes silent mid-stream).
        pause_s: length of that pause.
        reset: the connection is reset (TCP RST) after the request is read, nothing sent.
        sse_error: after the first piece, an SSE ``error`` event is sent, then ``[DONE]``.
        usage: include ``usage`` (always for JSON; for streams when the client asked with
            ``stream_options.include_usage``).
    """

    status: int = 200
    raw: bytes | None = None
    content_type: str = "application/json"
    finish_reason: str | None = "stop"
    choices: int = 1
    reasoning: str | None = None
    chunks: int = 3
    chunk_delay_s: float = 0.0
    stall_s: float = 0.0
    cut_after: int | None = None
    pause_after: int | None = None
    pause_s: float = 0.0
    reset: bool = False
    sse_error: bool = False
    usage: bool = True


@dataclass
class Received:
    """One request as the mock saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float


@dataclass
class MockEngine:
    node_id: str
    port: int = 0
    api_key: str | None = None
    metrics: bool = False
    health_status: int = 200
    default: Behaviour = field(default_factory=Behaviour)
    requests: list[Received] = field(default_factory=list)
    nonces: list[str] = field(default_factory=list)
    inflight: int = 0
    _queue: list[Behaviour] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Sim-like surface
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self._server is not None

    def start(self) -> "MockEngine":
        engine = self

        class Handler(_Handler):
            mock = engine

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"mock-{self.node_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ scripting
    def script(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next completion requests, one each, in order."""
        with self._lock:
            self._queue.extend(behaviours)

    def set(self, **changes: Any) -> None:
        """Change the default behaviour (``mock.set(status=500)``)."""
        self.default = replace(self.default, **changes)

    def completions(self) -> list[Received]:
        """The completion requests received (chat and legacy)."""
        return [r for r in self.requests if r.path.split("?", 1)[0].endswith("completions")]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.nonces.clear()
            self._queue.clear()

    def _next(self) -> Behaviour:
        with self._lock:
            return self._queue.pop(0) if self._queue else self.default


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: headers and body go out in two writes; with Nagle the body waits for
    # the peer's delayed ACK, 40 ms on every keep-alive request through nginx
    disable_nagle_algorithm = True
    mock: MockEngine

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    # ------------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        err = {"error": {"message": message, "type": type_, "param": None, "code": code}}
        self._send(status, json.dumps(err).encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST instead of FIN
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802
        m = self.mock
        if self.path == "/health":
            self._send(m.health_status, b"" if m.health_status == 200 else b"unhealthy", "text/plain")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
        elif self.path == "/metrics" and m.metrics:
            text = (f'vllm:num_requests_running{{model_name="{MODEL}"}} {m.inflight}\n'
                    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n')
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._error(404, f"Not found: {self.path}", "NotFoundError")

    def do_POST(self) -> None:  # noqa: N802
        m = self.mock
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw
        with m._lock:
            m.requests.append(Received("POST", self.path, {k.lower(): v for k, v in self.headers.items()},
                                       body, time.time()))
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(404, f"Not found: {self.path}", "NotFoundError")
            return
        if m.api_key is not None and self.headers.get("Authorization") != f"Bearer {m.api_key}":
            self._error(401, "Invalid API key", "invalid_request_error", "invalid_api_key")
            return
        b = m._next()
        with m._lock:
            m.inflight += 1
        try:
            self._complete(b, body if isinstance(body, dict) else {}, chat=path == "/v1/chat/completions")
        finally:
            with m._lock:
                m.inflight -= 1

    def _complete(self, b: Behaviour, body: dict, chat: bool) -> None:
        m = self.mock
        if b.stall_s:
            time.sleep(b.stall_s)
        if b.reset:
            self._reset()
            return
        if b.raw is not None:
            self._send(b.status, b.raw, b.content_type)
            return
        if b.status != 200:
            self._error(b.status, f"mock {m.node_id} answers {b.status}",
                        "server_error" if b.status >= 500 else "invalid_request_error")
            return
        nonce = uuid.uuid4().hex
        with m._lock:
            m.nonces.append(nonce)
        text = f"answer {nonce} from {m.node_id}"
        usage = {"prompt_tokens": 7, "completion_tokens": b.chunks, "total_tokens": 7 + b.chunks,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        base = {"id": f"cmpl-{nonce}", "created": int(time.time()), "model": body.get("model", MODEL)}
        if body.get("stream") is True:
            self._stream(b, body, chat, base, nonce, usage)
            return
        choices = []
        for i in range(b.choices):
            c: dict[str, Any] = {"index": i, "finish_reason": b.finish_reason, "logprobs": None}
            if chat:
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if b.reasoning is not None:
                    msg["reasoning_content"] = b.reasoning
                    msg["reasoning"] = b.reasoning
                c["message"] = msg
            else:
                c["text"] = text
            choices.append(c)
        out = {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices}
        if b.usage:
            out["usage"] = usage
        self._send(200, json.dumps(out).encode())

    def _stream(self, b: Behaviour, body: dict, chat: bool, base: dict, nonce: str, usage: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], **extra: Any) -> None:
            self._chunk(b"data: " + json.dumps({**base, "object": obj, "choices": choices, **extra}).encode()
                        + b"\n\n")

        def piece(i: int, text: str, first: bool) -> dict:
            if not chat:
                return {"index": i, "text": text, "finish_reason": None, "logprobs": None}
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
                if b.reasoning is not None:
                    delta["reasoning_content"] = b.reasoning
                    delta["reasoning"] = b.reasoning
            return {"index": i, "delta": delta, "finish_reason": None, "logprobs": None}

        try:
            for k in range(b.chunks):
                if b.chunk_delay_s:
                    time.sleep(b.chunk_delay_s)
                text = f"answer {nonce} from {self.mock.node_id}" if k == 0 else f" part{k}"
                event([piece(i, text, k == 0) for i in range(b.choices)])
                if b.pause_after is not None and k + 1 == b.pause_after:
                    time.sleep(b.pause_s)
                if b.cut_after is not None and k + 1 >= b.cut_after:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if b.sse_error and k == 0:
                    err = {"error": {"message": "mock engine error mid-stream", "type": "server_error",
                                     "param": None, "code": None}}
                    self._chunk(b"data: " + json.dumps(err).encode() + b"\n\n")
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                    return
            if b.finish_reason is not None:
                fin = ({"index": i, "delta": {}, "finish_reason": b.finish_reason, "logprobs": None} if chat
                       else {"index": i, "text": "", "finish_reason": b.finish_reason, "logprobs": None}
                       for i in range(b.choices))
                event(list(fin))
            so = body.get("stream_options")
            if b.usage and isinstance(so, dict) and so.get("include_usage") is True:
                event([], usage=usage)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True


def start_mock_engines(n: int, prefix: str = "n", **kw: Any) -> list[MockEngine]:
    """Start ``n`` mocks named ``<prefix>1..n`` (keyword arguments go to each)."""
    return [MockEngine(f"{prefix}{i + 1}", **kw).start() for i in range(n)]


@pytest.fixture
def start_mocks() -> Iterator[Callable[..., list[MockEngine]]]:
    """Factory fixture: ``start_mocks(n, prefix="n", **MockEngine kwargs)``; all stopped at teardown."""
    started: list[MockEngine] = []

    def factory(n: int = 1, prefix: str = "n", **kw: Any) -> list[MockEngine]:
        mocks = start_mock_engines(n, prefix, **kw)
        started.extend(mocks)
        return mocks

    yield factory
    for m in started:
        m.stop()
