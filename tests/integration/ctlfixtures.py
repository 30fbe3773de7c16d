"""A whole kvgate stack for control-plane tests, started the way users start it.

``control_fleet(...)`` writes a policy with free ports into a temp folder and runs the
real ``kvgate up`` (Redis, engine simulators, nginx, the control plane and one agent per
simulator); teardown runs ``kvgate down``. Timers are short (reports every 0.5 s, a
reconciler tick every 0.2 s, probes every 0.5 s) so state changes take seconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

from gwfixtures import free_port, kvgate_cli
from kvgate.gateway import dynamic

MODEL = "m"

FAST = """
control: {{listen: "127.0.0.1:{control}", tick_s: 0.2, report_interval_s: 0.5}}
health: {{probe_interval_s: 0.5, probe_timeout_s: 0.5, eject_after: 2, recover_after: 2, missing_reports: 4}}
ramp: {{steps: [0.25, 0.5, 1.0], step_interval_s: 1.0}}
drain: {{timeout_s: {drain_timeout_s}}}
"""


@dataclass
class Fleet:
    """A running stack: its ports, run directory, policy file and helpers."""

    tmp: Path
    run_dir: Path
    policy_path: Path
    gateway_port: int
    redis_port: int
    control_port: int
    node_ports: dict[str, int]
    template: Callable[..., str]
    kw: dict[str, Any] = field(default_factory=dict)
    token: str = ""
    session: requests.Session = field(default_factory=requests.Session)
    external: dict[str, str] = field(default_factory=dict)
    """Node id → URL of an engine the test runs itself (e.g. a mockengine.MockEngine): the policy
    lists it with ``simulate: false``, so ``kvgate up`` starts no simulator and no agent for it."""
    internal_port: int = field(default_factory=free_port)
    """The gateway's ``internal_listen`` port (runtime pushes, ``GET /kvgate/config``): a free one, so
    the gateways of tests running at once on one machine never collide on the default 9080."""

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def control(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def node_url(self, node_id: str) -> str:
        return self.external.get(node_id) or f"http://127.0.0.1:{self.node_ports[node_id]}"

    def kvgate(self, *args: str, timeout: float = 180):
        return kvgate_cli(self.run_dir, *args, timeout=timeout)

    def render(self, **overrides: Any) -> str:
        """The policy text of this fleet, with template arguments changed by ``overrides``."""
        return self.template(self, **{**self.kw, **overrides})

    def write_policy(self, path: Path | None = None, **overrides: Any) -> Path:
        path = path or self.policy_path
        path.write_text(self.render(**overrides))
        return path

    def api(self, method: str, path: str, **kw: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kw.pop("headers", {})}
        return self.session.request(method, self.control + path, headers=headers, timeout=kw.pop("timeout", 60), **kw)

    def tick_errors(self) -> float:
        """``kvgate_control_tick_errors_total`` (0 if the control plane does not answer)."""
        try:
            text = self.api("GET", "/metrics", timeout=5).text
        except requests.RequestException:
            return 0.0
        for line in text.splitlines():
            if line.startswith("kvgate_control_tick_errors_total "):
                return float(line.split()[1])
        return 0.0

    def in_force(self) -> dict[str, Any]:
        """The gateway's ``GET /kvgate/config``: ``{"version", "digest", "runtime", "loads"}``."""
        secret = (self.run_dir / "nginx/conf/push.secret").read_text().strip()
        return dynamic.current(f"127.0.0.1:{self.internal_port}", secret)

    def weight_in_force(self, node_id: str) -> int:
        """The node's weight in the gateway's runtime in force (0: takes no traffic)."""
        for pool in self.in_force()["runtime"]["pools"].values():
            if node_id in pool["nodes"]:
                return int(pool["nodes"][node_id]["weight"])
        raise KeyError(node_id)

    def node(self, node_id: str) -> dict[str, Any]:
        r = self.api("GET", f"/api/v1/nodes/{node_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def states(self) -> dict[str, str]:
        return {n["id"]: n["state"] for n in self.api("GET", "/api/v1/nodes").json()["nodes"]}

    def events(self, **params: Any) -> list[dict[str, Any]]:
        return self.api("GET", "/api/v1/events", params={"limit": 1000, **params}).json()["events"]

    def wait_state(self, node_id: str, state: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        n: dict[str, Any] = {}
        while time.monotonic() < deadline:
            n = self.node(node_id)
            if n["state"] == state:
                return n
            time.sleep(0.1)
        raise AssertionError(f"{node_id} did not reach {state} in {timeout}s: {n.get('state')} ({n.get('reason')})")

    def wait_reports(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.api("GET", "/api/v1/nodes").json()["nodes"]
            if all(n.get("report") for n in nodes):
                return
            time.sleep(0.2)
        raise AssertionError("not every node has an agent report")

    def engine_counter(self, node_id: str, name: str = "vllm:request_success_total") -> float:
        text = requests.get(self.node_url(node_id) + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def route(self, key: str) -> str:
        """The node the gateway sends session ``key`` to now (a 1-token, uncacheable request)."""
        r = requests.post(self.gateway + "/v1/chat/completions", timeout=30,
                          headers={"X-Session-Id": key, "Cache-Control": "no-store"},
                          json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        return r.headers["X-Kvgate-Node"]


MIX_TENANTS = """
tenants:
  - {id: default}
  - {id: chat-a}
  - {id: chat-b}
  - {id: assistant}
  - {id: support}
  - {id: jobs, priority: batch}
batch: {max_in_flight: 8, max_in_flight_per_node: 4, poll_interval_s: 0.2, retry_backoff_s: 0.2, lease_s: 2}
"""
"""The bill's mixed workload's tenants (control/kvgate/bench/mix.yaml) and a quick Batch API worker,
for a fleet's ``extra`` (tests/integration/test_bench_mix.py, test_bench_bill.py)."""


def default_template(fleet: Fleet, *, nodes: list[str] | None = None, weights: dict[str, int] | None = None,
                     extra: str = "", pool_extra: str = "", sim: str = "time_scale: 0.05",
                     balancer: str = "chash", gateway_extra: str = "", drain_timeout_s: float = 120) -> str:
    nodes = nodes if nodes is not None else sorted(fleet.node_ports)
    weights = weights or {}
    lines = "\n".join(
        f'      - {{id: {n}, url: "{fleet.node_url(n)}", simulate: {"false" if n in fleet.external else "true"}, '
        f'weight: {weights.get(n, 1)}}}' for n in nodes)
    return f"""
version: 1
gateway: {{listen: "127.0.0.1:{fleet.gateway_port}", internal_listen: "127.0.0.1:{fleet.internal_port}", debug_headers: true{gateway_extra}}}
redis: {{url: "redis://127.0.0.1:{fleet.redis_port}/0"}}
pools:
  - name: default
    models: [{MODEL}]
    balancer: {balancer}
{pool_extra}
    nodes:
{lines}
simulator: {{model: {MODEL}, {sim}}}
{FAST.format(control=fleet.control_port, drain_timeout_s=drain_timeout_s)}
{extra}
"""


@pytest.fixture
def control_fleet(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """Factory: ``control_fleet(n=3, start=3, external=None, **template_kw)`` starts a stack whose
    policy lists the first ``start`` of ``n`` reserved nodes (the rest can join later);
    ``external`` maps node ids to engines the test started (see :attr:`Fleet.external`)."""
    yield from _fleets(tmp_path)


def redis_port_pair() -> int:
    """A Redis port whose next port is free too (a local Sentinel set puts its replica there),
    below the kernel's ephemeral range (32768-60999 here), so no outgoing connection takes the
    replica's port between this check and its start."""
    import random
    import socket

    rnd = random.Random()
    for _ in range(200):
        port = rnd.randrange(20000, 32000, 2)
        ok = True
        for p in (port, port + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    return free_port()


def _fleets(base: Path) -> Iterator[Callable[..., Fleet]]:
    """The factory behind both fixtures; stops every fleet it started when resumed."""
    fleets: list[Fleet] = []

    def make(n: int = 3, start: int | None = None, template: Callable[..., str] = default_template,
             external: dict[str, str] | None = None, **kw: Any) -> Fleet:
        fleet = Fleet(tmp=base, run_dir=base / f"run{len(fleets)}", policy_path=base / f"policy{len(fleets)}.yaml",
                      gateway_port=free_port(), redis_port=redis_port_pair(), control_port=free_port(),
                      node_ports={f"n{i + 1}": free_port() for i in range(n)}, template=template, kw=kw,
                      external=dict(external or {}))
        fleets.append(fleet)
        fleet.kw["nodes"] = sorted(fleet.node_ports)[: start if start is not None else n]
        fleet.write_policy()
        up = fleet.kvgate("up", str(fleet.policy_path))
        assert up.returncode == 0, up.stdout + up.stderr
        fleet.token = (fleet.run_dir / "admin.token").read_text().strip()
        return fleet

    yield make
    errors = {}
    for fleet in fleets:
        errors[fleet.run_dir.name] = fleet.tick_errors()
        fleet.kvgate("down")
    # a reconciler round that raised is logged and counted, never silent: no test may cause one
    assert not any(errors.values()), (errors, "see the run dir's logs/control.log")


def wait_until(pred: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``pred`` every 0.1 s until it returns something truthy (returned); AssertionError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body (``[DONE]`` as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def control_fleet_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Fleet]]:
    """``control_fleet`` shared by a test module: same factory arguments, one temp folder per
    module, every fleet it started stopped (``kvgate down``) after the module's last test.
    Tests sharing a fleet must leave it usable for the next (or restore what they change)."""
    yield from _fleets(tmp_path_factory.mktemp("ctlfleet"))


async def stream_chat(client, key: str, tokens: int, content: str | None = None) -> dict[str, Any]:
    """One streamed chat through the `openai` client with session ``key``: tokens received,
    finish reason, the error (type and message) if it raised, and how long it took."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"tokens": 0, "finish": None, "error": None, "seconds": 0.0}
    try:
        stream = await client.chat.completions.create(
            model=MODEL, max_tokens=tokens, stream=True,
            messages=[{"role": "user", "content": content or f"stream {key}"}],
            extra_headers={"X-Session-Id": key, "Cache-Control": "no-store"})
        async for chunk in stream:
            for choice in chunk.choices:
                out["tokens"] += bool(choice.delta.content)
                out["finish"] = choice.finish_reason or out["finish"]
    except Exception as exc:  # counted as a failure by the tests
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    return out
