"""A small blocking client of the semantic service (tests, ``kvgate bench semantic``, the CLI):
HTTP/1.1 over ``unix:/path`` or ``HOST:PORT``, one keep-alive connection."""

from __future__ import annotations

import http.client
import json
import socket


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class SemanticClient:
    """``call(method, path, body) -> (status, parsed JSON or text)``; ``lookup``/``insert``/
    ``invalidate``/``health`` wrap the protocol. ``timeout`` in seconds."""

    def __init__(self, listen: str, timeout: float = 5.0):
        self.listen, self.timeout = listen, timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.listen.startswith("unix:"):
                self._conn = _UnixConnection(self.listen[5:], self.timeout)
            else:
                host, _, port = self.listen.rpartition(":")
                self._conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.timeout)
        return self._conn

    def call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
        ctype = resp.getheader("Content-Type", "")
        return resp.status, (json.loads(raw) if raw and "json" in ctype else raw.decode())

    def lookup(self, pool: str, scope: str, text: str, threshold: float | None = None,
               static: bool = False, semantic: bool = True) -> dict:
        body = {"pool": pool, "scope": scope, "text": text, "static": static, "semantic": semantic}
        if threshold is not None:
            body["threshold"] = threshold
        status, out = self.call("POST", "/lookup", body)
        if status != 200:
            raise RuntimeError(f"/lookup: {status} {out}")
        return out

    def insert(self, pool: str, scope: str, text: str, entry: str, ttl_s: int | None = None,
               tags: list[str] | None = None) -> None:
        body = {"pool": pool, "scope": scope, "text": text, "entry": entry, "tags": tags or []}
        if ttl_s:
            body["ttl_s"] = ttl_s
        status, out = self.call("POST", "/insert", body)
        if status != 204:
            raise RuntimeError(f"/insert: {status} {out}")

    def invalidate(self, pool: str | None = None, tag: str | None = None) -> int:
        status, out = self.call("POST", "/invalidate", {k: v for k, v in (("pool", pool), ("tag", tag)) if v})
        if status != 200:
            raise RuntimeError(f"/invalidate: {status} {out}")
        return out["removed"]

    def health(self) -> dict:
        return self.call("GET", "/health")[1]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
