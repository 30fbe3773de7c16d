"""The node agent loop: collect a report every interval and POST it to the control plane.

Report (``POST {control_url}/api/v1/nodes/{node_id}/report``, ``Authorization: Bearer <token>``,
JSON body)::

    {
      "node_id": str,
      "ts": float,                      # unix seconds when collection started
      "agent": {"version": str, "hostname": str, "pid": int, "interval_s": float},
      "gpu": {...},                     # kvgate.agent.collect.gpu()
      "host": {...},                    # kvgate.agent.collect.host()
      "engine": {...}                   # kvgate.agent.collect.engine(engine_url)
    }

The control plane answers 200 with ``{"interval_s": X}`` (the policy's
``control.report_interval_s``); the agent adopts X for the following reports unless it was started
with a fixed interval. Nothing stops the loop but the stop event: a refused token (401/403), an
unreachable control plane, an error status or a dead engine are logged (one line, at most about
once a minute per kind of problem, plus one line when it clears) and the agent keeps going. After
consecutive failed posts it waits a little longer between attempts (doubling from the interval,
capped at ``max(interval, min(10 s, 5 × interval))``) — except after a 503: the control plane
answers but cannot store the report (its Redis is down), and the agent keeps reporting every
interval so that its reports are there again as soon as the store is.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any
from urllib.parse import quote

import requests

from .. import __version__
from . import collect

log = logging.getLogger("kvgate.agent")

DEFAULT_INTERVAL_S = 2.0
DEFAULT_TIMEOUT_S = 2.0
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 300.0  # accepted from the control plane (policy: 0 < x ≤ 300)
LOG_EVERY_S = 60.0  # a problem that persists is logged again after this long


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvgate")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source tree on sys.path)
        return __version__


class _Problems:
    """One log line per problem: on first sight and again every ``LOG_EVERY_S`` while it lasts
    (its wording may change meanwhile, e.g. refused → reset, without a new line), and one line
    when it clears. Keys are ``area/kind``; a new kind in an area (unreachable → token rejected)
    is a new problem."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # key -> when last logged (monotonic s)

    def report(self, key: str, message: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        area = key.split("/", 1)[0]
        for other in [k for k in self._last if k != key and k.split("/", 1)[0] == area]:
            del self._last[other]  # the area's earlier kind of problem is over
        last = self._last.get(key)
        if last is None or now - last >= LOG_EVERY_S:
            log.log(level, "%s", message)
            self._last[key] = now

    def clear(self, area: str, message: str) -> None:
        keys = [k for k in self._last if k.split("/", 1)[0] == area]
        for k in keys:
            del self._last[k]
        if keys:
            log.info("%s", message)


class Agent:
    """Reports one node (its GPUs, its host and its engine) to the control plane.

    Args:
        node_id: the node's id in the policy (path segment of the report URL).
        engine_url: the engine's base URL, e.g. ``http://127.0.0.1:8000``.
        control_url: the control plane's base URL, e.g. ``http://127.0.0.1:9090``.
        token: the admin token (``Authorization: Bearer``); may be empty for :meth:`collect` only.
        interval_s: seconds between reports (start value).
        timeout_s: seconds for each HTTP call (engine ``/health``, ``/metrics``, the report POST);
            default ``min(2.0, max(interval_s, 0.5))``.
        follow_control: adopt the ``interval_s`` the control plane answers (off when an operator
            fixed the interval on the command line).
        ca_file: PEM bundle that verifies an ``https://`` control plane (None: requests' default store).
    """

    def __init__(self, node_id: str, engine_url: str, control_url: str, token: str,
                 interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float | None = None,
                 follow_control: bool = True, ca_file: str | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.node_id = node_id
        self.engine_url = engine_url.rstrip("/")
        self.control_url = control_url.rstrip("/")
        self.token = token
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s) if timeout_s else min(DEFAULT_TIMEOUT_S, max(self.interval_s, 0.5))
        self.follow_control = follow_control
        self.report_url = f"{self.control_url}/api/v1/nodes/{quote(node_id, safe='')}/report"
        self.failures = 0  # consecutive failed posts that back off (not a 503: see the module docstring)
        self.last_status: int | None = None  # HTTP status of the last post (None: no answer)
        self._engine_session = requests.Session()
        self._control_session = requests.Session()
        # per request: $REQUESTS_CA_BUNDLE would override a Session's verify (psf/requests#3829)
        self._control_verify: str | bool = ca_file or True
        self._problems = _Problems()
        self._identity = {"version": _version(), "hostname": collect.hostname(), "pid": os.getpid()}
        collect.host()  # prime psutil.cpu_percent: the next call measures since now

    # ------------------------------------------------------------------ collect
    def collect(self) -> dict[str, Any]:
        """One report (see the module docstring); never raises."""
        ts = time.time()
        eng = collect.engine(self.engine_url, self.timeout_s, self._engine_session)
        return {
            "node_id": self.node_id,
            "ts": round(ts, 3),
            "agent": {**self._identity, "interval_s": self.interval_s},
            "gpu": collect.gpu(),
            "host": collect.host(),
            "engine": eng,
        }

    # --------------------------------------------------------------------- post
    def post(self, report: dict[str, Any]) -> bool:
        """POST ``report``; adopt the answered interval. True iff the control plane accepted it."""
        self.last_status = None
        try:
            r = self._control_session.post(self.report_url, json=report, timeout=self.timeout_s,
                                           headers={"Authorization": f"Bearer {self.token}"},
                                           verify=self._control_verify)
            self.last_status = r.status_code
        except requests.RequestException as e:
            self._problems.report("control/unreachable", f"cannot reach the control plane at {self.control_url}: "
                                             f"{collect._describe(e, self.timeout_s)}; will keep trying")
            return False
        if r.status_code in (401, 403):
            self._problems.report("control/token", f"admin token rejected by the control plane "
                                             f"(HTTP {r.status_code} from {self.report_url}); check --token "
                                             f"/ KVGATE_TOKEN / --token-file; will keep trying")
            return False
        if r.status_code == 503:
            self._problems.report("control/store", f"control plane cannot store reports now (HTTP 503 from "
                                              f"{self.report_url}: its Redis is down?); will keep reporting "
                                              f"every {self.interval_s:g}s")
            return False
        if r.status_code != 200:
            self._problems.report("control/http", f"control plane answered HTTP {r.status_code} to the report "
                                             f"({self.report_url}); will keep trying")
            return False
        self._problems.clear("control", f"reporting to {self.report_url}")
        self._adopt(r)
        return True

    def _adopt(self, r: requests.Response) -> None:
        if not self.follow_control:
            return
        try:
            value = r.json().get("interval_s")
        except Exception:  # noqa: BLE001 - a body without the field is fine
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        value = float(min(max(value, MIN_INTERVAL_S), MAX_INTERVAL_S))
        if value != self.interval_s:
            log.info("report interval %gs (from the control plane)", value)
            self.interval_s = value

    # ---------------------------------------------------------------------- run
    def _note_engine(self, eng: dict[str, Any]) -> None:
        if eng.get("healthy"):
            self._problems.clear("engine", f"engine {self.engine_url} healthy again")
        else:
            self._problems.report("engine/unhealthy", f"engine {self.engine_url} unhealthy: {eng.get('error')}")

    def delay(self) -> float:
        """Seconds to the next report: the interval, or longer after consecutive failed posts."""
        if self.failures == 0:
            return self.interval_s
        cap = max(self.interval_s, min(10.0, 5 * self.interval_s))
        return min(self.interval_s * 2 ** min(self.failures - 1, 16), cap)

    def run_once(self) -> dict[str, Any]:
        """Collect, post and note the outcome; returns the report."""
        report = self.collect()
        self._note_engine(report["engine"])
        ok = self.post(report)
        # a 503 is a control plane that answers without its store: report again at the interval
        self.failures = 0 if ok or self.last_status == 503 else self.failures + 1
        return report

    def run(self, stop_event: threading.Event) -> None:
        """Report every interval until ``stop_event`` is set; never raises out of one iteration."""
        log.info("kvgate agent %s: node %s, engine %s, reporting to %s every %gs", self._identity["version"],
                 self.node_id, self.engine_url, self.report_url, self.interval_s)
        next_at = time.monotonic()
        while not stop_event.is_set():
            try:
                self.run_once()
                self._problems.clear("loop", "reports resumed")
            except Exception as e:  # noqa: BLE001 - the loop outlives any one bad iteration
                self.failures += 1
                self._problems.report("loop/error", f"report failed: {type(e).__name__}: {e}")
            next_at = max(next_at + self.delay(), time.monotonic())  # late: no burst to catch up
            stop_event.wait(max(0.0, next_at - time.monotonic()))
        log.info("kvgate agent stopped")
