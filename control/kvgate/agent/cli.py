"""``kvgate agent``: run the node agent next to one engine (see :mod:`kvgate.agent.agent`).

Exit codes: 0 after SIGTERM/SIGINT or ``--once``; 2 for bad arguments (no token, unreadable or empty
token file, a URL that is not http(s)://).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import click

from .agent import DEFAULT_INTERVAL_S, Agent

ONCE_CPU_SAMPLE_S = 0.25


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def _check_url(option: str, url: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        _fail(f"{option} must be an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


def _read_token_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"cannot read token file {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        _fail(f"token file {path} is empty")
    return token


@click.command("agent")
@click.option("--node-id", required=True, help="This node's id in the policy (pools[].nodes[].id).")
@click.option("--engine-url", required=True, help="Base URL of the engine on this node, e.g. http://127.0.0.1:8000.")
@click.option("--control-url", default="http://127.0.0.1:9090", show_default=True,
              help="Base URL of the kvgate control plane.")
@click.option("--token", envvar="KVGATE_TOKEN", default=None,
              help="Admin token for the control plane [env: KVGATE_TOKEN]. Or use --token-file.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File whose first line is the admin token.")
@click.option("--interval", type=click.FloatRange(0, 300, min_open=True), default=None,
              help=f"Seconds between reports, fixed. [default: {DEFAULT_INTERVAL_S:g}, then whatever the "
                   "control plane answers (its policy's control.report_interval_s)]")
@click.option("--timeout", type=click.FloatRange(0, 60, min_open=True), default=None,
              help="Seconds for each HTTP call (engine /health and /metrics, the report). "
                   "[default: 2, or the --interval if shorter, at least 0.5]")
@click.option("--ca-file", envvar="KVGATE_CA_FILE", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PEM bundle to verify an https:// control plane with (control.tls, docs/tls.md) "
                   "[default: the system's store].")
@click.option("--once", is_flag=True,
              help="Collect one report, print it as JSON to stdout and exit; posts nothing, needs no token.")
@click.pass_context
def agent_command(ctx: click.Context, node_id: str, engine_url: str, control_url: str, token: str | None,
                  token_file: Path | None, interval: float | None, timeout: float | None, ca_file: Path | None,
                  once: bool) -> None:
    """Report this node's GPUs, host and engine to the kvgate control plane.

    Every interval the agent reads NVML (GPUs), psutil (CPU, load, memory) and the engine's /health
    and /metrics (vLLM or SGLang), then POSTs the report to
    CONTROL_URL/api/v1/nodes/NODE_ID/report with the admin token. It keeps going whatever fails
    (logging one line per problem) until SIGTERM or Ctrl-C.
    """
    if not node_id.strip() or node_id != node_id.strip():
        _fail("--node-id must be a node id of the policy (pools[].nodes[].id), not empty")
    engine_url = _check_url("--engine-url", engine_url)
    control_url = _check_url("--control-url", control_url)
    if token_file is not None:
        from click.core import ParameterSource

        if token and ctx.get_parameter_source("token") == ParameterSource.COMMANDLINE:
            _fail("give --token or --token-file, not both")
        token = _read_token_file(token_file)  # an explicit file wins over KVGATE_TOKEN
    token = (token or "").strip()
    if not token and not once:
        _fail("the control plane needs the admin token: give --token, set KVGATE_TOKEN or use --token-file "
              "(or --once to only print a report)")

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(node_id, engine_url, control_url, token, interval_s=interval or DEFAULT_INTERVAL_S,
                  timeout_s=timeout, follow_control=interval is None, ca_file=str(ca_file) if ca_file else None)
    if once:
        time.sleep(ONCE_CPU_SAMPLE_S)  # so host.cpu_pct covers a real sample, not the last few ms
        click.echo(json.dumps(agent.collect(), indent=2))
        return

    serve(agent)


def serve(agent: Agent) -> None:
    """Run ``agent`` until SIGTERM or SIGINT (then return, so the process exits 0)."""
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        logging.getLogger("kvgate.agent").info("%s received, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The loop runs on a worker thread; the main thread only waits, so the signal handler never
    # interrupts the loop while it holds a lock.
    worker = threading.Thread(target=agent.run, args=(stop,), name="kvgate-agent", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.5)
