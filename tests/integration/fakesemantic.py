"""A small stand-in for the semantic service (``kvgate semantic``) speaking the gateway's protocol
(/tmp contract: POST /lookup, /insert, /invalidate; GET /health) over a unix socket, for the
gateway's tests: it records every request, "embeds" by string similarity (difflib's ratio over
lowercased words), has a number guard like the real one's, and can be made slow or stopped."""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import socketserver
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, _norm(a), _norm(b)).ratio()


class FakeSemantic:
    """The fake service on ``unix:<dir>/semantic.sock`` (dir and socket open to nginx's workers)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-semfake-"))
        os.chmod(self.dir, 0o755)
        self.path = self.dir / "semantic.sock"
        self.listen = f"unix:{self.path}"
        self.requests: list[tuple[str, dict]] = []
        self.entries: list[dict] = []  # the inserts
        self.static: dict[str, str] = {}  # normalised question -> answer (any static scope)
        self.delay_s = 0.0
        self.reject_as: str | None = None  # the guard name a rejection reports (None: "number")
        self.lock = threading.Lock()
        self.server: socketserver.UnixStreamServer | None = None
        self.conns: list[socket.socket] = []
        self.start()

    # ------------------------------------------------------------------ the protocol
    def lookup(self, q: dict) -> dict:
        best, best_sim = None, 0.0
        if q.get("semantic"):
            for e in self.entries:
                if e["pool"] == q["pool"] and e["scope"] == q["scope"]:
                    s = similarity(e["text"], q["text"])
                    if s > best_sim:
                        best, best_sim = e, s
        out: dict[str, Any] = {"hit": None, "similarity": None, "entry": None, "answer": None, "rejected": None,
                               "ms": 0.1}
        if q.get("static"):
            for question, answer in self.static.items():
                s = similarity(question, q["text"])
                if s >= q["threshold"]:
                    return {**out, "hit": "static", "similarity": round(s, 6), "answer": answer}
        if best is not None and best_sim >= q["threshold"]:
            if re.findall(r"\d+", best["text"]) != re.findall(r"\d+", q["text"]):
                return {**out, "rejected": self.reject_as or "number", "similarity": best_sim}
            return {**out, "hit": "semantic", "similarity": round(best_sim, 6), "entry": best["entry"]}
        return out

    def handle(self, method: str, path: str, body: dict) -> tuple[int, dict | None]:
        with self.lock:
            self.requests.append((path, body))
        if self.delay_s:
            time.sleep(self.delay_s)
        if method == "GET" and path == "/health":
            return 200, {"status": "ok"}
        if path == "/lookup":
            return 200, self.lookup(body)
        if path == "/insert":
            with self.lock:
                self.entries.append(body)
            return 204, None
        if path == "/invalidate":
            with self.lock:
                keep = [e for e in self.entries if not (body.get("tag") and body["tag"] in (e.get("tags") or []))]
                removed = len(self.entries) - len(keep)
                self.entries = keep
            return 200, {"removed": removed}
        return 404, {"error": "not found"}

    # ------------------------------------------------------------------ views
    def calls(self, path: str) -> list[dict]:
        with self.lock:
            return [b for p, b in self.requests if p == path]

    def wait_inserts(self, n: int, timeout: float = 3.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.entries) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.entries) >= n, f"{len(self.entries)} inserts, expected {n}"
        return self.entries

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.entries.clear()
            self.static.clear()
        self.delay_s = 0.0
        self.reject_as = None

    # ------------------------------------------------------------------ server
    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else {}
                status, out = fake.handle(self.command, self.path, body)
                data = json.dumps(out).encode() if out is not None else b""
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the gateway gave up waiting (its timeout) or the fake was stopped
                    self.close_connection = True

            do_POST = _serve
            do_GET = _serve

            def setup(self) -> None:
                super().setup()
                with fake.lock:
                    fake.conns.append(self.request)

            def address_string(self) -> str:
                return "unix"

            def log_message(self, *args: Any) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.path.unlink(missing_ok=True)
        self.server = Server(str(self.path), Handler)
        os.chmod(self.path, 0o666)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        with self.lock:
            # the gateway's pooled connections too: a stopped service answers nothing
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.conns.clear()
        self.path.unlink(missing_ok=True)
