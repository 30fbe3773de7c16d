"""What the control plane reads from outside (network I/O, never under the plane's lock): the
gateway's ``/metrics``, the engines' ``/health`` and a draining engine's own in-flight count."""

from __future__ import annotations

import http.client
import re
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import requests
from prometheus_client.parser import text_string_to_metric_families

from ..addr import connect_address
from ..fleet.changes import Event, event
from ..fleet.events import EventKind
from ..gateway import dynamic


_WANTED = frozenset({"kvgate_upstream_inflight", "kvgate_requests_total", "kvgate_upstream_failover_total",
                     "kvgate_upstream_breaker_state", "kvgate_ratelimited_total", "kvgate_failovers_total"})
"""The gateway's series :func:`fetch_gateway` reads."""
_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\}[ \t]+(\S+)'
                     r'(?:[ \t]+-?[0-9]+)?[ \t]*')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r'\\(.)')


def _unescape(v: str) -> str:
    if "\\" not in v:
        return v
    return _UNESCAPE.sub(lambda m: {"n": "\n", "\\": "\\", '"': '"'}.get(m.group(1), m.group(0)), v)


def gateway_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of the samples of :data:`_WANTED` in a Prometheus text
    exposition, as :func:`prometheus_client.parser.text_string_to_metric_families` gives them.

    Lines of other series are skipped unread (the gateway's ``/metrics`` has histograms and
    per-tenant series by the thousand at 1,000 nodes: parsing all of it with prometheus_client
    took ~0.3 s of CPU per reconciler round); a line of a wanted series that is not the plain
    ``name{labels} value [timestamp]`` form is handed to prometheus_client's parser. Raises
    ValueError on a malformed wanted line, as that parser does."""
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace > 0 else line.split(None, 1)[0]
        if name not in _WANTED:
            continue
        m = _SAMPLE.fullmatch(line)
        if m is not None:
            try:
                value = float(m.group(3))
            except ValueError:
                m = None
        if m is None:
            for fam in text_string_to_metric_families(line + "\n"):
                for smp in fam.samples:
                    yield smp.name, dict(smp.labels), smp.value
            continue
        yield name, {k: _unescape(v) for k, v in _LABEL.findall(m.group(2))}, value


def empty_gateway() -> dict[str, Any]:
    """A gateway snapshot before the first scrape (not ``ok``)."""
    return {"ok": False, "inflight": {}, "requests": {}, "errors": {}, "failovers": {}, "tenant_requests": {},
            "ratelimited": {}, "breaker": {}}


def fetch_gateway(http: requests.Session, listen: str) -> dict[str, Any]:
    """The gateway's figures from its ``/metrics`` on its internal listener (``listen``:
    ``gateway.internal_listen``, HOST:PORT or ``unix:/path``; the client listener serves
    ``/metrics`` only with ``auth: off``, ``gateway.public_metrics``):
    ``{"ok": bool, "inflight": {node: kvgate_upstream_inflight}, "requests": {node: answers},
    "errors": {node: 5xx answers}, "failovers": {pool: kvgate_failovers_total}, "tenant_requests":
    {tenant: answers}, "ratelimited": {tenant: kvgate_ratelimited_total}, "breaker": {node:
    kvgate_upstream_breaker_state (0 closed, 1 open, 2 half-open)}}`` (cumulative counters),
    plus ``"error"`` when it could not be read (2 s timeout)."""
    snap = empty_gateway()
    try:
        if listen.startswith("unix:"):
            text = dynamic.get_text(listen, "/metrics", timeout=2)
        else:
            text = http.get(f"http://{connect_address(listen)}/metrics", timeout=2).text
        for sname, lb, value in gateway_samples(text):
            if sname == "kvgate_upstream_inflight":
                snap["inflight"][lb.get("node", "")] = snap["inflight"].get(lb.get("node", ""), 0) + value
            elif sname == "kvgate_requests_total":
                n = lb.get("node", "")
                snap["requests"][n] = snap["requests"].get(n, 0) + value
                if lb.get("status", "").startswith("5"):
                    snap["errors"][n] = snap["errors"].get(n, 0) + value
                t = lb.get("tenant", "none")
                snap["tenant_requests"][t] = snap["tenant_requests"].get(t, 0) + value
            elif sname == "kvgate_upstream_failover_total":
                # a try that failed at this node and was passed on (the client got the next
                # node's answer): one of this node's errors for the passive health check
                n = lb.get("node", "")
                snap["requests"][n] = snap["requests"].get(n, 0) + value
                snap["errors"][n] = snap["errors"].get(n, 0) + value
            elif sname == "kvgate_upstream_breaker_state":
                snap["breaker"][lb.get("node", "")] = int(value)
            elif sname == "kvgate_ratelimited_total":
                t = lb.get("tenant", "")
                snap["ratelimited"][t] = snap["ratelimited"].get(t, 0) + value
            elif sname == "kvgate_failovers_total":
                p = lb.get("pool", "")
                snap["failovers"][p] = snap["failovers"].get(p, 0) + value
        snap["ok"] = True
    except (requests.RequestException, ValueError, dynamic.GatewayUnreachable) as exc:
        snap["error"] = str(exc).splitlines()[0]
    return snap


def failover_events(prev: dict[str, Any], snap: dict[str, Any]) -> list[Event]:
    """A ``failover`` event per pool whose ``kvgate_failovers_total`` went up between two
    readable snapshots."""
    out = []
    if snap["ok"] and prev.get("ok"):
        for pool, value in snap["failovers"].items():
            delta = value - prev["failovers"].get(pool, 0)
            if delta > 0:
                out.append(event(EventKind.FAILOVER, f"pool {pool}: {int(delta)} request(s) failed over to another "
                                 "node", pool=pool, count=int(delta)))
    return out


def probe(url: str, timeout: float) -> str | None:
    """None if ``GET url/health`` answers 200 within ``timeout`` seconds, else the reason.

    One fresh connection per probe, as before, through :mod:`http.client` rather than
    ``requests`` (a tenth of the CPU: a probe round of 1,000 engines took ~1.5 s of CPU with
    ``requests.get``); the reasons keep requests' exception names (``ConnectionError``,
    ``ConnectTimeout``, ``ReadTimeout``, ``MissingSchema``, ``InvalidURL`` …)."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = None
    if not parts.scheme:
        return "health probe failed: MissingSchema"
    if parts.scheme not in ("http", "https"):
        return "health probe failed: InvalidSchema"
    if not host:
        return "health probe failed: InvalidURL"
    https = parts.scheme == "https"
    conn = (http.client.HTTPSConnection if https else http.client.HTTPConnection)(
        host, port or (443 if https else 80), timeout=timeout)
    try:
        try:
            conn.connect()
        except (TimeoutError, socket.timeout):
            return "health probe failed: ConnectTimeout"
        except ssl.SSLError:
            return "health probe failed: SSLError"
        except OSError:
            return "health probe failed: ConnectionError"
        try:
            conn.request("GET", parts.path + "/health", headers={"Accept": "*/*"})
            resp = conn.getresponse()
            resp.read()
        except (TimeoutError, socket.timeout):
            return "health probe failed: ReadTimeout"
        except (OSError, http.client.HTTPException):
            return "health probe failed: ConnectionError"
    finally:
        conn.close()
    return None if resp.status == 200 else f"health probe answered HTTP {resp.status}"


MAX_OPEN_PROBES = 256
"""Probe connections open at once in :func:`probe_many` (file descriptors: a process's
default limit is often 1,024)."""


async def _probe_many(urls: dict[str, str], timeout: float) -> dict[str, str | None]:
    import asyncio

    import aiohttp

    # one fresh connection per probe, as the blocking probe (force_close), at most
    # MAX_OPEN_PROBES at once; the timeouts of requests' (connect, then each read). The bound is
    # a semaphore, not the connector's limit: aiohttp's connector shuffles its list of waiting
    # hosts at every released connection, O(hosts) each, which at 1,000 engines was a third of
    # the reconcile round's CPU (kvgate bench render)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    to = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    gate = asyncio.Semaphore(MAX_OPEN_PROBES)

    async def one(session: aiohttp.ClientSession, url: str) -> str | None:
        async with gate:
            return await one_open(session, url)

    async def one_open(session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url + "/health", allow_redirects=False) as resp:
                await resp.read()
                return None if resp.status == 200 else f"health probe answered HTTP {resp.status}"
        except aiohttp.ConnectionTimeoutError:
            return "health probe failed: ConnectTimeout"
        except (aiohttp.SocketTimeoutError, asyncio.TimeoutError):
            return "health probe failed: ReadTimeout"
        except aiohttp.InvalidURL:
            return "health probe failed: InvalidURL"
        except (aiohttp.ClientError, OSError, ValueError):
            return "health probe failed: ConnectionError"

    async with aiohttp.ClientSession(connector=conn, timeout=to) as session:
        reasons = await asyncio.gather(*(one(session, u) for u in urls.values()))
    return dict(zip(urls, reasons))


def probe_many(urls: dict[str, str], timeout: float) -> dict[str, str | None]:
    """:func:`probe` of many plain ``http://`` engines at once on one asyncio loop (aiohttp; a
    probe round of 1,000 engines through threads of blocking ``requests`` probes spent ~1.5 s of
    CPU): node id → None or the reason, the same reasons as :func:`probe` (``ConnectTimeout``
    when the connection is not up within ``timeout``, ``ReadTimeout`` when the answer stalls for
    ``timeout``, ``ConnectionError`` for a refused or reset connection or an answer that is not
    HTTP). Runs its own loop: call it from a thread without one (the reconciler's)."""
    import asyncio

    return asyncio.run(_probe_many(urls, timeout))


def probe_all(urls: dict[str, str], timeout: float) -> dict[str, str | None]:
    """Probe every engine at once: node id → None (healthy) or the reason it failed.
    ``http://`` engines go through :func:`probe_many` (one asyncio loop), the others (https)
    through :func:`probe` in threads."""
    if not urls:
        return {}
    fast = {node: url for node, url in urls.items() if urlsplit(url).scheme == "http"}
    slow = {node: url for node, url in urls.items() if node not in fast}
    out: dict[str, str | None] = {}
    if slow:
        with ThreadPoolExecutor(max_workers=min(16, len(slow))) as ex:
            out.update(zip(slow, ex.map(lambda u: probe(u, timeout), slow.values())))
    if fast:
        out.update(probe_many(fast, timeout))
    return {node: out[node] for node in urls}


def engine_inflight(url: str) -> tuple[float | None, str | None]:
    """``(running + waiting, None)`` from the engine's own ``/metrics``, scraped now.

    ``(0.0, None)`` when the engine refuses connections (a dead engine has nothing in flight).
    ``(None, why)`` when the engine answers but its figures are *unavailable*: ``/metrics``
    answers 4xx or 501 (llama.cpp without ``--metrics``), or text without vLLM/SGLang figures
    (TGI, any plain OpenAI server); a drain then decides on the gateway's count alone.
    ``(None, None)`` when they cannot be told *now* (a timeout under load, a 5xx): unknown,
    never idle."""
    from ..agent.collect import engine as scrape_engine

    figures = scrape_engine(url, timeout=2.0)
    if figures.get("running") is not None:
        return float(figures.get("running") or 0) + float(figures.get("waiting") or 0), None
    error = str(figures.get("error") or "")
    if "connection failed" in error:
        return 0.0, None
    if figures.get("figures_error"):
        return None, str(figures["figures_error"])
    return None, None


def engines_inflight(urls: dict[str, str]) -> dict[str, tuple[float | None, str | None]]:
    """:func:`engine_inflight` of several engines at once, by node id."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as ex:
        return dict(zip(urls, ex.map(engine_inflight, urls.values())))


@dataclass(frozen=True)
class Readings:
    """One reconciler round's inputs, read before the plane's lock is taken.

    ``reports`` None: Redis could not be read (nothing that depends on reports is decided);
    ``instance``: the store's instance marker (None when unread); ``probes`` None: not a probe
    round; ``engine_inflight``: the draining nodes' engines (:func:`engine_inflight`)."""

    gateway: dict[str, Any]
    reports: dict[str, dict[str, Any]] | None
    instance: str | None
    probes: dict[str, str | None] | None
    engine_inflight: dict[str, tuple[float | None, str | None]]


def read_round(http: requests.Session, listen: str, urls: dict[str, str], draining: dict[str, str],
               probe_timeout_s: float | None, reports: Callable[[list[str]], dict[str, dict[str, Any]] | None],
               instance: Callable[[], str | None]) -> Readings:
    """Read everything a round decides on: the gateway's ``/metrics`` (``listen``: its internal
    listener), the reports
    of ``urls``' nodes and the store's marker (``reports``/``instance``: the plane's readers,
    None on a store error), every engine's ``/health`` when ``probe_timeout_s`` is given, and
    the ``draining`` engines' in-flight counts."""
    snap = fetch_gateway(http, listen)
    got = reports(list(urls))
    return Readings(snap, got, instance() if got is not None else None,
                    probe_all(urls, probe_timeout_s) if probe_timeout_s is not None else None,
                    engines_inflight(draining))
