"""Push client of the gateway's dynamic config (ingress-nginx's ``configuration.lua`` shape).

The control plane sends the runtime — per pool its balancer, per node its nginx-scale weight
and state, the cache namespace version (:func:`kvgate.render.runtime_document`) — to the
gateway's loopback-only internal listener (``gateway.internal_listen``); ``lua/kvgate/config_api.lua``
validates it, stores it in the ``kvgate_config`` shared dict with a new version, and every worker
picks it up within 0.2 s. No reload, no connection closed, no stream cut.

Wire contract (``lua/kvgate/config_api.lua`` implements the other end):

``POST /kvgate/config`` with the document as JSON and ``Authorization: Bearer <secret>``
    200 ``{"version": N, "digest": "<sha256 hex of the stored body>"}``;
    400 ``{"error": {"message", "type", "param": "pools.p1.nodes.n2.weight"}}`` for a document
    the gateway refuses (the runtime in force stays); 401 without the secret.
``GET /kvgate/config`` (same header)
    ``{"version": N, "digest": "...", "runtime": {...}, "loads": <config loads since start>}``;
    ``loads`` counts ``init_by_lua`` runs, so it rises by one at every nginx reload.

The secret lives in ``<prefix>/conf/push.secret`` (:func:`ensure_secret`; 0600, created once and
kept across reloads); kvgate.json carries only its sha256 (``internal.push_secret_sha256``).
Timeouts are short (loopback): a gateway that does not answer within ``timeout`` seconds is
reported down, never waited on.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_PATH = "/kvgate/config"
TIMEOUT_S = 2.0
"""Connect + answer timeout of one call (seconds): a loopback listener answers in milliseconds."""


class PushError(RuntimeError):
    """A call to the internal listener failed; the runtime in force on the gateway is unchanged.

    Attributes:
        status: the HTTP status when the gateway answered, else None.
        param: the path of the refused field (``pools.p1.nodes.n2.weight``) when the gateway named one.
    """

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class GatewayUnreachable(PushError):
    """Nothing answered on the internal listener (nginx down, another address, a timeout)."""


class PushRefused(PushError):
    """The gateway answered with an error: the document (400, ``param`` names the field) or the
    secret (401) was refused."""


def secret_sha256(secret: str) -> str:
    """sha256 hex of the push secret, as kvgate.json's ``internal.push_secret_sha256`` holds it."""
    return hashlib.sha256(secret.encode()).hexdigest()


def ensure_secret(path: Path) -> str:
    """The push secret in ``path``, created (64 hex digits from :mod:`secrets`, mode 0600) if the
    file does not exist yet. It is kept as long as the file is: a reload keeps the secret.

    Raises:
        OSError: the file cannot be created or read.
        ValueError: the file exists but holds no secret (empty or not one line of text).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    text = path.read_text().strip()
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"{path} holds no push secret (delete it: a new one is created at the next reload)")
    return text


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _connection(internal_listen: str, timeout: float) -> http.client.HTTPConnection:
    if internal_listen.startswith("unix:"):
        return _UnixConnection(internal_listen[5:], timeout)
    host, sep, port = internal_listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"internal listener {internal_listen!r}: expected HOST:PORT or unix:/path")
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


def _request(internal_listen: str, method: str, path: str, headers: dict[str, str], body: bytes | None,
             timeout: float) -> tuple[int, bytes]:
    """One HTTP exchange with the internal listener: (status, body). Raises GatewayUnreachable."""
    conn = _connection(internal_listen, timeout)
    try:
        conn.request(method, path, body=body, headers={**headers, "Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        raise GatewayUnreachable(f"gateway internal listener {internal_listen}: {method} {path} failed: "
                                 f"{exc or type(exc).__name__}") from None
    finally:
        conn.close()


def _call(internal_listen: str, secret: str, method: str, body: bytes | None, timeout: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {secret}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    status, raw = _request(internal_listen, method, CONFIG_PATH, headers, body, timeout)
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if status != 200 or not isinstance(answer, dict):
        err = (answer or {}).get("error") if isinstance(answer, dict) else None
        if isinstance(err, dict) and err.get("message"):
            param = err.get("param")
            where = f" (at {param})" if param else ""
            raise PushRefused(f"gateway refused {method} {CONFIG_PATH} with {status}: {err['message']}{where}",
                              status=status, param=param if isinstance(param, str) else None)
        text = raw[:300].decode(errors="replace").strip()
        raise PushRefused(f"gateway answered {method} {CONFIG_PATH} with {status}: {text or '(empty)'}", status=status)
    return answer


def get_text(internal_listen: str, path: str, timeout: float = TIMEOUT_S) -> str:
    """``GET path`` on the internal listener (HOST:PORT or ``unix:/path``; no secret: ``/metrics``,
    ``/kvgate/health``), the body as text. Raises :class:`GatewayUnreachable` (also for a status
    other than 200) or ``ValueError`` (a bad address)."""
    status, raw = _request(internal_listen, "GET", path, {}, None, timeout)
    if status != 200:
        raise GatewayUnreachable(f"gateway internal listener {internal_listen}: GET {path} answered {status}")
    return raw.decode("utf-8", errors="replace")


def push(internal_listen: str, secret: str, doc: Mapping[str, Any] | str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """Send a runtime document (a dict, or its JSON text from :func:`kvgate.render.runtime_json`)
    to ``POST /kvgate/config``. Returns ``(version, digest)`` the gateway stored it under.

    Raises:
        GatewayUnreachable: nothing answered within ``timeout`` s.
        PushRefused: the gateway refused the document (``param`` names the field) or the secret.
        ValueError: ``internal_listen`` is not HOST:PORT or unix:/path.
    """
    body = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, separators=(",", ":"))
    answer = _call(internal_listen, secret, "POST", body.encode(), timeout)
    version, digest = answer.get("version"), answer.get("digest")
    if not isinstance(version, int) or not isinstance(digest, str):
        raise PushRefused(f"gateway answered POST {CONFIG_PATH} without version/digest: {answer!r:.200}", status=200)
    return version, digest


def current(internal_listen: str, secret: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """The runtime in force: ``{"version": int, "digest": str, "runtime": dict, "loads": int}``
    from ``GET /kvgate/config``. Raises like :func:`push`."""
    answer = _call(internal_listen, secret, "GET", None, timeout)
    if not isinstance(answer.get("version"), int) or not isinstance(answer.get("runtime"), dict):
        raise PushRefused(f"gateway answered GET {CONFIG_PATH} without version/runtime: {answer!r:.200}", status=200)
    return answer
