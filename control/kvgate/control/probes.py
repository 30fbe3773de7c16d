"""What the control plane reads from outside (network I/O, never under the plane's lock): the
gateway's ``/metrics``, the engines' ``/health`` and a draining engine's own in-flight count."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import requests
from prometheus_client.parser import text_string_to_metric_families

from ..addr import connect_address
from ..fleet.changes import Event, event
from ..fleet.events import EventKind
from ..gateway import dynamic


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
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                lb = s.labels
                if s.name == "kvgate_upstream_inflight":
                    snap["inflight"][lb.get("node", "")] = snap["inflight"].get(lb.get("node", ""), 0) + s.value
                elif s.name == "kvgate_requests_total":
                    n = lb.get("node", "")
                    snap["requests"][n] = snap["requests"].get(n, 0) + s.value
                    if lb.get("status", "").startswith("5"):
                        snap["errors"][n] = snap["errors"].get(n, 0) + s.value
                    t = lb.get("tenant", "none")
                    snap["tenant_requests"][t] = snap["tenant_requests"].get(t, 0) + s.value
                elif s.name == "kvgate_upstream_failover_total":
                    # a try that failed at this node and was passed on (the client got the next
                    # node's answer): one of this node's errors for the passive health check
                    n = lb.get("node", "")
                    snap["requests"][n] = snap["requests"].get(n, 0) + s.value
                    snap["errors"][n] = snap["errors"].get(n, 0) + s.value
                elif s.name == "kvgate_upstream_breaker_state":
                    snap["breaker"][lb.get("node", "")] = int(s.value)
                elif s.name == "kvgate_ratelimited_total":
                    t = lb.get("tenant", "")
                    snap["ratelimited"][t] = snap["ratelimited"].get(t, 0) + s.value
                elif s.name == "kvgate_failovers_total":
                    p = lb.get("pool", "")
                    snap["failovers"][p] = snap["failovers"].get(p, 0) + s.value
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
    """None if ``GET url/health`` answers 200 within ``timeout`` seconds, else the reason."""
    try:
        resp = requests.get(f"{url}/health", timeout=timeout)
    except requests.RequestException as exc:
        return f"health probe failed: {type(exc).__name__}"
    return None if resp.status_code == 200 else f"health probe answered HTTP {resp.status_code}"


def probe_all(urls: dict[str, str], timeout: float) -> dict[str, str | None]:
    """Probe every engine at once: node id → None (healthy) or the reason it failed."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as ex:
        return dict(zip(urls, ex.map(lambda u: probe(u, timeout), urls.values())))


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
