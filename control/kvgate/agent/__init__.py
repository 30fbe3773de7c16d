"""The kvgate node agent: runs next to one inference engine, reports what it sees to the control plane.

* :mod:`kvgate.agent.collect` — the three probes (GPU via NVML, host via psutil, engine via
  ``/health`` + ``/metrics``); each returns a JSON-able dict and never raises.
* :mod:`kvgate.agent.agent` — :class:`~kvgate.agent.agent.Agent`: collect every interval and POST the
  report to ``{control_url}/api/v1/nodes/{node_id}/report``.
* :mod:`kvgate.agent.cli` — ``kvgate agent``.
"""

from .agent import Agent
from .collect import engine, gpu, host, parse_metrics

__all__ = ["Agent", "engine", "gpu", "host", "parse_metrics"]
