"""HOST:PORT addresses: what to bind, what to connect to.

A listen address (``policy.gateway.listen``, ``policy.control.listen``) is ``HOST:PORT`` with
an IPv6 host in brackets (``[::1]:9090``); a wildcard host (``0.0.0.0``, ``*``, ``::``) binds
every interface but cannot be connected to, so a client goes to the loopback of the same family.
No other kvgate module is imported here: the stack, the control plane, its client and the CLI
all use these helpers.
"""

from __future__ import annotations

_WILDCARD_V4 = ("0.0.0.0", "*", "")
_WILDCARD_V6 = ("::", "[::]")


def split_host_port(listen: str) -> tuple[str, int]:
    """``("127.0.0.1", 8080)`` for ``127.0.0.1:8080``; an IPv6 host loses its brackets
    (``[::1]:9090`` → ``("::1", 9090)``), as ``socket.bind`` / ``create_connection`` want it.

    Raises:
        ValueError: no ``:PORT``, or the port is not an integer.
    """
    host, sep, port = listen.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def connect_address(listen: str) -> str:
    """An address to connect to for a listen address (``0.0.0.0:8080`` → ``127.0.0.1:8080``,
    ``[::]:8080`` → ``[::1]:8080``; any other address is returned as it is)."""
    host, _, port = listen.rpartition(":")
    if host in _WILDCARD_V4:
        host = "127.0.0.1"
    elif host in _WILDCARD_V6:
        host = "[::1]"
    return f"{host}:{port}"


def http_url(listen: str) -> str:
    """``http://<connect_address(listen)>`` (no trailing slash)."""
    return f"http://{connect_address(listen)}"
