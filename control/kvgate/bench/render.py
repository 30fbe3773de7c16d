"""``kvgate bench render``: what applying a policy of N nodes in P pools costs, step by step, and
what the control plane's reconcile round costs for those N nodes (issue 17 item 4: ring and
config render for 1,000 nodes in 20 pools in < 1 s; the reconcile round with agents reporting
every 2 s within 20 % of one core).

**Apply** (a policy built in memory: ``n0000``… in ``pool00``…, ``chash_bounded``, weight 1 =
nginx ``weight=100`` = 16,000 ring points a node), each step timed ``--rounds`` times:

* ``validate``: :func:`kvgate.policy.loader.parse_policy_text` of the policy's YAML (YAML parse,
  the pydantic model, the cross-field checks), as ``POST /api/v1/policy`` starts;
* ``render static config``: :func:`kvgate.render.render` (``nginx.conf`` and ``kvgate.json``);
* ``runtime document``: :func:`kvgate.fleet.runtime.runtime_for` →
  :func:`kvgate.render.runtime_document` → :func:`kvgate.render.runtime_json` (the body pushed
  to every gateway and ``conf/runtime.json``);
* ``gateway: config.init`` and ``gateway: balancer.init`` under plain ``luajit``
  (``render_ring.lua``): what the gateway's ``init_by_lua`` does with those files (read
  ``kvgate.json`` and ``runtime.json``, check the runtime; build every pool's balancer: the rings).

Not in the total: one ring of all N nodes (``ring.new``, luajit), and the Python re-statement
of the ring (:class:`kvgate.analyze.routing.Ring`, ``kvgate analyze`` only) for one pool.

**Reconcile** (needs ``redis-server`` unless ``--redis-url``, and ``nginx`` for the ``nginx -t``
of the first apply): a real :class:`kvgate.control.plane.ControlPlane` over a private Redis,
with N stand-in engines and a stand-in gateway internal listener in another process
(:mod:`kvgate.bench.render_stub`: their CPU is not counted). One round is what the control
plane does in one report interval (2 s): N agent reports (:meth:`ControlPlane.report`, the API
handler's work without the HTTP layer), one :meth:`ControlPlane.tick` that probes every engine
(``health.probe_interval_s`` 2 s) and one that does not (``control.tick_s`` 1 s): the gateway's
``/metrics`` scrape, N reports read back, the fleet steps, the runtime pushed when it changed.
CPU is the process's (every thread), ``time.process_time``; CPU % = CPU seconds ÷ 2 s. Redis's
own CPU over the round (``INFO cpu``) is shown beside it.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import click
import yaml
from rich.console import Console
from rich.table import Table

TARGET_S = 1.0
"""Issue 17 item 4: ring and config render for 1,000 nodes in 20 pools in under 1 s."""
CPU_TARGET = 0.20
"""... and the reconcile round within 20 % of one core."""
REPORT_INTERVAL_S = 2.0
LUA_SCRIPT = Path(__file__).with_name("render_ring.lua")

APPLY_STEPS = ("validate", "render static config", "runtime document", "gateway: config.init (luajit)",
               "gateway: balancer.init, every pool's ring (luajit)")
EXTRA_STEPS = ("one ring of all nodes (luajit ring.new)", "Python Ring (kvgate analyze), one pool")
RECONCILE_PARTS = ("N agent reports", "tick with engine probes", "tick without probes")


def node_id(i: int) -> str:
    return f"n{i:04d}"


def policy_data(nodes: int, pools: int, ports: list[int] | None = None, *, redis_url: str | None = None,
                internal_listen: str | None = None, control_listen: str | None = None) -> dict[str, Any]:
    """A valid policy of ``nodes`` nodes spread evenly over ``pools`` pools (one model each,
    ``chash_bounded``, weight 1), as parsed YAML. ``ports``: the nodes' ports on 127.0.0.1
    (default 20000 + i: nothing listens, nothing is connected to)."""
    if nodes < 1 or pools < 1 or pools > nodes:
        raise ValueError("need 1 <= pools <= nodes")
    per = -(-nodes // pools)
    out: list[dict[str, Any]] = []
    for p in range(pools):
        members = range(p * per, min(nodes, (p + 1) * per))
        out.append({
            "name": f"pool{p:02d}", "models": [f"model-{p:02d}"], "balancer": "chash_bounded",
            "affinity": ["session", "user", "prefix"],
            "nodes": [{"id": node_id(i), "url": f"http://127.0.0.1:{ports[i] if ports else 20000 + i}", "weight": 1}
                      for i in members],
        })
    data: dict[str, Any] = {"version": 1, "pools": [p for p in out if p["nodes"]]}
    if redis_url:
        data["redis"] = {"url": redis_url}
    if internal_listen or control_listen:
        data["gateway"] = {"listen": f"127.0.0.1:{_free_port()}", "internal_listen": internal_listen}
        data["control"] = {"listen": control_listen, "report_interval_s": REPORT_INTERVAL_S, "tick_s": 1.0}
        data["health"] = {"probe_interval_s": REPORT_INTERVAL_S}
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(ms: list[float], cpu_ms: list[float] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"p50_ms": round(statistics.median(ms), 3), "max_ms": round(max(ms), 3),
                           "runs_ms": [round(x, 3) for x in ms]}
    if cpu_ms is not None:
        out["cpu_p50_ms"] = round(statistics.median(cpu_ms), 3)
        out["cpu_runs_ms"] = [round(x, 3) for x in cpu_ms]
    return out


def _timed(fn: Callable[[], Any], rounds: int) -> tuple[dict[str, Any], Any]:
    """``fn()`` ``rounds`` times: the wall and CPU summary (ms) and the last result. CPU is this
    thread's (``time.thread_time``: the steps run in it; other threads of the process, e.g. an
    idle BLAS pool another import started, are not theirs)."""
    wall, cpu, res = [], [], None
    for _ in range(rounds):
        t, c = time.perf_counter(), time.thread_time()
        res = fn()
        cpu.append((time.thread_time() - c) * 1000)
        wall.append((time.perf_counter() - t) * 1000)
    return _summary(wall, cpu), res


# ----------------------------------------------------------------------------------- apply
def bench_apply(nodes: int, pools: int, rounds: int, lua_dir: Path | None = None,
                python_ring: bool = True) -> dict[str, Any]:
    """Time each step of a policy apply for ``nodes`` in ``pools`` (see the module docstring)."""
    from ..analyze.routing import Ring
    from ..fleet.runtime import runtime_for
    from ..policy.loader import parse_policy_text
    from ..render import default_lua_dir, render, runtime_document, runtime_json

    lua_dir = Path(lua_dir or default_lua_dir())
    text = yaml.safe_dump(policy_data(nodes, pools), sort_keys=False)
    steps: dict[str, dict[str, Any]] = {}
    steps[APPLY_STEPS[0]], policy = _timed(lambda: parse_policy_text(text, "bench"), rounds)
    steps[APPLY_STEPS[1]], files = _timed(lambda: render(policy, lua_dir, push_secret_sha256="0" * 64), rounds)
    steps[APPLY_STEPS[2]], doc_text = _timed(
        lambda: runtime_json(runtime_document(policy, runtime_for(policy, {}, {}))), rounds)
    luajit = shutil.which("luajit")
    lua: dict[str, Any] = {}
    if luajit:
        with tempfile.TemporaryDirectory(prefix="kvgate-bench-render-") as tmp:
            conf = Path(tmp) / "conf"
            conf.mkdir()
            (conf / "kvgate.json").write_text(files["conf/kvgate.json"])
            (conf / "runtime.json").write_text(doc_text)
            res = subprocess.run([luajit, str(LUA_SCRIPT), str(lua_dir), tmp + "/", str(rounds), str(nodes)],
                                 capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"luajit {LUA_SCRIPT.name} failed: {res.stderr.strip()[-2000:]}")
            lua = json.loads(res.stdout.strip().splitlines()[-1])
        steps[APPLY_STEPS[3]] = _summary(lua["config_init_ms"], lua["config_init_cpu_ms"])
        steps[APPLY_STEPS[4]] = _summary(lua["balancer_init_ms"], lua["balancer_init_cpu_ms"])
        steps[EXTRA_STEPS[0]] = _summary(lua["single_ring_ms"], lua["single_ring_cpu_ms"])
    if python_ring:
        first = policy.pools[0]
        members = [(n.id, n.weight * 100) for n in first.nodes]
        summary, _ = _timed(lambda: Ring(members), min(rounds, 3))
        steps[EXTRA_STEPS[1]] = {**summary, "nodes": len(members)}
    in_total = [s for s in APPLY_STEPS if s in steps]
    total_p50 = sum(steps[s]["p50_ms"] for s in in_total)
    total_max = sum(steps[s]["max_ms"] for s in in_total)
    total_cpu = sum(steps[s]["cpu_p50_ms"] for s in in_total)
    return {
        "nodes": nodes, "pools": pools, "rounds": rounds, "policy_yaml_bytes": len(text),
        "nginx_conf_bytes": len(files["conf/nginx.conf"]), "kvgate_json_bytes": len(files["conf/kvgate.json"]),
        "runtime_json_bytes": len(doc_text), "ring_points": lua.get("points"), "single_ring_points": lua.get("single_points"),
        "steps": steps, "total_steps": in_total, "total_p50_ms": round(total_p50, 3), "total_max_ms": round(total_max, 3),
        "total_cpu_p50_ms": round(total_cpu, 3),
        "target_ms": TARGET_S * 1000, "ok": bool(luajit) and total_max < TARGET_S * 1000,
        "missing": [] if luajit else ["luajit (the gateway's steps)"],
    }


# -------------------------------------------------------------------------------- reconcile
def synthetic_report(i: int, rnd: random.Random, interval_s: float = REPORT_INTERVAL_S) -> dict[str, Any]:
    """An agent report as :mod:`kvgate.agent.agent` sends it (one 80 GB GPU, a vLLM engine with
    a random queue and KV use)."""
    return {
        "node_id": node_id(i), "ts": round(time.time(), 3),
        "agent": {"version": "bench", "hostname": f"gpu{i:04d}", "pid": 1000 + i, "interval_s": interval_s},
        "gpu": {"status": "ok", "driver_version": "550.54", "devices": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08d}", "memory_used_bytes": 70 * 2**30,
             "memory_total_bytes": 80 * 2**30, "utilization_pct": rnd.randint(40, 100)}]},
        "host": {"hostname": f"gpu{i:04d}", "cpu_pct": rnd.uniform(5, 60), "load1": 2.0, "load5": 2.0, "load15": 2.0,
                 "memory_used_bytes": 100 * 2**30, "memory_total_bytes": 512 * 2**30},
        "engine": {"url": "", "healthy": True, "error": None, "kind": "vllm", "running": rnd.randint(0, 64),
                   "waiting": rnd.choice((0, 0, 0, 1, 2, 4)), "kv_cache_usage": round(rnd.uniform(0.2, 0.75), 3),
                   "prefix_cache_queries": 1e6 + i, "prefix_cache_hits": 6e5 + i, "prefix_cache_hit_rate": 0.6,
                   "num_gpu_blocks": 65536, "start_time": 1.7e9, "scrape_ms": 3.0, "figures_error": None},
    }


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if not exe:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    r = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def _redis_cpu(url: str) -> float:
    import redis

    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextmanager
def reconcile_plane(nodes: int, pools: int, redis_url: str | None = None) -> Iterator[Any]:
    """A :class:`~kvgate.control.plane.ControlPlane` of ``nodes`` in ``pools`` over a private
    Redis (or ``redis_url``, flushed) and the stand-ins of :mod:`kvgate.bench.render_stub`, its
    policy applied (render, ``nginx -t``, files written) and the gateway "running" from then on
    (a changed runtime is pushed to the stand-in's internal listener). Yields ``(plane,
    redis_url, applies)``: ``applies`` counts the results of the plane's runtime applies."""
    from ..control import versions
    from ..control.plane import ControlPlane
    from ..control.store import Store
    from ..nginxctl import Nginx

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-reconcile-") as tmp_s:
        tmp = Path(tmp_s)
        try:
            if redis_url is None:
                proc, redis_url = _start_redis(tmp)
                procs.append(proc)
            else:
                import redis

                redis.Redis.from_url(redis_url).flushdb()
            stub = subprocess.Popen([sys.executable, "-m", "kvgate.bench.render_stub", str(nodes), str(pools)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            procs.append(stub)
            assert stub.stdout is not None
            line = stub.stdout.readline()
            if not line:
                raise RuntimeError("the stand-in engines did not start")
            ports = json.loads(line)
            text = yaml.safe_dump(policy_data(nodes, pools, ports["engines"], redis_url=redis_url,
                                              internal_listen=f"127.0.0.1:{ports['gateway']}",
                                              control_listen=f"127.0.0.1:{_free_port()}"), sort_keys=False)
            plane = ControlPlane(Store(redis_url), Nginx(tmp / "nginx"), external_gateway=True)
            with plane.lock, plane.changing():
                versions.load(plane, text, "kvgate bench render")
            plane.nginx.pid = lambda: stub.pid  # type: ignore[method-assign]
            applies: dict[str, int] = {}
            real_apply = plane.push.apply

            def counting_apply(*a: Any, **kw: Any) -> str:
                res = real_apply(*a, **kw)
                applies[res] = applies.get(res, 0) + 1
                return res

            plane.push.apply = counting_apply  # type: ignore[method-assign]
            try:
                yield plane, redis_url, applies
            finally:
                plane.http.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        p.kill()


def reconcile_round(plane: Any, rnd: random.Random) -> None:
    """One report interval's work: every node's report, a tick that probes, a tick that does not."""
    ids = [n.id for n in plane.policy.nodes()]
    for k, nid in enumerate(ids):
        plane.report(nid, synthetic_report(k, rnd))
    plane._probe_due = 0.0
    plane.tick()
    plane._probe_due = time.monotonic() + 3600.0
    plane.tick()


def bench_reconcile(nodes: int, pools: int, rounds: int, redis_url: str | None = None,
                    seed: int = 17) -> dict[str, Any]:
    """CPU of the control plane's work per report interval for ``nodes`` (see the module docstring)."""
    rnd = random.Random(seed)
    with reconcile_plane(nodes, pools, redis_url) as (plane, redis_url, applies):
        ids = [n.id for n in plane.policy.nodes()]
        per_round: list[dict[str, float]] = []
        for r in range(rounds + 1):  # round 0 warms up (first scrape, first push)
            reports = [synthetic_report(k, rnd) for k in range(len(ids))]  # made before the clock starts
            redis0 = _redis_cpu(redis_url)
            c0, w0 = time.process_time(), time.perf_counter()
            for nid, report in zip(ids, reports):
                plane.report(nid, report)
            c1, w1 = time.process_time(), time.perf_counter()
            plane._probe_due = 0.0  # this tick probes every engine
            plane.tick()
            c2, w2 = time.process_time(), time.perf_counter()
            plane._probe_due = time.monotonic() + 3600.0  # within the probe interval: no probes
            plane.tick()
            c3, w3 = time.process_time(), time.perf_counter()
            redis1 = _redis_cpu(redis_url)
            if r == 0:
                continue
            per_round.append({"reports_cpu_ms": (c1 - c0) * 1000, "tick_probe_cpu_ms": (c2 - c1) * 1000,
                              "tick_cpu_ms": (c3 - c2) * 1000, "total_cpu_ms": (c3 - c0) * 1000,
                              "reports_wall_ms": (w1 - w0) * 1000, "tick_probe_wall_ms": (w2 - w1) * 1000,
                              "tick_wall_ms": (w3 - w2) * 1000, "redis_cpu_ms": (redis1 - redis0) * 1000})
        states: dict[str, int] = {}
        for rec in plane.nodes.values():
            states[rec.state] = states.get(rec.state, 0) + 1
        results = dict(applies)
    keys = ("reports_cpu_ms", "tick_probe_cpu_ms", "tick_cpu_ms", "total_cpu_ms", "redis_cpu_ms")
    summary = {k: _summary([x[k] for x in per_round]) for k in keys}
    wall = {k: _summary([x[k] for x in per_round]) for k in ("reports_wall_ms", "tick_probe_wall_ms", "tick_wall_ms")}
    cpu_p50 = summary["total_cpu_ms"]["p50_ms"] / 1000 / REPORT_INTERVAL_S
    cpu_max = summary["total_cpu_ms"]["max_ms"] / 1000 / REPORT_INTERVAL_S
    return {
        "nodes": nodes, "pools": pools, "rounds": rounds, "interval_s": REPORT_INTERVAL_S,
        "cpu": summary, "wall": wall, "core_share_p50": round(cpu_p50, 4), "core_share_max": round(cpu_max, 4),
        "redis_core_share_p50": round(summary["redis_cpu_ms"]["p50_ms"] / 1000 / REPORT_INTERVAL_S, 4),
        "target_share": CPU_TARGET, "ok": cpu_max < CPU_TARGET, "applies": results, "states": states,
    }


# ----------------------------------------------------------------------------------- output
def apply_table(rep: dict[str, Any]) -> Table:
    t = Table(title=f"kvgate bench render: applying a policy of {rep['nodes']:,} nodes in {rep['pools']} pools "
                    f"({rep['rounds']} rounds)", title_justify="left")
    t.add_column("step")
    t.add_column("p50 ms", justify="right")
    t.add_column("max ms", justify="right")
    t.add_column("CPU p50 ms", justify="right")
    for name in APPLY_STEPS:
        s = rep["steps"].get(name)
        t.add_row(name, *(f"{s['p50_ms']:.1f}", f"{s['max_ms']:.1f}", f"{s['cpu_p50_ms']:.1f}") if s else ("—",) * 3)
    t.add_row(f"[bold]total[/] (target < {rep['target_ms']:.0f} ms)", f"[bold]{rep['total_p50_ms']:.1f}[/]",
              f"[bold]{rep['total_max_ms']:.1f}[/]", f"{rep['total_cpu_p50_ms']:.1f}", end_section=True)
    for name in EXTRA_STEPS:
        s = rep["steps"].get(name)
        if s:
            label = name + (f" of {s['nodes']} nodes" if "nodes" in s else "") + " [dim](not in the total)[/]"
            t.add_row(label, f"{s['p50_ms']:.1f}", f"{s['max_ms']:.1f}", f"{s['cpu_p50_ms']:.1f}")
    return t


def reconcile_table(rep: dict[str, Any]) -> Table:
    t = Table(title=f"reconcile: one {rep['interval_s']:g} s report interval of {rep['nodes']:,} nodes "
                    f"({rep['rounds']} rounds; CPU of the control plane's process)", title_justify="left")
    t.add_column("part")
    t.add_column("CPU p50 ms", justify="right")
    t.add_column("CPU max ms", justify="right")
    t.add_column("wall p50 ms", justify="right")
    rows = [(f"{rep['nodes']:,} agent reports (ControlPlane.report)", "reports_cpu_ms", "reports_wall_ms"),
            ("tick with engine probes", "tick_probe_cpu_ms", "tick_probe_wall_ms"),
            ("tick without probes", "tick_cpu_ms", "tick_wall_ms")]
    for label, ck, wk in rows:
        c = rep["cpu"][ck]
        t.add_row(label, f"{c['p50_ms']:.0f}", f"{c['max_ms']:.0f}", f"{rep['wall'][wk]['p50_ms']:.0f}")
    c = rep["cpu"]["total_cpu_ms"]
    t.add_row(f"[bold]total per {rep['interval_s']:g} s[/]", f"[bold]{c['p50_ms']:.0f}[/]", f"[bold]{c['max_ms']:.0f}[/]",
              "", end_section=True)
    t.add_row(f"[bold]share of one core[/] (target < {rep['target_share']:.0%})",
              f"[bold]{rep['core_share_p50']:.1%}[/]", f"[bold]{rep['core_share_max']:.1%}[/]", "")
    r = rep["cpu"]["redis_cpu_ms"]
    t.add_row("redis-server's own CPU [dim](another process)[/]", f"{r['p50_ms']:.0f}", f"{r['max_ms']:.0f}",
              f"{rep['redis_core_share_p50']:.1%} of a core")
    return t


@click.command("render")
@click.option("--nodes", type=click.IntRange(1, 65535), default=1000, show_default=True, help="Nodes in the policy.")
@click.option("--pools", type=click.IntRange(1, 1000), default=20, show_default=True, help="Pools they are spread over.")
@click.option("--rounds", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Times each step (and reconcile round) is run.")
@click.option("--reconcile/--no-reconcile", default=True, show_default=True,
              help="Also measure the control plane's reconcile round (starts a private redis-server).")
@click.option("--redis-url", default=None, help="Use this Redis for the reconcile round (its DB is FLUSHED).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the figures as JSON to this file.")
def render_command(nodes: int, pools: int, rounds: int, reconcile: bool, redis_url: str | None,
                   json_path: Path | None) -> None:
    """Time applying a policy of --nodes in --pools (validate, render, runtime, the gateway's
    config load and rings under luajit) against the 1 s target, and the control plane's CPU
    per 2 s report interval for those nodes against 20 % of one core (issue 17 item 4)."""
    if pools > nodes:
        raise click.UsageError("--pools must not exceed --nodes")
    console = Console()
    try:
        rep_apply = bench_apply(nodes, pools, rounds)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    console.print(apply_table(rep_apply))
    ok = rep_apply["ok"]
    mark = "✓" if ok else "✗"
    console.print(f"{mark} apply total {rep_apply['total_max_ms']:.0f} ms (max of {rounds}) "
                  f"{'<' if ok else '>='} {rep_apply['target_ms']:.0f} ms for {nodes:,} nodes in {pools} pools"
                  + (f"; missing: {', '.join(rep_apply['missing'])}" if rep_apply["missing"] else ""))
    out: dict[str, Any] = {"apply": rep_apply, "reconcile": None}
    if reconcile:
        try:
            rep_rec = bench_reconcile(nodes, pools, rounds, redis_url)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            click.echo(f"error (reconcile): {exc}", err=True)
            sys.exit(1)
        console.print(reconcile_table(rep_rec))
        rok = rep_rec["ok"]
        console.print(f"{'✓' if rok else '✗'} reconcile {rep_rec['core_share_max']:.1%} of one core (max of {rounds}) "
                      f"{'<' if rok else '>='} {rep_rec['target_share']:.0%} for {nodes:,} nodes reporting every "
                      f"{rep_rec['interval_s']:g} s (applies: {rep_rec['applies']})")
        out["reconcile"] = rep_rec
        ok = ok and rok
    out["ok"] = ok
    if json_path:
        json_path.write_text(json.dumps(out, indent=2) + "\n")
