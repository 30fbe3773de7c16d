"""The control plane over HTTPS (``control.tls``, docs/tls.md): its server and what its clients trust.

waitress speaks plain HTTP only; with ``control.tls`` ``kvgate control`` serves the same WSGI app
with cheroot (CherryPy's WSGI server) and its ``BuiltinSSLAdapter`` (Python's ``ssl``), which
keeps the app, its threads and its shutdown as they are. A renewed certificate (same path, new
content) is loaded into a new ``SSLContext`` that every new connection uses
(:meth:`TlsServer.reload`, called by :mod:`kvgate.control.tlswatch`).

Clients (the CLI's :class:`~kvgate.control.client.ControlClient`, the stack's health checks, the
node agents) trust, in this order: ``$KVGATE_CA_FILE``; the control plane's own certificate when
it is self-signed and the client knows the policy (same host: ``kvgate up``, ``kvgate nodes``);
else the default store (``$REQUESTS_CA_BUNDLE`` or certifi/the system's, as requests does).
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

from ..addr import connect_address
from ..policy.model import ControlConfig, TlsConfig
from ..policy.tls import files_digest

log = logging.getLogger("kvgate.control")

CA_ENV = "KVGATE_CA_FILE"
"""Environment variable: a PEM bundle of the CA(s) that signed the control plane's certificate."""

SHUTDOWN_TIMEOUT_S = 2.0
"""How long cheroot's stop waits for a worker thread still answering (a policy apply, a large
download) before it closes that connection: a stop must not wait for a client."""

_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """A server ``SSLContext`` for ``tls``: its pair loaded, its protocols (lowest to highest).
    Raises ssl.SSLError / OSError for files that do not load (checked before: policy.tls)."""
    ctx = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    versions = sorted(_VERSIONS[p] for p in tls.protocols)
    ctx.minimum_version, ctx.maximum_version = versions[0], versions[-1]
    ctx.load_cert_chain(tls.certificate, tls.key)
    return ctx


class TlsServer:
    """cheroot's WSGI server with TLS, shaped like the waitress server ``kvgate control`` runs:
    bound at construction (a busy port fails before anything starts), :meth:`run` serves until
    a signal handler raises SystemExit in the thread running it, :meth:`close` stops it.

    Args:
        app: the WSGI app.
        host, port: where to listen.
        threads: worker threads (as waitress's ``threads``).
        tls: ``control.tls``.
    Raises OSError (the address), ssl.SSLError (the files).
    """

    def __init__(self, app: Any, host: str, port: int, threads: int, tls: TlsConfig):
        from cheroot import wsgi
        from cheroot.ssl.builtin import BuiltinSSLAdapter

        self.server = wsgi.Server((host, port), app, numthreads=threads, server_name="kvgate-control",
                                  request_queue_size=64, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        adapter = BuiltinSSLAdapter(tls.certificate, tls.key)
        self.digest: str | None = None
        """The files digest of the pair in use (:func:`kvgate.policy.tls.files_digest`)."""
        adapter.context = self._context(tls)
        self.adapter = adapter
        self.server.ssl_adapter = adapter
        self.server.prepare()  # binds and starts the worker threads

    def reload(self, tls: TlsConfig) -> None:
        """Serve new connections with ``tls``'s files as they are now (a renewal); connections
        already open keep their session. Raises ssl.SSLError / OSError (the old pair keeps serving)."""
        self.adapter.context = self._context(tls)

    def _context(self, tls: TlsConfig) -> ssl.SSLContext:
        digest = files_digest(tls)  # read first: a renewal after it is seen as a change
        ctx = server_context(tls)
        self.digest = digest
        return ctx

    def run(self) -> None:
        """Serve until SystemExit/KeyboardInterrupt is raised in this thread (the signal handler),
        then stop the workers (at most :data:`SHUTDOWN_TIMEOUT_S` for one still answering)."""
        try:
            self.server.serve()
        except (SystemExit, KeyboardInterrupt):
            pass  # the signal handler's way to end the loop; run() returns, as waitress's does
        finally:
            self.server.stop()

    def close(self) -> None:
        self.server.stop()


def base_url(control: ControlConfig) -> str:
    """``https://`` or ``http://`` + the connect address of ``control.listen`` (no trailing slash)."""
    return f"{'https' if control.tls else 'http'}://{connect_address(control.listen)}"


def self_signed(cert_file: str) -> bool:
    """Whether the first certificate of ``cert_file`` is its own issuer (a self-signed certificate
    can be its own trust anchor; a CA-issued one cannot: its CA is needed)."""
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cafile=cert_file)
        certs = ctx.get_ca_certs()
    except (OSError, ssl.SSLError, ValueError):
        return False
    return bool(certs) and certs[0].get("subject") == certs[0].get("issuer")


def client_verify(control: ControlConfig | None = None) -> str | bool:
    """What a client of the control plane passes as requests' ``verify``: ``$KVGATE_CA_FILE``,
    else ``control.tls.certificate`` when it is self-signed, else True (requests' default store,
    which ``$REQUESTS_CA_BUNDLE`` replaces)."""
    ca = os.environ.get(CA_ENV)
    if ca:
        return ca
    if control is not None and control.tls is not None and self_signed(control.tls.certificate):
        return control.tls.certificate
    return True


def client_env(control: ControlConfig | None) -> dict[str, str]:
    """Environment for a child process that calls the control plane (a node agent): requests in
    it trusts :func:`client_verify`'s file through ``REQUESTS_CA_BUNDLE``. Empty without TLS."""
    verify = client_verify(control) if control is not None and control.tls is not None else True
    return {"REQUESTS_CA_BUNDLE": verify} if isinstance(verify, str) else {}
