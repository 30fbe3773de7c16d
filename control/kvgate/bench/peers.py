"""``kvgate bench peers TRACE``: kvgate's balancers and the Rust peer routers side by side, in one run.

One set of engines for every row: the bench starts a private kvgate stack (``kvgate up`` of the
policy, default ``policies/demo.yaml``, every port moved to a free one, so it runs beside a demo
stack) with its simulated engines (``kvgate.sim``), once. Then, per row:

* kvgate: the control plane applies the policy with that balancer (as ``kvgate replay`` does);
  the rows are every balancer the policy schema accepts (:data:`kvgate.policy.model.Balancer`,
  read at run time) or ``--balancers``;
* a peer router (``sglang-router``, ``smg``, ``vllm-router`` from ``--peers-venv``, a venv of
  its own: never a dependency of kvgate or its tests) is started over the same engines' URLs
  with the settings in :data:`PEERS`, and stopped after its row.

Each row resets the engines' prefix caches (``POST /reset_prefix_cache``), sends the same trace
requests rendered the same way (:mod:`kvgate.bench.trace`) with :func:`kvgate.bench.replay.send_trace`,
waits for the engines to be idle and reads their counters; the pooled ceiling is computed once
(:mod:`kvgate.bench.ceiling`). Requests to kvgate carry no session header (it keys on the
prompt's first ``prefix_chars``); vllm-router's ``consistent_hash`` keys chat requests only on
a header, so its requests carry ``X-Session-Id`` = the conversation (:func:`conversation_id`).
Figures and the peers' settings: ``docs/benchmarks.md`` ("Peers side by side").
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import click
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .replay import PolicyReport, ReplayError, RequestResult, build_report, compute_ceiling, pooled_capacity, \
    reset_prefix_caches, scrape_engine, send_trace, wait_engines_idle
from .trace import TraceRequest, load_trace

SESSION_HEADER = "X-Session-Id"
ROUTERS = ("sglang-router", "smg", "vllm-router")


@dataclass(frozen=True)
class Peer:
    """One peer row: ``router`` (its package's command) with ``policy`` and ``settings`` (extra
    command-line arguments), ``why`` those settings, and whether its requests carry
    :data:`SESSION_HEADER`."""

    router: str
    policy: str
    settings: tuple[str, ...] = ()
    why: str = ""
    session_header: bool = False

    @property
    def label(self) -> str:
        return f"{self.router} {self.policy}"


# The settings each peer gets for the conversation trace on 4 engines: the best of the variants
# tried on the first 500 requests (docs/benchmarks.md, "Peers side by side", lists them and why).
PEERS: tuple[Peer, ...] = (
    Peer("sglang-router", "cache_aware", why="its defaults (cache threshold 0.3, balance thresholds 64 / 1.5, "
         "a 64 Mi-character tree, eviction every 60 s): lower balance thresholds (16, 4 / 1.2) or a tree of "
         "the engines' size did no better"),
    Peer("sglang-router", "round_robin", why="no setting"),
    Peer("smg", "cache_aware", ("--load-monitor-interval", "1", "--worker-warmup-secs", "0",
                                "--worker-warmup-divert-every", "0"),
         why="engine loads polled every 1 s, not 10 s (the trace runs 10x faster: 10 s would be 100 s of "
             "trace time, and its stale loads piled requests on one engine); no warm-up slice (every worker "
             "starts with the others here; it diverted hits to 'thin' workers)"),
    Peer("smg", "prefix_hash", ("--prefix-token-count", "1024", "--load-monitor-interval", "1"),
         why="1024 tokens = 4,096 characters hashed on untokenized requests: kvgate's prefix_chars "
             "(past the trace's shared 3.6 kB system prompt into the conversation's first block; the "
             "default 256 tokens ends inside it: 0.44 of the ceiling); its bounded load at the default "
             "1.25 x the mean (1.1 did no better); loads polled every 1 s as for cache_aware"),
    Peer("vllm-router", "cache_aware", why="its defaults (as sglang-router's; thresholds 0.1 and 0.5 did no "
         "better); its tree needs the engine's POST /v1/chat/completions/render, which kvgate.sim does "
         "not serve (debug log: render_unavailable), so on the simulator it routes without the prompt"),
    Peer("vllm-router", "consistent_hash", why=f"{SESSION_HEADER}: the conversation (the trace's first "
         "block after the shared system prompt), the key kvgate derives from the prompt; 0.1.17 ignores "
         "the body's user and session_id", session_header=True),
)


def conversation_id(req: TraceRequest) -> str:
    """The conversation a trace request belongs to: its first block after the shared system block
    (``hash_ids[1]``; ``hash_ids[0]`` for a one-block prompt). Turns of one conversation share it,
    and it is what kvgate's 4,096-character prefix key resolves to on this trace."""
    ids = req.hash_ids
    return f"conv-{ids[1] if len(ids) > 1 else ids[0] if ids else 'none'}"


def balancers_of_schema() -> list[str]:
    """Every balancer the policy schema accepts, in its order (read at run time)."""
    from ..policy import model

    return list(typing.get_args(model.Balancer))


def parse_balancers(spec: str | None, known: list[str]) -> list[str]:
    """``--balancers``: comma-separated, each one of ``known``, none twice; ``none`` for no kvgate
    row; None/empty = all of ``known``. Raises click.BadParameter."""
    if spec is None or not spec.strip():
        return list(known)
    if spec.strip() == "none":
        return []
    names = [b.strip() for b in spec.split(",") if b.strip()]
    bad = [b for b in names if b not in known]
    if bad:
        raise click.BadParameter(f"unknown balancer(s) {', '.join(bad)}; the policy schema accepts "
                                 f"{', '.join(known)}", param_hint="--balancers")
    if len(set(names)) != len(names):
        raise click.BadParameter(f"a balancer is listed twice: {spec}", param_hint="--balancers")
    return names


def parse_peer_variant(spec: str) -> Peer:
    """``--peer 'ROUTER:POLICY ARGS...'``: a row of ``ROUTER`` with ``POLICY`` and exactly ``ARGS``
    (e.g. ``sglang-router:cache_aware --balance-abs-threshold 16``), to try other settings.
    Raises click.BadParameter."""
    import shlex

    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise click.BadParameter(f"{spec!r}: {exc}", param_hint="--peer") from None
    router, _, policy = (words[0] if words else "").partition(":")
    if router not in ROUTERS or not policy:
        raise click.BadParameter(f"{spec!r}: expected ROUTER:POLICY [ARGS...] with ROUTER one of "
                                 f"{', '.join(ROUTERS)}", param_hint="--peer")
    session = any(p.session_header for p in PEERS if p.router == router and p.policy == policy)
    return Peer(router, policy, tuple(words[1:]), why="--peer", session_header=session)


def parse_peers(spec: str | None) -> list[Peer]:
    """``--peers``: comma-separated labels ``ROUTER:POLICY`` (or a bare ROUTER for all its rows) of
    :data:`PEERS`; ``none`` for no peer; None/empty = all. Raises click.BadParameter."""
    if spec is None or not spec.strip():
        return list(PEERS)
    if spec.strip() == "none":
        return []
    out: list[Peer] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        router, _, policy = item.partition(":")
        picked = [p for p in PEERS if p.router == router and (not policy or p.policy == policy)]
        if not picked:
            choices = ", ".join(f"{p.router}:{p.policy}" for p in PEERS)
            raise click.BadParameter(f"unknown peer {item!r}; choose from {choices}", param_hint="--peers")
        out.extend(p for p in picked if p not in out)
    return out


# ------------------------------------------------------------------ the stack
def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_policy_doc(doc: dict) -> dict:
    """The policy document with every listen address, the Redis URL and every node's URL moved to
    a free loopback port (so the bench runs beside any stack). Every node must be ``simulate:
    true``: the bench compares routers on engines it starts itself.

    Raises:
        click.UsageError: a node is not simulated or the document has no pools.
    """
    doc = json.loads(json.dumps(doc))  # a deep copy
    gw = doc.setdefault("gateway", {})
    gw["listen"] = f"127.0.0.1:{_free_port()}"
    gw["internal_listen"] = f"127.0.0.1:{_free_port()}"
    doc.setdefault("redis", {})["url"] = f"redis://127.0.0.1:{_free_port()}/0"
    doc.setdefault("control", {})["listen"] = f"127.0.0.1:{_free_port()}"
    pools = doc.get("pools") or []
    if not pools:
        raise click.UsageError("the policy has no pools")
    for pool in pools:
        for node in pool.get("nodes") or []:
            if not node.get("simulate"):
                raise click.UsageError(f"node {node.get('id')} is not `simulate: true`: the bench starts its "
                                       "own engines (kvgate.sim) and needs every node simulated")
            node["url"] = f"http://127.0.0.1:{_free_port()}"
    return doc


# ------------------------------------------------------------------ the peers
def peer_available(venv: Path, router: str) -> bool:
    """Whether ``venv`` holds ``router`` (smg is looked up as its package: sglang-router 0.3.2 also
    installs a command named ``smg``)."""
    if router == "smg":
        return bool(glob.glob(str(venv / "lib" / "python*" / "site-packages" / "smg" / "__init__.py")))
    return (venv / "bin" / router).exists()


def peer_command(venv: Path, peer: Peer, port: int, metrics_port: int, workers: list[str]) -> list[str]:
    """The command line that starts ``peer`` on 127.0.0.1:``port`` over ``workers`` (URLs), its
    Prometheus listener on 127.0.0.1:``metrics_port`` (their defaults bind 0.0.0.0)."""
    if peer.router == "sglang-router":
        base, level = [str(venv / "bin" / "sglang-router"), "launch"], "warn"
    elif peer.router == "smg":
        base, level = [str(venv / "bin" / "python"), "-m", "smg", "launch"], "warn"
    elif peer.router == "vllm-router":
        base, level = [str(venv / "bin" / "vllm-router")], "warning"
    else:
        raise ValueError(f"unknown router {peer.router}")
    return [*base, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", peer.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", level, *peer.settings]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _workers_listed(url: str) -> int | None:
    """How many workers a router's ``GET /workers`` lists, or None when it does not say."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=2) as r:
            doc = json.loads(r.read())
    except Exception:  # noqa: BLE001 - any failure means: unknown
        return None
    if isinstance(doc, list):
        return len(doc)
    if isinstance(doc, dict):
        for key in ("workers", "urls"):
            if isinstance(doc.get(key), list):
                return len(doc[key])
        if isinstance(doc.get("total"), int):
            return doc["total"]
    return None


def start_peer(venv: Path, peer: Peer, workers: list[str], model: str, log_path: Path,
               timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """Start ``peer`` and wait until it answers a chat request and lists every worker.

    Returns (the process, its base URL). Raises ReplayError (with the log's tail) when it exits
    or is not ready within ``timeout`` s; the process is stopped then.
    """
    port = _free_port()
    cmd = peer_command(venv, peer, port, _free_port(), workers)
    env = dict(os.environ, HF_HUB_OFFLINE="1", RUST_LOG="warn", NO_COLOR="1")
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ready"}], "max_tokens": 1,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout
    answered = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if not answered:
                req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    answered = r.status == 200
            if answered:
                listed = _workers_listed(url)
                if listed is None or listed >= len(workers):
                    return proc, url
        except Exception:  # noqa: BLE001 - not ready yet
            pass
        time.sleep(0.25)
    _stop(proc)
    tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
    raise ReplayError(f"{peer.label} did not become ready within {timeout:.0f} s (exit {proc.returncode}); "
                      f"its log {log_path}:\n{tail}")


# ------------------------------------------------------------------ the table
@dataclass
class Row:
    """One router/policy's result: ``settings`` as printed and documented."""

    router: str
    policy: str
    settings: str
    report: PolicyReport

    def as_json(self) -> dict:
        return {"router": self.router, "policy": self.policy, "settings": self.settings,
                **self.report.as_json(), "prefill_tokens": self.report.prefill_tokens,
                "engine_ttft_mean_s": self.report.engine_ttft_mean_s}


@dataclass
class BenchResult:
    trace: str
    requests: int
    speedup: float
    ceiling: float
    rows: list[Row] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"trace": self.trace, "requests": self.requests, "speedup": self.speedup,
                "ceiling": self.ceiling, "rows": [r.as_json() for r in self.rows]}


def _ms(s: float) -> str:
    return "-" if s != s else f"{s * 1000:,.0f} ms"  # NaN: no request answered


def render_table(result: BenchResult) -> Table:
    """One row per router/policy: the engines' hit ratio, its ratio to the pooled ceiling, the
    imbalance of prefill work, client TTFT p50/p99 and failures."""
    table = Table(title=f"kvgate bench peers: {result.requests} requests of {result.trace} at speedup "
                        f"{result.speedup:g}, pooled ceiling {result.ceiling:.1%}", title_justify="left")
    for col, justify in (("router", "left"), ("policy", "left"), ("hit ratio", "right"), ("÷ ceiling", "right"),
                         ("imbalance", "right"), ("TTFT p50", "right"), ("TTFT p99", "right"),
                         ("engine TTFT", "right"), ("prefill", "right"), ("failed", "right")):
        table.add_column(col, justify=justify)
    for row in result.rows:
        r = row.report
        table.add_row(row.router, row.policy, f"{r.hit_ratio:.1%}", f"{r.ratio_to_ceiling:.2f}",
                      f"{r.imbalance:.2f}", _ms(r.ttft_p50_s), _ms(r.ttft_p99_s), _ms(r.engine_ttft_mean_s),
                      f"{r.prefill_total / 1e6:.2f}M", f"{r.requests_failed} / {r.requests_ok + r.requests_failed}")
    return table


def render_markdown(result: BenchResult) -> str:
    """The same table as markdown, for docs/benchmarks.md."""
    lines = ["| router | policy | hit ratio | ÷ ceiling | imbalance | TTFT p50 | TTFT p99 | engine TTFT mean "
             "| prefill tokens | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result.rows:
        r = row.report
        lines.append(f"| {row.router} | {row.policy} | {r.hit_ratio:.1%} | {r.ratio_to_ceiling:.2f} | "
                     f"{r.imbalance:.2f} | {_ms(r.ttft_p50_s)} | {_ms(r.ttft_p99_s)} | "
                     f"{_ms(r.engine_ttft_mean_s)} | {r.prefill_total / 1e6:.2f}M | "
                     f"{r.requests_failed} / {r.requests_ok + r.requests_failed} |")
    return "\n".join(lines)


def best_row(rows: list[Row], tie: float = 0.01) -> Row | None:
    """The row with the highest ratio to the ceiling; among rows within ``tie`` of it, the one
    with the lowest client TTFT p99. None for no rows."""
    if not rows:
        return None
    top = max(r.report.ratio_to_ceiling for r in rows)
    return min((r for r in rows if r.report.ratio_to_ceiling >= top - tie), key=lambda r: r.report.ttft_p99_s)


def comparison(result: BenchResult) -> str | None:
    """One line: kvgate's best balancer against the best peer (:func:`best_row` of each side), by
    ratio to the ceiling and client TTFT p99, with the differences; None without both sides."""
    ours = best_row([r for r in result.rows if r.router == "kvgate"])
    peer = best_row([r for r in result.rows if r.router != "kvgate"])
    if not ours or not peer:
        return None
    a, b = ours.report, peer.report
    return (f"kvgate's best, {ours.policy}: {a.ratio_to_ceiling:.2f} of the ceiling, TTFT p99 {_ms(a.ttft_p99_s)}; "
            f"the best peer, {peer.router} {peer.policy}: {b.ratio_to_ceiling:.2f}, {_ms(b.ttft_p99_s)} "
            f"(kvgate {a.ratio_to_ceiling - b.ratio_to_ceiling:+.2f} of the ceiling, "
            f"{(a.ttft_p99_s - b.ttft_p99_s) * 1000:+,.0f} ms p99)")


# ------------------------------------------------------------------ the run
def _run_one(console: Console, label: str, url: str, nodes, model: str, trace: list[TraceRequest],
             speedup: float, concurrency: int, max_tokens_cap: int | None, ceiling: float,
             headers=None) -> PolicyReport:
    """Reset the caches, send the trace through ``url``, wait for idle engines, report."""
    reset_prefix_caches(nodes)
    before = {n.id: scrape_engine(n) for n in nodes}
    with Progress(TextColumn(f"{label:>28}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(label, total=len(trace), failed=0)
        failed = 0

        def done(r: RequestResult) -> None:
            nonlocal failed
            failed += not r.ok
            progress.update(task, advance=1, failed=failed)

        results = asyncio.run(send_trace(url, model, trace, speedup, concurrency, max_tokens_cap,
                                         on_done=done, headers=headers))
    wait_engines_idle(nodes)
    after = {n.id: scrape_engine(n) for n in nodes}
    report = build_report(results, before, after, ceiling)
    for err in report.errors:
        console.print(f"  [red]error[/]: {err}")
    return report


@click.command("peers")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default="policies/demo.yaml", show_default=True,
              help="The policy whose pool, simulator and kvgate settings to run (its ports are replaced by "
              "free ones; every node must be `simulate: true`).")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Replay the first N requests.")
@click.option("--balancers", default=None,
              help="Comma-separated kvgate balancers, or 'none' [default: every one the policy schema accepts].")
@click.option("--peers", "peers_spec", default=None,
              help="Comma-separated peer rows ROUTER:POLICY (or ROUTER), or 'none' [default: all that "
              "--peers-venv holds].")
@click.option("--peer", "peer_variants", multiple=True, metavar="'ROUTER:POLICY ARGS...'",
              help="One more peer row with exactly these settings (repeatable), e.g. "
              "'sglang-router:cache_aware --balance-abs-threshold 16'.")
@click.option("--peers-venv", type=click.Path(file_okay=False, path_type=Path), envvar="KVGATE_PEERS_VENV",
              default=None, help="A venv with sglang-router, smg and/or vllm-router (pip install sglang-router "
              "smg vllm-router) [env KVGATE_PEERS_VENV].")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Divide the trace's arrival times by this (match 1/simulator.time_scale).")
@click.option("--concurrency", type=click.IntRange(min=1), default=128, show_default=True,
              help="Most requests in flight at once.")
@click.option("--max-tokens-cap", type=click.IntRange(min=1), default=None,
              help="Cap each request's max_tokens (default: the trace's output length).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the table as JSON here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the table as markdown here.")
def peers_command(trace_path: Path, policy_path: Path, limit: int, balancers: str | None, peers_spec: str | None,
                  peer_variants: tuple[str, ...], peers_venv: Path | None, speedup: float, concurrency: int, max_tokens_cap: int | None,
                  json_path: Path | None, md_path: Path | None) -> None:
    """Replay TRACE through kvgate (each balancer) and the Rust peer routers on the same engines.

    Starts a private kvgate stack of the policy (its simulated engines, Redis, the control plane,
    nginx; free ports) once, then one row per kvgate balancer and per peer router/policy, each
    after a reset of the engines' prefix caches, and prints one table. Exit 1 when a request
    failed or a router did not start, 2 for bad arguments.
    """
    from ..control.client import ControlError
    from ..nginxctl import NginxError
    from ..policy import PolicyError, load_policy
    from ..stack import Stack, StackError
    from .cli import _balancer_switch

    console = Console(stderr=True, soft_wrap=True)  # log lines unwrapped (paths, commands)
    names = parse_balancers(balancers, balancers_of_schema())
    peers = parse_peers(peers_spec) + [parse_peer_variant(v) for v in peer_variants]
    if peers and (peers_spec is not None or peer_variants) and not peers_venv:
        raise click.BadParameter("peer rows need --peers-venv (or KVGATE_PEERS_VENV)", param_hint="--peers")
    if peers and not peers_venv:
        console.print("(no --peers-venv: kvgate rows only)")
        peers = []
    if peers_venv:
        missing = sorted({p.router for p in peers if not peer_available(peers_venv, p.router)})
        for router in missing:
            console.print(f"({router} not in {peers_venv}: its rows are skipped)")
        peers = [p for p in peers if p.router not in missing]
    if not names and not peers:
        raise click.UsageError("nothing to run: no kvgate balancer and no peer")
    for path, hint in ((json_path, "--json"), (md_path, "--markdown")):
        if path is not None:
            parent = path.resolve().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise click.BadParameter(f"cannot write {path}: {parent} is not a writable folder", param_hint=hint)
    try:
        doc = yaml.safe_load(policy_path.read_text())
        trace = load_trace(trace_path, limit)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if not trace:
        click.echo(f"error: {trace_path} holds no requests", err=True)
        sys.exit(2)

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM/SIGHUP unwind like Ctrl-C, so the `finally` below stops the routers and the stack
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    bench_doc = bench_policy_doc(doc)
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-peers-"))
    bench_policy = work / "policy.yaml"
    bench_policy.write_text(yaml.safe_dump(bench_doc, sort_keys=False))
    try:
        policy = load_policy(bench_policy)
    except PolicyError as exc:
        shutil.rmtree(work, ignore_errors=True)
        click.echo(f"error: invalid policy {exc}", err=True)
        sys.exit(2)
    pool = policy.pools[0]
    nodes, model = pool.nodes, pool.models[0]
    stack = Stack(work / "run")
    result = BenchResult(trace_path.name, len(trace), speedup, 0.0)
    failed_start = False
    span = (trace[-1].timestamp_s - trace[0].timestamp_s) / speedup
    console.print(f"kvgate bench peers: {len(trace)} requests of {trace_path.name} (~{span:.0f} s per row at "
                  f"speedup {speedup:g}), {len(nodes)} engines, concurrency {concurrency}; kvgate: "
                  f"{', '.join(names) or '-'}; peers: {', '.join(p.label for p in peers) or '-'}; work dir {work}")
    try:
        try:
            stack.up(bench_policy, timeout=90, echo=lambda line: console.print(f"  {line}"))
        except (StackError, NginxError, PolicyError) as exc:
            click.echo(f"error: the bench stack did not start: {exc} (logs under {stack.logs})", err=True)
            sys.exit(1)
        t = time.perf_counter()
        num_blocks, block_size, source = pooled_capacity(policy, nodes)
        with Progress(TextColumn(f"{'ceiling':>28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("ceiling", total=len(trace))
            result.ceiling = round(compute_ceiling(trace, num_blocks, block_size,
                                                   on_request=lambda: progress.advance(task)), 4)
        console.print(f"pooled ceiling {result.ceiling:.1%}: one cache of {num_blocks} blocks x {block_size} "
                      f"tokens (from {source}), {time.perf_counter() - t:.1f} s")
        gateway = f"http://{policy.gateway.listen}"
        if names:
            apply_balancer, _restore = _balancer_switch(stack, policy, policy)
            for name in names:
                try:  # one row's failure (a refused policy, a busy engine) leaves the other rows
                    console.print(f"[bold]kvgate {name}[/]: {apply_balancer(name)}; the policy's other "
                                  f"settings (prefix_chars {pool.prefix_chars})")
                    report = _run_one(console, f"kvgate {name}", gateway, nodes, model, trace, speedup,
                                      concurrency, max_tokens_cap, result.ceiling)
                except (ReplayError, ControlError) as exc:
                    console.print(f"  [red]error[/]: kvgate {name}: {exc}")
                    failed_start = True
                    continue
                result.rows.append(Row("kvgate", name, f"{policy_path.name}, balancer: {name}", report))
        workers = [n.url for n in nodes]
        for peer in peers:
            settings = " ".join(("--policy", peer.policy, *peer.settings))
            console.print(f"[bold]{peer.label}[/]: {settings} ({peer.why})")
            try:
                proc, url = start_peer(peers_venv, peer, workers, model, work / f"{peer.router}-{peer.policy}.log")
            except ReplayError as exc:
                console.print(f"  [red]error[/]: {exc}")
                failed_start = True
                continue
            try:
                headers = (lambda r: {SESSION_HEADER: conversation_id(r)}) if peer.session_header else None
                report = _run_one(console, peer.label, url, nodes, model, trace, speedup, concurrency,
                                  max_tokens_cap, result.ceiling, headers=headers)
            except ReplayError as exc:
                console.print(f"  [red]error[/]: {peer.label}: {exc}")
                failed_start = True
                continue
            finally:
                _stop(proc)
            note = settings + (f" + {SESSION_HEADER} per conversation" if peer.session_header else "")
            policy_label = " ".join((peer.policy, *peer.settings)) if peer.why == "--peer" else peer.policy
            result.rows.append(Row(peer.router, policy_label, note, report))
    except (ReplayError, ControlError) as exc:
        click.echo(f"error: {exc}", err=True)
        failed_start = True
    finally:
        stack.down(echo=lambda *_: None)

    if result.rows:
        Console(width=max(150, Console().width)).print(render_table(result))
        for row in result.rows:
            click.echo(f"  {row.router} {row.policy}: {row.settings}")
        line = comparison(result)
        if line:
            click.echo(line)
    if json_path:
        json_path.write_text(json.dumps(result.as_json(), indent=2) + "\n")
        click.echo(f"report written to {json_path}")
    if md_path:
        md_path.write_text(render_markdown(result) + "\n")
        click.echo(f"markdown written to {md_path}")
    if failed_start or any(r.report.requests_failed for r in result.rows):
        click.echo(f"(logs kept under {work})", err=True)
        sys.exit(1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # python -m kvgate.bench.peers
    peers_command()
