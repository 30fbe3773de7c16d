"""``kvgate bench semantic``: the semantic cache on the labelled set (:mod:`.labelled`) and its
lookup latency with 10,000 entries, plus the two indexes side by side.

1. **Quality** (the tune, test-only and held-out sets apart, each its own row): every pair's cached question ``a`` and asked
   question ``b`` are embedded; ``b`` hits ``a`` when both have the same conversation (scope), the
   cosine similarity is at or above the threshold and no guard tells them apart — the service's
   rule (:meth:`SemanticCache.lookup`). Precision, recall and false-hit rate (false hits / pairs
   that must miss) at the configured threshold, a sweep of thresholds (table and PNG), and the
   false-hit rate without the guards for comparison.
2. **The real service**: a private redis-server and ``kvgate semantic`` on a unix socket; each
   pair's ``a`` inserted through /insert in its own scope, ``b`` looked up through /lookup at the
   configured threshold (the figures must equal step 1's; the test-only set). Then ``--entries`` filler entries
   (embeddings of generated questions, written to Redis) in one scope, the service restarted (it
   rebuilds its index from Redis) and every labelled ``b`` looked up in that scope ``--rounds``
   times: latency p50/p99 seen by the client (HTTP over the socket included) and in the service.
3. **Indexes**: flat and hnsw at ``--index-sizes`` entries of random unit vectors in one scope:
   build time, search p50/p99, recall@1 of a perturbed vector.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

SWEEP = (0.80, 0.82, 0.84, 0.86, 0.88, 0.90, 0.92, 0.94, 0.96)


def _scope(i: int, context: str) -> str:
    return hashlib.sha256(f"bench|{i}|{context}".encode()).hexdigest()


def score(pairs, sims, rejected, threshold: float, guards_on: bool = True) -> dict:
    """Counts and rates of ``pairs`` at ``threshold``: ``tp fp fn tn precision recall false_hit_rate``."""
    tp = fp = fn = tn = 0
    for p, s, why in zip(pairs, sims, rejected):
        hit = p.context_a == p.context_b and s >= threshold and (why is None or not guards_on)
        if p.hit:
            tp, fn = tp + hit, fn + (not hit)
        else:
            fp, tn = fp + hit, tn + (not hit)
    return {"threshold": threshold, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "precision": tp / (tp + fp) if tp + fp else 1.0, "recall": tp / (tp + fn) if tp + fn else 0.0,
            "false_hit_rate": fp / (fp + tn) if fp + tn else 0.0}


def quality(embedder, name: str, threshold: float) -> dict:
    from . import guards
    from .labelled import load_pairs

    pairs = load_pairs(name)
    a = embedder.embed([p.a for p in pairs])
    b = embedder.embed([p.b for p in pairs])
    sims = [float(x) for x in (a * b).sum(axis=1)]
    rejected = [guards.check(p.b, p.a) for p in pairs]
    by_kind: dict[str, dict] = {}
    for p, s, why in zip(pairs, sims, rejected):
        k = by_kind.setdefault(p.kind, {"pairs": 0, "hits": 0})
        k["pairs"] += 1
        k["hits"] += p.context_a == p.context_b and s >= threshold and why is None
    errors = [{"kind": p.kind, "expect": "hit" if p.hit else "miss", "similarity": round(s, 3), "guard": why,
               "a": p.a, "b": p.b}
              for p, s, why in zip(pairs, sims, rejected)
              if p.hit != (p.context_a == p.context_b and s >= threshold and why is None)]
    return {"set": name, "pairs": len(pairs), "positives": sum(p.hit for p in pairs),
            "at_threshold": score(pairs, sims, rejected, threshold),
            "at_threshold_without_guards": score(pairs, sims, rejected, threshold, guards_on=False),
            "sweep": [score(pairs, sims, rejected, t) for t in SWEEP],
            "sweep_without_guards": [score(pairs, sims, rejected, t, False) for t in SWEEP],
            "by_kind": by_kind, "errors": errors, "_pairs": pairs}


def filler_texts(n: int, seed: int = 7) -> list[str]:
    """``n`` distinct generated questions (the 10,000 entries of the latency run)."""
    rnd = random.Random(seed)
    subjects = ["my account", "the invoice", "a refund", "the app", "my order", "the printer", "a python script",
                "the router", "my subscription", "the report", "a flight", "the hotel room", "my laptop",
                "the database", "a docker container", "the contract", "my phone", "the garden", "a recipe",
                "the budget", "the API", "a spreadsheet", "the car", "my bike", "the playlist", "a meeting"]
    verbs = ["fix", "set up", "check", "update", "configure", "speed up", "understand", "clean", "share",
             "protect", "move", "test", "back up", "rename", "compare", "measure", "plan", "improve"]
    forms = ["How do I {v} {s}?", "What is the best way to {v} {s}?", "Can you help me {v} {s}?",
             "Why is it hard to {v} {s}?", "Is it possible to {v} {s} remotely?", "Who can {v} {s} for me?",
             "Explain how to {v} {s} step by step.", "What tools do I need to {v} {s}?"]
    out, seen = [], set()
    while len(out) < n:
        t = rnd.choice(forms).format(v=rnd.choice(verbs), s=rnd.choice(subjects))
        t = f"{t} (case {len(out)})" if t in seen else t
        seen.add(t)
        out.append(t)
    return out


def _start_redis(base: Path) -> tuple[subprocess.Popen, int]:
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port).ping():
                return proc, port
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise click.ClickException("redis-server did not start") from None
            time.sleep(0.05)


def _start_service(base: Path, redis_port: int, index: str) -> tuple[subprocess.Popen, str]:
    from .client import SemanticClient

    policy = base / "policy.yaml"
    policy.write_text(
        "version: 1\n"
        f"redis: {{url: 'redis://127.0.0.1:{redis_port}/0', managed: false}}\n"
        f"semantic_service: {{index: {index}}}\n"
        "pools:\n  - {name: bench, models: [m], nodes: [{id: n1, url: 'http://127.0.0.1:9'}], semantic: {enabled: true}}\n")
    listen = f"unix:{base / 'semantic.sock'}"
    log = open(base / "semantic.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(base / "run"), "semantic",
                             "--policy", str(policy), "--listen", listen], stdout=log, stderr=log)
    client = SemanticClient(listen, timeout=60)
    deadline = time.monotonic() + 120
    while True:
        try:
            if client.health().get("status") == "ok":
                return proc, listen
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException(f"the semantic service did not start; see {base / 'semantic.log'}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def live(embedder, q: dict, threshold: float, entries: int, rounds: int, index: str, echo) -> dict:
    """Steps 2 (the labelled pairs through the service) and the latency run; see the module doc."""
    import redis

    from .client import SemanticClient
    from .store import Store

    base = Path(tempfile.mkdtemp(prefix="kvgate-bench-semantic-"))
    rproc, port = _start_redis(base)
    sproc = None
    try:
        sproc, listen = _start_service(base, port, index)
        c = SemanticClient(listen, timeout=30)
        pairs = q["_pairs"]
        for i, p in enumerate(pairs):
            c.insert("bench", _scope(i, p.context_a), p.a, f"kvgate:cache:bench:{i}", ttl_s=3600)
        got = [c.lookup("bench", _scope(i, p.context_b), p.b, threshold)["hit"] == "semantic"
               for i, p in enumerate(pairs)]
        tp = sum(g and p.hit for g, p in zip(got, pairs))
        fp = sum(g and not p.hit for g, p in zip(got, pairs))
        pos = sum(p.hit for p in pairs)
        service = {"tp": tp, "fp": fp, "recall": tp / pos, "false_hit_rate": fp / (len(pairs) - pos)}
        echo(f"  service on the {q['set']} set: recall {service['recall']:.3f}, false-hit rate "
             f"{service['false_hit_rate']:.3f}")
        _stop(sproc)
        sproc = None
        # the latency run: `entries` entries in one scope, written to Redis; the service rebuilds from it
        echo(f"  embedding {entries} filler questions ...")
        t0 = time.perf_counter()
        texts = filler_texts(entries)
        vecs = embedder.embed(texts, batch_size=64)
        embed_s = time.perf_counter() - t0
        store = Store(redis.Redis(port=port), "bench")
        scope = _scope(-1, "load")
        pipe_n = 0
        for t, v in zip(texts, vecs):
            store.put("bench", scope, t, f"kvgate:cache:fill:{pipe_n}", v, 3600, [], embedder.model)
            pipe_n += 1
        t0 = time.perf_counter()
        sproc, listen = _start_service(base, port, index)
        start_s = time.perf_counter() - t0
        c = SemanticClient(listen, timeout=30)
        n_index = c.health()["entries"]
        questions = [p.b for p in pairs] + [p.a for p in pairs]
        for t in questions[:20]:  # warm up
            c.lookup("bench", scope, t, threshold)
        client_ms, service_ms = [], []
        for _ in range(rounds):
            for t in questions:
                t0 = time.perf_counter()
                r = c.lookup("bench", scope, t, threshold)
                client_ms.append((time.perf_counter() - t0) * 1000)
                service_ms.append(r["ms"])
        return {**service, "entries_in_index": n_index, "lookups": len(client_ms),
                "embed_filler_s": round(embed_s, 1), "service_start_s": round(start_s, 2),
                "client_p50_ms": float(np.percentile(client_ms, 50)), "client_p99_ms": float(np.percentile(client_ms, 99)),
                "service_p50_ms": float(np.percentile(service_ms, 50)),
                "service_p99_ms": float(np.percentile(service_ms, 99))}
    finally:
        if sproc:
            _stop(sproc)
        _stop(rproc)
        shutil.rmtree(base, ignore_errors=True)


def compare_indexes(sizes: list[int], queries: int = 300, seed: int = 0) -> list[dict]:
    """Step 3: flat against hnsw (see the module doc)."""
    from .index import make_index

    kinds = ["flat"]
    try:
        import hnswlib  # noqa: F401
        kinds.append("hnsw")
    except ImportError:
        pass
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = rng.standard_normal((n, 384)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        qv = x[:queries] + 0.05 * rng.standard_normal((min(queries, n), 384)).astype(np.float32)
        qv /= np.linalg.norm(qv, axis=1, keepdims=True)
        for kind in kinds:
            ix = make_index(kind)
            t0 = time.perf_counter()
            for i in range(n):
                ix.add("s", str(i), x[i])
            build = time.perf_counter() - t0
            lat, ok = [], 0
            for i in range(len(qv)):
                t0 = time.perf_counter()
                r = ix.search("s", qv[i], 1)
                lat.append((time.perf_counter() - t0) * 1000)
                ok += r[0][0] == str(i)
            out.append({"index": kind, "entries": n, "build_s": round(build, 2),
                        "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                        "recall_at_1": ok / len(qv)})
    return out


def _part(name: str) -> str:
    """``tuned on``, ``test-only``, ``held out`` for a shipped set; ``a file`` for a TSV path."""
    from .labelled import PARTS

    return PARTS.get(name, "a file")


def plot(results: list[dict], threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, q in zip(axes[0], results):
        ts = [r["threshold"] for r in q["sweep"]]
        ax.plot(ts, [r["recall"] for r in q["sweep"]], "o-", label="recall (paraphrases served)")
        ax.plot(ts, [r["precision"] for r in q["sweep"]], "s-", label="precision")
        ax.plot(ts, [r["false_hit_rate"] for r in q["sweep"]], "^-", color="crimson", label="false-hit rate")
        ax.plot(ts, [r["false_hit_rate"] for r in q["sweep_without_guards"]], "^:", color="crimson", alpha=0.5,
                label="false-hit rate without guards")
        ax.axvline(threshold, color="grey", ls="--", lw=1)
        ax.axhline(0.01, color="crimson", ls=":", lw=0.8)
        ax.set_title(f"{q['set']} set ({q['pairs']} pairs, {_part(q['set'])})")
        ax.set_xlabel("similarity_min (cosine similarity)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="center left", fontsize=8)
    fig.suptitle("kvgate semantic cache: all-MiniLM-L6-v2-int8 + guards")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(results: list[dict], threshold: float, service: dict | None, indexes: list[dict]) -> str:
    lines = [f"### At similarity_min {threshold:.2f}, set by set", "",
             "| set | part | pairs | paraphrases | precision | recall | false-hit rate | without guards |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for q in results:
        r, ng = q["at_threshold"], q["at_threshold_without_guards"]
        lines.append(f"| {q['set']} | {_part(q['set'])} | {q['pairs']} | {q['positives']} | {r['precision']:.3f} | "
                     f"{r['recall']:.3f} | {r['false_hit_rate']:.3f} ({r['fp']} of {r['fp'] + r['tn']}) | "
                     f"{ng['false_hit_rate']:.3f} |")
    lines.append("")
    for q in results:
        r, ng = q["at_threshold"], q["at_threshold_without_guards"]
        lines += [f"### {q['set']} set ({q['pairs']} pairs, {q['positives']} paraphrases"
                  f"; {_part(q['set'])})", "",
                  f"At similarity_min {threshold:.2f}: precision {r['precision']:.3f}, recall {r['recall']:.3f}, "
                  f"false-hit rate {r['false_hit_rate']:.3f} ({r['fp']} of {r['fp'] + r['tn']}); without the guards "
                  f"the false-hit rate would be {ng['false_hit_rate']:.3f}.", "",
                  "| threshold | precision | recall | false-hit rate | without guards |", "|---|---|---|---|---|"]
        for s, n in zip(q["sweep"], q["sweep_without_guards"]):
            lines.append(f"| {s['threshold']:.2f} | {s['precision']:.3f} | {s['recall']:.3f} | "
                         f"{s['false_hit_rate']:.3f} | {n['false_hit_rate']:.3f} |")
        lines += ["", "Hits by kind at the threshold: " + ", ".join(
            f"{k} {v['hits']}/{v['pairs']}" for k, v in sorted(q["by_kind"].items())), ""]
    if service:
        lines += [f"### Lookup latency ({service['entries_in_index']} entries in the scope's index, "
                  f"{service['lookups']} lookups)", "",
                  f"client (HTTP over the unix socket): p50 {service['client_p50_ms']:.1f} ms, p99 "
                  f"{service['client_p99_ms']:.1f} ms; in the service: p50 {service['service_p50_ms']:.1f} ms, p99 "
                  f"{service['service_p99_ms']:.1f} ms. Restart with the entries in Redis: {service['service_start_s']} s "
                  "(model load + index rebuild).", ""]
    if indexes:
        lines += ["### Indexes (random unit vectors, one scope)", "",
                  "| index | entries | build (s) | search p50 (ms) | p99 (ms) | recall@1 |", "|---|---|---|---|---|---|"]
        for r in indexes:
            lines.append(f"| {r['index']} | {r['entries']} | {r['build_s']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                         f"{r['recall_at_1']:.2f} |")
    return "\n".join(lines)


@click.command("semantic")
@click.option("--threshold", type=click.FloatRange(0.5, 1.0), default=None,
              help="similarity_min to score [default: the policy's default, 0.92].")
@click.option("--sets", default="tune,test,holdout", show_default=True,
              help="Labelled sets (tune, test, holdout or TSV paths), each reported as its own row.")
@click.option("--entries", type=click.IntRange(0), default=10_000, show_default=True,
              help="Entries in the index for the latency run (0: skip the service runs).")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True, help="Lookup rounds over the set.")
@click.option("--index", type=click.Choice(["flat", "hnsw"]), default="flat", show_default=True,
              help="The service's index for the latency run.")
@click.option("--index-sizes", default="1000,10000", show_default=True,
              help="Entries for the flat/hnsw comparison (comma-separated; empty: skip).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("docs/images/semantic-sweep.png"), show_default=True, help="The sweep's PNG.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every figure as JSON.")
def semantic_bench_command(threshold, sets, entries, rounds, index, index_sizes, plot_path, json_path) -> None:
    """The semantic cache on the labelled set (precision, recall, false-hit rate, sweep, plot),
    lookup latency with --entries entries, flat against hnsw."""
    from kvgate.policy.semantic import PoolSemanticConfig

    from .embed import Embedder, EmbeddingError

    if threshold is None:
        threshold = PoolSemanticConfig().similarity_min
    try:
        embedder = Embedder()
    except EmbeddingError as exc:
        raise click.ClickException(str(exc)) from None
    results = [quality(embedder, s.strip(), threshold) for s in sets.split(",") if s.strip()]
    service = None
    if entries:
        # the service run on the test-only set (the acceptance figures), else the last set named
        on = next((q for q in results if q["set"] == "test"), results[-1])
        service = live(embedder, on, threshold, entries, rounds, index, lambda m: click.echo(m, err=True))
    sizes = [int(s) for s in index_sizes.split(",") if s.strip()]
    indexes = compare_indexes(sizes) if sizes else []
    plot(results, threshold, plot_path)
    click.echo(render(results, threshold, service, indexes))
    click.echo(f"\nplot: {plot_path}")
    if json_path:
        data = {"threshold": threshold, "quality": [{k: v for k, v in q.items() if k != "_pairs"} for q in results],
                "service": service, "indexes": indexes}
        json_path.write_text(json.dumps(data, indent=1))
    for q in results:
        for e in q["errors"]:
            click.echo(f"  {q['set']}: {e['kind']} expected {e['expect']}: sim {e['similarity']} guard {e['guard']}: "
                       f"{e['a']!r} / {e['b']!r}", err=True)
    if os.environ.get("KVGATE_BENCH_STRICT"):
        test = next((q for q in results if q["set"] == "test"), results[-1])["at_threshold"]
        if test["false_hit_rate"] > 0.01 or test["recall"] < 0.5 or (service and service["client_p99_ms"] > 30):
            raise SystemExit(1)
