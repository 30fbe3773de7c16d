"""A small client of the control plane's API (used by the CLI and the trace replay)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import requests

from ..addr import http_url
from ..rundir import RunDir
from .token import read_token


class ControlError(RuntimeError):
    """The API answered an error or could not be reached. ``status`` is the HTTP status (0: no answer),
    ``issues`` the field problems of a rejected policy, ``code`` the error's code (``node_has_work``,
    ``invalid_transition``, …; None without one) and ``error`` the whole ``error`` object ({} without one)."""

    def __init__(self, message: str, status: int = 0, issues: list[dict[str, str]] | None = None,
                 code: str | None = None, error: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.issues = issues or []
        self.code = code
        self.error = error or {}


def resolve(run_dir: Path, url: str | None = None, token: str | None = None) -> tuple[str, str]:
    """The control plane URL and admin token to use.

    URL: ``url``, else ``$KVGATE_CONTROL_URL``, else the running stack's ``control.listen``
    (``https://`` with ``control.tls``), else ``http://127.0.0.1:9090``. Token: ``token``, else
    ``$KVGATE_TOKEN``, else ``<run_dir>/admin.token``. Raises ControlError when no token can be
    found.
    """
    rd = RunDir(run_dir)
    url = url or os.environ.get("KVGATE_CONTROL_URL")
    if not url:
        listen = "127.0.0.1:9090"
        running = None
        try:
            running = rd.load_running_policy()
            if running is not None:
                listen = running.control.listen
        except Exception:  # an unreadable running policy must not hide the default
            pass
        url = http_url(listen)
        if running is not None and running.control.tls is not None:
            url = "https" + url.removeprefix("http")
    token = token or os.environ.get("KVGATE_TOKEN")
    if not token:
        path = rd.token_file
        try:
            token = read_token(path)
        except (OSError, ValueError) as exc:
            raise ControlError(f"no admin token: {path} is not readable ({exc}); pass --token or set "
                               "KVGATE_TOKEN") from None
    return url.rstrip("/"), token


def verify_for(url: str, run_dir: Path | None = None) -> str | bool:
    """What to trust for the control plane at ``url`` (docs/tls.md): ``$KVGATE_CA_FILE``, else the
    certificate of the running stack's ``control.tls`` (``run_dir``, default the user's) when
    ``url`` is its address and the certificate is self-signed, else True (requests' default
    store; ``$REQUESTS_CA_BUNDLE`` replaces it)."""
    from .https import base_url, client_verify

    if os.environ.get("KVGATE_CA_FILE"):
        return os.environ["KVGATE_CA_FILE"]
    try:
        from ..rundir import default_run_dir

        running = RunDir(run_dir or default_run_dir()).load_running_policy()
    except Exception:  # noqa: BLE001 - an unreadable running policy leaves the default store
        return True
    if running is None or running.control.tls is None or base_url(running.control) != url.rstrip("/"):
        return True
    return client_verify(running.control)


def _ssl_reason(exc: Exception) -> str:
    """OpenSSL's reason (``certificate verify failed: unable to get local issuer certificate``)
    out of requests' nested SSLError text."""
    text = str(exc)
    start = text.find("certificate verify failed")
    return text[start:].split("'")[0].split(")")[0] if start >= 0 else type(exc).__name__


class ControlClient:
    """``ControlClient(url, token)``; every method returns the decoded JSON or raises ControlError."""

    def __init__(self, url: str, token: str, timeout: float = 30.0, verify: str | bool | None = None,
                 run_dir: Path | None = None):
        """``verify``: requests' ``verify`` for an ``https://`` URL (a CA bundle's path, or True);
        None: :func:`verify_for` (``$KVGATE_CA_FILE``, the run dir's self-signed certificate, or the
        default store)."""
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.s = requests.Session()
        # per request, not Session.verify: requests lets $REQUESTS_CA_BUNDLE override a session's
        # verify (psf/requests#3829), never a request's
        self.verify: str | bool = True
        if self.url.startswith("https://"):
            self.verify = verify_for(self.url, run_dir) if verify is None else verify
        self.s.headers["Authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self.s.request(method, self.url + path, timeout=kwargs.pop("timeout", self.timeout),
                                  verify=self.verify, **kwargs)
        except requests.exceptions.SSLError as exc:
            raise ControlError(f"control plane at {self.url}: SSLError, its certificate is not trusted or not valid "
                               f"({_ssl_reason(exc)}); set KVGATE_CA_FILE to the CA bundle that signed it "
                               "(docs/tls.md)") from None
        except requests.RequestException as exc:
            raise ControlError(f"control plane at {self.url} not reachable: {type(exc).__name__} "
                               "(is it running? `kvgate status`)") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            err = (body or {}).get("error") if isinstance(body, dict) else None
            message = err.get("message") if isinstance(err, dict) else resp.text[:300]
            issues = err.get("issues") if isinstance(err, dict) else None
            raise ControlError(f"HTTP {resp.status_code}: {message}", resp.status_code, issues,
                               code=err.get("code") if isinstance(err, dict) else None,
                               error=err if isinstance(err, dict) else None)
        return body

    def nodes(self) -> list[dict[str, Any]]:
        return self._call("GET", "/api/v1/nodes")["nodes"]

    def node(self, node_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/nodes/{node_id}")

    def action(self, node_id: str, action: str) -> dict[str, Any]:
        return self._call("POST", f"/api/v1/nodes/{node_id}/{action}")

    def apply(self, yaml_text: str, source: str = "kvgate apply", force: bool = False,
              files_base: str | None = None) -> dict[str, Any]:
        """``PUT /api/v1/policy``; ``force`` removes nodes that still have work (else 409 ``node_has_work``);
        ``files_base``: the absolute folder of the policy file (its relative ``static_answers``)."""
        headers = {"Content-Type": "application/yaml", "X-Kvgate-Source": source}
        if files_base:
            headers["X-Kvgate-Policy-Dir"] = files_base
        return self._call("PUT", "/api/v1/policy", data=yaml_text.encode(), timeout=120,
                          params={"force": "true"} if force else None, headers=headers)

    def validate(self, yaml_text: str, files_base: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/yaml"}
        if files_base:
            headers["X-Kvgate-Policy-Dir"] = files_base
        return self._call("POST", "/api/v1/policy/validate", data=yaml_text.encode(), headers=headers)

    def policy(self) -> dict[str, Any]:
        return self._call("GET", "/api/v1/policy")

    def invalidate_cache(self, source: str = "kvgate invalidate") -> dict[str, Any]:
        """``POST /api/v1/cache/invalidate``: ``{"old", "new", "version", "result"}``."""
        return self._call("POST", "/api/v1/cache/invalidate", timeout=120, headers={"X-Kvgate-Source": source})

    def bump_knowledge(self, pool: str, source: str = "kvgate cache bump-knowledge") -> dict[str, Any]:
        """``POST /api/v1/cache/knowledge``: ``{"pool", "old", "new", "result"}``."""
        return self._call("POST", "/api/v1/cache/knowledge", json={"pool": pool}, timeout=120,
                          headers={"X-Kvgate-Source": source})

    def invalidate_tag(self, tag: str, source: str = "kvgate cache invalidate --tag") -> dict[str, Any]:
        """``POST /api/v1/cache/invalidate-tag``: ``{"tag", "removed_exact", "removed_semantic", "semantic_error"}``."""
        return self._call("POST", "/api/v1/cache/invalidate-tag", json={"tag": tag}, timeout=60,
                          headers={"X-Kvgate-Source": source})

    def events(self, limit: int = 50, node: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        params = {"limit": limit, **({"node": node} if node else {}), **({"kind": kind} if kind else {})}
        return self._call("GET", "/api/v1/events", params=params)["events"]

    def tenants(self) -> dict[str, Any]:
        return self._call("GET", "/api/v1/tenants")

    def keys(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._call("GET", "/api/v1/keys", params={"tenant": tenant} if tenant else None)["keys"]

    def create_key(self, tenant: str, name: str = "") -> dict[str, Any]:
        """``{"key": record, "secret": "kvg-…"}``: the only time the secret is shown."""
        return self._call("POST", "/api/v1/keys", json={"tenant": tenant, "name": name})

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._call("POST", f"/api/v1/keys/{key_id}/revoke")

    def batches(self, tenant: str | None = None, status: str | None = None, limit: int = 100) -> dict[str, Any]:
        """``{"batches": [...], "counts": {...}}``: every tenant's batches, newest first."""
        params = {k: v for k, v in (("tenant", tenant), ("status", status), ("limit", limit)) if v}
        return self._call("GET", "/api/v1/batches", params=params)

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/batches/{batch_id}")

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self._call("POST", f"/api/v1/batches/{batch_id}/cancel")

    def costs(self, by: str = "tenant", since: str = "24h") -> dict[str, Any]:
        """``GET /api/v1/costs``: the cost report (:mod:`kvgate.costs.report`)."""
        return self._call("GET", "/api/v1/costs", params={"by": by, "since": since})

    def healthy(self) -> bool:
        try:
            return self.s.get(self.url + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False
