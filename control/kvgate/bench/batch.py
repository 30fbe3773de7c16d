"""``kvgate bench batch``: does the Batch API's prefix-grouped schedule pay, and does it leave
live traffic alone? (issue 14's two benchmark acceptances)

On the running stack (``kvgate up policies/demo.yaml``):

1. **The workload** (:func:`make_lines`, seeded): ``--docs`` documents of ``--doc-tokens``
   simulator tokens each (one token is one word, docs/simulator.md), ``--questions`` questions
   per document, one chat line per question (system prompt, then the document and the question
   in the user message, ``max_tokens`` ``--max-tokens``), shuffled, as a Batch API input file.
   Every run of the command salts the system prompt, so no answer cached by an earlier run is
   served.
2. **File order** (the way an offline job is sent today): the same lines posted one by one in
   the file's order through the gateway at ``--concurrency`` (the policy's
   ``batch.max_in_flight`` by default: the batch worker's ceiling), ``Cache-Control: no-store``,
   once under round robin and once under the pool's own balancer (switched through the control
   plane, as ``kvgate replay`` does).
3. **The Batch API**: the file uploaded with the OpenAI SDK, a batch created and polled to
   ``completed`` (a progress bar), with the pool's balancer.
4. With ``--live TRACE``: the first ``--live-requests`` trace requests replayed (as ``kvgate
   replay`` does) alone, then again while a fresh batch of the same shape runs; the TTFT p99
   of both, and whether the batch finished.

Before each run every engine's prefix cache is reset; the figures are the engines' own counters
(``vllm:prompt_tokens_total`` − ``vllm:prefix_cache_hits_total`` = prefill tokens computed).
Nothing else may use the engines meanwhile. Run by hand; the figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import requests
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .replay import ReplayError, _percentile, reset_prefix_caches, send_trace, wait_engines_idle
from .trace import load_trace

PROMPT = "vllm:prompt_tokens_total"
HITS = "vllm:prefix_cache_hits_total"
SUCCESS = "vllm:request_success_total"


def make_lines(*, docs: int, questions: int, doc_tokens: int, max_tokens: int, model: str, seed: int,
               salt: str = "") -> list[dict[str, Any]]:
    """The benchmark's batch input lines, shuffled (``random.Random(seed)``).

    Line ``d<i>-q<j>`` asks question ``j`` about document ``i``: messages = a system prompt
    (salted with ``salt``) and one user message ``Document <i>:\\n<doc_tokens words>\\n\\n
    Question <j>: ...``. Documents share no words, so their prefixes share no block.
    """
    rng = random.Random(seed)
    system = f"You answer questions about the document you are given, briefly. Run {salt}".strip()
    lines = []
    for i in range(docs):
        words = " ".join(f"d{i}w{rng.randrange(100_000)}" for _ in range(doc_tokens))
        for j in range(questions):
            q = f"Question {j}: what does the document say about topic {rng.randrange(10_000)}?"
            lines.append({
                "custom_id": f"d{i}-q{j}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                         "messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": f"Document {i}:\n{words}\n\n{q}"}]},
            })
    rng.shuffle(lines)
    return lines


def engine_totals(nodes, timeout: float = 5.0) -> dict[str, float]:
    """Σ over the engines (every label set) of the prompt, prefix-hit and success counters.

    Raises:
        ReplayError: an engine's /metrics does not answer or parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys((PROMPT, HITS, SUCCESS), 0.0)
    for n in nodes:
        try:
            resp = requests.get(f"{n.url}/metrics", timeout=timeout)
            resp.raise_for_status()
            for family in text_string_to_metric_families(resp.text):
                for sample in family.samples:
                    if sample.name in out:
                        out[sample.name] += sample.value
        except (requests.RequestException, ValueError) as exc:
            raise ReplayError(f"node {n.id}: cannot read {n.url}/metrics: {exc}") from None
    return out


@dataclass
class RunFigures:
    """One run: engine counter deltas and the client's view."""

    name: str
    lines: int
    ok: int = 0
    failed: int = 0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    engine_requests: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> float:
        """Prefill tokens the engines computed (prompt − prefix-cache hits)."""
        return self.prompt_tokens - self.cached_tokens


def _measure(nodes, name: str, lines: int, work) -> RunFigures:
    reset_prefix_caches(nodes)
    wait_engines_idle(nodes)
    before = engine_totals(nodes)
    t0 = time.monotonic()
    fig = RunFigures(name=name, lines=lines)
    work(fig)
    wait_engines_idle(nodes, timeout=120)
    fig.wall_s = round(time.monotonic() - t0, 2)
    after = engine_totals(nodes)
    fig.prompt_tokens = after[PROMPT] - before[PROMPT]
    fig.cached_tokens = after[HITS] - before[HITS]
    fig.engine_requests = after[SUCCESS] - before[SUCCESS]
    return fig


def send_file_order(gateway: str, lines: list[dict[str, Any]], concurrency: int, progress: Progress,
                    fig: RunFigures, timeout_s: float = 300.0) -> None:
    """POST every line's body in file order, at most ``concurrency`` at once (``no-store``)."""
    task = progress.add_task(fig.name, total=len(lines))
    local = threading.local()

    def one(line: dict[str, Any]) -> bool:
        s = getattr(local, "s", None)
        if s is None:
            s = local.s = requests.Session()
        try:
            resp = s.post(gateway + line["url"], json=line["body"], timeout=timeout_s,
                          headers={"Cache-Control": "no-store"})
            return resp.status_code == 200
        except requests.RequestException:
            return False
        finally:
            progress.advance(task)

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, lines))
    fig.ok = sum(results)
    fig.failed = len(results) - fig.ok


def run_batch(client, lines: list[dict[str, Any]], progress: Progress, fig: RunFigures,
              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Upload ``lines`` with the OpenAI SDK, create a batch, poll it to a terminal status.

    Returns the final Batch object (as a dict). Raises ReplayError on a timeout.
    """
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("bench-batch.jsonl", io.BytesIO(data)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"source": "kvgate bench batch"})
    task = progress.add_task(fig.name, total=len(lines))
    deadline = time.monotonic() + timeout_s
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            raise ReplayError(f"batch {b.id} still {b.status} after {timeout_s:.0f} s")
        time.sleep(0.5)
        b = client.batches.retrieve(b.id)
        rc = b.request_counts
        if rc is not None:
            progress.update(task, completed=rc.completed + rc.failed)
    rc = b.request_counts
    fig.ok, fig.failed = (rc.completed, rc.failed) if rc else (0, len(lines))
    if b.status != "completed":
        fig.notes.append(f"batch ended {b.status}: {b.errors}")
    if b.output_file_id:
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines() if x.strip()]
        ids = [x["custom_id"] for x in out]
        if len(ids) != len(set(ids)) or set(ids) != {x["custom_id"] for x in lines} and not fig.failed:
            fig.notes.append("output ids differ from the input's")
    return b.model_dump()


def _tenant_key(stack, policy, tenant: str) -> tuple[str, Any]:
    """An API key for ``tenant`` (created through the control plane; revoked by the returned
    ``revoke()``), or a placeholder when ``gateway.auth`` is off."""
    from ..control.client import ControlClient
    from ..control.token import read_token

    if policy.gateway.auth == "off":
        return "kvgate-auth-off", lambda: None
    client = ControlClient(stack.control_url(policy), read_token(stack.token_file), timeout=60)
    made = client.create_key(tenant, name="kvgate bench batch")
    return made["secret"], lambda: client.revoke_key(made["key"]["id"])


@click.command("batch")
@click.option("--docs", type=click.IntRange(min=1), default=40, show_default=True)
@click.option("--questions", type=click.IntRange(min=1), default=20, show_default=True,
              help="Questions (lines) per document.")
@click.option("--doc-tokens", type=click.IntRange(min=1), default=3000, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=int, default=14, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="File-order runs' concurrency (default: the policy's batch.max_in_flight).")
@click.option("--tenant", default="default", show_default=True, help="Tenant whose key runs the batch.")
@click.option("--live", "live_trace", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Also measure live traffic's TTFT with and without a batch running (a trace file).")
@click.option("--live-requests", type=click.IntRange(min=10), default=500, show_default=True)
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Live trace: divide arrival times by this (1 / simulator.time_scale).")
@click.option("--skip-file-order", is_flag=True, help="Only the batch (and --live) runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the figures as JSON here.")
@click.pass_context
def batch_command(ctx: click.Context, docs: int, questions: int, doc_tokens: int, max_tokens: int, seed: int,
                  concurrency: int | None, tenant: str, live_trace: Path | None, live_requests: int,
                  speedup: float, skip_file_order: bool, json_path: Path | None) -> None:
    """Prefill computed by a prefix-grouped batch against the same lines sent in file order,
    and (--live) a trace's TTFT p99 with and without a batch running."""
    import openai

    from .cli import _balancer_switch
    from .costs import running_stack

    console = Console(stderr=True)
    stack, policy = running_stack(ctx)
    pool = policy.pools[0]
    nodes = pool.nodes
    gateway = f"http://{policy.gateway.listen}"
    conc = concurrency or policy.batch.max_in_flight
    salt = f"{time.time():.6f}"
    lines = make_lines(docs=docs, questions=questions, doc_tokens=doc_tokens, max_tokens=max_tokens,
                       model=pool.models[0], seed=seed, salt=salt)
    console.print(f"{len(lines)} lines: {docs} documents x {questions} questions, {doc_tokens} tokens each, "
                  f"through {gateway} (pool {pool.name}: {len(nodes)} engines, balancer {pool.balancer})")
    runs: list[RunFigures] = []
    live: dict[str, Any] = {}
    key, revoke = _tenant_key(stack, policy, tenant)
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=2, timeout=120)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            if not skip_file_order:
                apply, restore = _balancer_switch(stack, policy, policy)
                try:
                    for bal in dict.fromkeys(("round_robin", pool.balancer)):
                        apply(bal)
                        runs.append(_measure(nodes, f"file order, {bal}", len(lines), lambda fig: send_file_order(
                            gateway, lines, conc, progress, fig)))
                finally:
                    restore()
            runs.append(_measure(nodes, f"Batch API, {pool.balancer}", len(lines),
                                 lambda fig: run_batch(client, lines, progress, fig)))
            if live_trace:
                live = _live(stack, policy, client, live_trace, live_requests, speedup, progress, console,
                             docs=docs, questions=questions, doc_tokens=doc_tokens, max_tokens=max_tokens, seed=seed)
    except (ReplayError, requests.RequestException, openai.OpenAIError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        try:
            revoke()
        except Exception as exc:  # noqa: BLE001 - a leftover bench key is reported, not fatal
            console.print(f"[yellow]could not revoke the bench's API key: {exc}[/]")

    batch_run = runs[-1]
    table = Table(title=f"kvgate bench batch: {len(lines)} lines over {docs} documents "
                  f"({doc_tokens} tokens each), file-order concurrency {conc}")
    for col in ("run", "ok", "failed", "engine requests", "prompt tokens", "prefix-cache hits",
                "prefill computed", "batch ÷ this", "wall s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for fig in runs:
        ratio = batch_run.prefill_tokens / fig.prefill_tokens if fig.prefill_tokens else float("nan")
        table.add_row(fig.name, str(fig.ok), str(fig.failed), f"{fig.engine_requests:.0f}",
                      f"{fig.prompt_tokens:,.0f}", f"{fig.cached_tokens:,.0f}", f"{fig.prefill_tokens:,.0f}",
                      "—" if fig is batch_run else f"{ratio:.3f}", f"{fig.wall_s:.1f}")
    out_console = Console(width=None if sys.stdout.isatty() else 150)
    out_console.print(table)
    for fig in runs:
        for note in fig.notes:
            console.print(f"[yellow]{fig.name}: {note}[/]")
    if live:
        out_console.print(f"live traffic ({live['requests']} trace requests): TTFT p99 {live['alone_p99_s']:.3f} s "
                        f"alone, {live['with_batch_p99_s']:.3f} s with a batch running "
                        f"(x{live['ratio']:.2f}; the batch {live['batch_status']} "
                        f"{live['batch_completed']}/{live['batch_total']} lines, "
                        f"in {live['batch_wall_s']:.0f} s)")
    if json_path:
        out = {"lines": len(lines), "docs": docs, "questions": questions, "doc_tokens": doc_tokens,
               "concurrency": conc, "runs": [{**asdict(f), "prefill_tokens": f.prefill_tokens} for f in runs],
               "live": live}
        json_path.write_text(json.dumps(out, indent=2) + "\n")


def _live(stack, policy, client, trace_path: Path, n: int, speedup: float, progress: Progress, console: Console,
          **shape: Any) -> dict[str, Any]:
    """The trace's TTFT p99 alone, then with a batch of ``shape`` running (a new salt)."""
    pool = policy.pools[0]
    gateway = f"http://{policy.gateway.listen}"
    trace = load_trace(trace_path, n)

    def replay(name: str) -> list:
        task = progress.add_task(name, total=len(trace))
        return asyncio.run(send_trace(gateway, pool.models[0], trace, speedup, 128,
                                      on_done=lambda _r: progress.advance(task),
                                      headers=lambda _r: {"Cache-Control": "no-store"}))

    reset_prefix_caches(pool.nodes)
    alone = replay("live trace, alone")
    wait_engines_idle(pool.nodes, timeout=120)
    reset_prefix_caches(pool.nodes)
    lines = make_lines(model=pool.models[0], salt=f"live {time.time():.6f}", **shape)
    result: dict[str, Any] = {}
    fig = RunFigures(name="Batch API beside live traffic", lines=len(lines))
    t0 = time.monotonic()

    def batch() -> None:
        try:
            result.update(run_batch(client, lines, progress, fig))
        except Exception as exc:  # noqa: BLE001 - reported in the figures
            result["error"] = str(exc)
        result["wall_s"] = time.monotonic() - t0

    th = threading.Thread(target=batch, daemon=True)
    th.start()
    time.sleep(1.0)  # the batch is validated and running when the live traffic starts
    together = replay("live trace, batch running")
    th.join(timeout=3600)
    p_alone = _percentile([r.ttft_s for r in alone if r.ok and r.ttft_s is not None], 99)
    p_with = _percentile([r.ttft_s for r in together if r.ok and r.ttft_s is not None], 99)
    counts = result.get("request_counts") or {}
    return {"requests": len(trace), "alone_p99_s": round(p_alone, 4), "with_batch_p99_s": round(p_with, 4),
            "ratio": round(p_with / p_alone, 3) if p_alone else float("nan"),
            "alone_failed": sum(not r.ok for r in alone), "with_batch_failed": sum(not r.ok for r in together),
            "batch_status": result.get("status", result.get("error", "?")),
            "batch_completed": counts.get("completed", 0), "batch_total": counts.get("total", len(lines)),
            "batch_wall_s": round(result.get("wall_s", 0.0), 1)}
