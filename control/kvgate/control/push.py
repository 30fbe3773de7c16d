"""The runtime's way to the gateway: :meth:`kvgate.nginxctl.Nginx.apply` as a transaction the
control plane can count and retry.

``Nginx.apply(policy, runtime, start=...)`` pushes the runtime to the running gateway when only
runtime fields changed (``"pushed"``: event ``runtime_pushed``), reloads through the confirmed
transaction when the static files changed (``"reloaded"`` / ``"started"``: event ``reload``),
writes the files without a running master (``"written"``), or finds nothing to do
(``"unchanged"``). A failure leaves the running config serving: event ``reload_failed``, and
the same runtime is tried again by the reconciler only after :data:`RETRY_FAILED_APPLY_S`.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Callable

from ..fleet.events import EventKind
from ..nginxctl import Nginx, NginxError
from ..policy.model import Policy
from ..render import Runtime
from .exceptions import ApplyError
from .metrics import ControlMetrics

RETRY_FAILED_APPLY_S = 5.0
"""After a failed apply, the reconciler tries the same config again only after this long
(operator actions always try at once)."""


class RuntimePush:
    """The runtime in force at the gateway and the last failure's back-off.

    Args:
        nginx: the gateway's nginx prefix.
        metrics: ``kvgate_control_reloads_total{result}`` and ``kvgate_control_node_weight``.
        event: records an event (``kind, message, **data``).
        start: whether ``Nginx.apply`` may start nginx (False for an external gateway).
    """

    def __init__(self, nginx: Nginx, metrics: ControlMetrics, event: Callable[..., None], start: bool):
        self.nginx, self.metrics, self.event, self.start = nginx, metrics, event, start
        self.applied: Runtime | None = None
        self._failed: tuple[Any, float] | None = None

    def apply(self, policy: Policy, runtime: Runtime, force: bool = False) -> str:
        """Send ``runtime`` unless it is the one in force (``"unchanged"``) or failed less than
        :data:`RETRY_FAILED_APPLY_S` ago (``"failed"``); ``force`` (operator actions) sends it
        anyway. Returns ``Nginx.apply``'s result. Raises ApplyError (after recording it)."""
        key = (tuple(sorted(runtime.weights.items())), tuple(sorted(runtime.balancers.items())))
        if not force and self.applied is not None and runtime == self.applied:
            return "unchanged"
        if not force and self._failed and key == self._failed[0] and time.monotonic() < self._failed[1]:
            return "failed"  # the same config failed moments ago: retried after a back-off
        try:
            result = self.nginx.apply(policy, runtime, start=self.start)
        except (NginxError, ValueError, OSError, subprocess.SubprocessError) as exc:
            self._failed = (key, time.monotonic() + RETRY_FAILED_APPLY_S)
            self.metrics.reloads.labels("failed").inc()
            self.event(EventKind.RELOAD_FAILED, f"gateway config not applied, the running one keeps serving: "
                       f"{str(exc).splitlines()[0]}", error=str(exc)[:2000])
            raise ApplyError(str(exc)) from None
        self._failed = None
        self.applied = runtime
        self.metrics.reloads.labels(result).inc()
        figures = {"result": result, "weights": dict(runtime.weights), "balancers": dict(runtime.balancers)}
        if result == "pushed":
            self.event(EventKind.RUNTIME_PUSHED, "gateway runtime pushed (no reload)", **figures)
        elif result != "unchanged":
            self.event(EventKind.RELOAD, f"gateway config {result}", **figures)
        for node_id, w in runtime.weights.items():
            self.metrics.weight.labels(node_id).set(w)
        return result
