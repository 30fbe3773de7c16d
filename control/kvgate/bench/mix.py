"""The bill demo's mixed workload (issue 16): its generator (:func:`load_mix`) and sender
(:func:`run_mix`). Its shares, sizes and seed are in ``bench/mix.yaml``, each share with its source.

Four kinds of traffic, each from its own tenant (``mix.yaml`` names them):

* ``trace`` — the Mooncake conversation trace's live chat (:mod:`kvgate.bench.trace`): the
  conversations (requests sharing their second block id) of the trace's first ``window_s``
  seconds, a hashed ``keep`` fraction of them, split between two tenants by a hash of that block
  id; real arrival times and prefix structure.
* ``multi_turn`` — :func:`kvgate.bench.multiturn.multi_turn_workload` (a shared ~3,000-token
  system prompt, 4–6 turns each re-sending the history), closed loop per conversation.
* ``faq`` — support questions (``bench/faq/questions.yaml`` and the pool's static answers
  ``policies/demo-faq.yaml``): exact repeats, paraphrases the semantic cache's guards pass, and
  questions (and paraphrases) the static answers cover; Poisson arrivals.
* ``batch`` — an offline job (:func:`kvgate.bench.batch.make_lines`: documents with several
  questions each): through the Batch API in ``kvgate`` mode, line by line as live requests
  (``batch_live``) in ``baseline`` mode.

Live requests stream with ``stream_options.include_usage``, carry their tenant's key
(``Authorization: Bearer``) and never ``Cache-Control: no-store`` (the policy decides what the
response cache may answer); each outcome records the client's TTFT, ``X-Kvgate-Cache`` and usage.
The same seed and file give the same requests, byte for byte, in every process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import yaml

from .trace import TraceRequest, load_trace

DEFAULT_MIX = Path(__file__).with_name("mix.yaml")
REPO_ROOT = Path(__file__).resolve().parents[3]
KINDS = ("trace", "multi_turn", "faq", "batch")
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class FaqRequest:
    """One FAQ question of the support tenant.

    ``id`` "faq-<n>"; ``start_s`` its send time in modelled seconds from the run's start;
    ``path`` the cache path it is meant for ("exact": a topic's first phrasing, "semantic": a
    paraphrase of it, "static": a phrasing or paraphrase of a static answer); ``topic`` the
    topic's first phrasing (for a static one, the answer's first question in the file)."""

    id: str
    start_s: float
    path: str
    topic: str
    text: str


@dataclass
class Mix:
    """Everything one run sends; identical for both runs of the bill (see the module)."""

    params: dict
    trace: list[TraceRequest]
    conversations: list
    faq: list[FaqRequest]
    batch_lines: list[dict]
    trace_tenant: dict[int, str] = field(default_factory=dict)   # TraceRequest.index → tenant

    @property
    def tenants(self) -> set[str]:
        """Every tenant the mix sends as (the caller creates a key for each)."""
        return set(tenant_names(self.params))

    def counts(self) -> dict[str, int]:
        """Requests per kind: trace requests, multi-turn turns, FAQ questions, batch lines."""
        return {"trace": len(self.trace), "multi_turn": sum(len(c.turns) for c in self.conversations),
                "faq": len(self.faq), "batch": len(self.batch_lines)}

    def describe(self) -> str:
        """One line: counts per kind."""
        c = self.counts()
        return (f"{c['trace']:,} trace + {c['multi_turn']:,} multi-turn turns ({len(self.conversations):,} "
                f"conversations) + {c['faq']:,} FAQ + {c['batch']:,} batch lines")


@dataclass
class RequestOutcome:
    """One live request. ``id`` is stable across runs for the same workload item ("trace-17",
    "mt-3-2", "faq-41", "batch-d2-q1"); ``kind`` "trace" | "multi_turn" | "faq" | "batch_live";
    ``ttft_s`` at the client (send → first content chunk); ``cache`` the ``X-Kvgate-Cache`` header;
    token counts from the answer's ``usage`` (None when absent)."""

    id: str
    kind: str
    tenant: str
    ok: bool
    status: int
    ttft_s: float | None
    cache: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


@dataclass
class MixResults:
    """One run: every live outcome; the Batch API job (kvgate mode; None / 0 / empty in baseline);
    ``batch_output`` the output file's ``usage`` per ``custom_id``; ``wall_s`` the run's duration."""

    live: list[RequestOutcome]
    batch_id: str | None
    batch_status: str | None
    batch_ok: int
    batch_failed: int
    wall_s: float
    batch_output: dict[str, dict] = field(default_factory=dict)


# ------------------------------------------------------------------ loading
def _stable_hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def tenant_names(params: dict) -> list[str]:
    """The tenants of ``params`` (a loaded mix.yaml), in the order of the kinds."""
    return [*params["trace"]["tenants"], params["multi_turn"]["tenant"], params["faq"]["tenant"],
            params["batch"]["tenant"]]


def read_params(path: Path | None = None) -> dict:
    """mix.yaml as a dict, checked: every kind has a share with a source, the shares add up to 1.

    Raises:
        ValueError: a share, source or section is missing or out of range (the message names it).
        OSError: the file cannot be read.
    """
    path = path or DEFAULT_MIX
    params = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(params, dict):
        raise ValueError(f"{path}: not a mapping")
    for sect in ("shares", "trace", "multi_turn", "faq", "batch"):
        if not isinstance(params.get(sect), dict):
            raise ValueError(f"{path}: {sect}: missing (a mapping)")
    total = 0.0
    for kind in KINDS:
        share = params["shares"].get(kind)
        if not isinstance(share, dict) or not isinstance(share.get("value"), (int, float)) \
                or not 0 < share["value"] < 1 or not share.get("source"):
            raise ValueError(f"{path}: shares.{kind}: needs a value in (0, 1) and a source")
        total += share["value"]
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{path}: shares: add up to {total}, not 1")
    if abs(sum(params["faq"]["paths"].values()) - 1.0) > 1e-3:
        raise ValueError(f"{path}: faq.paths: must add up to 1")
    return params


def trace_conversations(trace: list[TraceRequest], window_s: float, keep: float, tenants: list[str],
                        seed: int) -> tuple[list[TraceRequest], dict[int, str]]:
    """The requests of the first ``window_s`` seconds whose conversation (second block id, or the
    request itself when it has one block) hashes into the kept ``keep`` fraction, and each one's
    tenant (a second hash of the same id, so a conversation stays with one tenant)."""
    kept: list[TraceRequest] = []
    tenant: dict[int, str] = {}
    for r in trace:
        if r.timestamp_s >= window_s:
            break
        conv = r.hash_ids[1] if len(r.hash_ids) > 1 else f"r{r.index}"
        if _stable_hash(seed, "keep", conv) % 10_000 >= keep * 10_000:
            continue
        kept.append(r)
        tenant[r.index] = tenants[_stable_hash(seed, "tenant", conv) % len(tenants)]
    return kept, tenant


def history_share(system: int, user: int, answer: int, turns: tuple[int, int]) -> float:
    """Mean over the workload's turns (4–6 turns equally likely) of (system prompt + history) ÷
    the turn's input, in tokens: turn k (0-based) re-sends system + k × (user + answer) + user."""
    shares = []
    for n in range(turns[0], turns[1] + 1):
        for k in range(n):
            ctx = system + k * (user + answer)
            shares.append(ctx / (ctx + user))
    return sum(shares) / len(shares)


def faq_requests(params: dict, count: int, window_s: float, seed: int) -> list[FaqRequest]:
    """``count`` FAQ questions, Poisson arrivals over ``window_s``, each path drawn with
    ``faq.paths`` and each topic uniformly (``random.Random(seed)``).

    Raises:
        ValueError: the FAQ set names a static answer the static-answers file lacks.
    """
    from ..semantic.static import load_static, normalize

    fp = params["faq"]
    qs = yaml.safe_load(_resolve(fp["questions"]).read_text(encoding="utf-8"))
    static = load_static(_resolve(fp["static_answers"]))
    phrasings: dict[str, list[str]] = {}
    for ai in range(len(static.answers)):
        phrasings[static.questions[static.qa.index(ai)]] = [q for q, a in zip(static.questions, static.qa) if a == ai]
    first = {normalize(k): k for k in phrasings}
    for sp in qs.get("static_paraphrases") or []:
        k = first.get(normalize(sp["covers"]))
        if k is None:
            raise ValueError(f"{fp['questions']}: static_paraphrases: {sp['covers']!r} is not a first question "
                             f"of {fp['static_answers']}")
        phrasings[k] = phrasings[k] + list(sp["paraphrases"])
    dynamic = qs["dynamic"]
    static_topics = sorted(phrasings)
    rng = random.Random(f"{seed}-faq")
    paths = list(fp["paths"])
    weights = [fp["paths"][p] for p in paths]
    rate = count / window_s
    out, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        path = rng.choices(paths, weights)[0]
        if path == "static":
            topic = rng.choice(static_topics)
            text = rng.choice(phrasings[topic])
        else:
            d = rng.choice(dynamic)
            topic = d["ask"]
            text = topic if path == "exact" else rng.choice(d["paraphrases"])
        out.append(FaqRequest(id=f"faq-{i}", start_s=round(t, 3), path=path, topic=topic, text=text))
    return out


def load_mix(path: Path | None = None, *, trace_path: Path | None = None, model: str, scale: float = 1.0) -> Mix:
    """The mixed workload of ``path`` (default ``bench/mix.yaml``) for ``model``, ``scale`` times
    its size (the window and every count; rates and shares unchanged).

    ``trace_path`` overrides the file's ``trace.path``. ``Mix.params`` is the file as loaded, plus
    ``scale`` and ``measured`` (counts, realised shares, the multi-turn history share).

    Raises:
        ValueError: the mix file or the FAQ set is invalid, or the window holds no trace request.
        OSError: a file cannot be read.
    """
    from .batch import make_lines
    from .multiturn import multi_turn_workload

    if scale <= 0:
        raise ValueError(f"scale must be > 0, not {scale}")
    params = read_params(path)
    seed = int(params["seed"])
    window = float(params["window_s"]) * scale
    tp = params["trace"]
    full = load_trace(trace_path or _resolve(tp["path"]))
    trace, tenants = trace_conversations(full, window, float(tp["keep"]), list(tp["tenants"]), seed)
    if not trace:
        raise ValueError(f"no trace request in the first {window:.0f} s of {trace_path or tp['path']}")
    shares = {k: float(params["shares"][k]["value"]) for k in KINDS}
    total = len(trace) / shares["trace"]

    mt = params["multi_turn"]
    turns = (int(mt["turns"][0]), int(mt["turns"][1]))
    mean_turns = (turns[0] + turns[1]) / 2
    n_conv = max(1, round(total * shares["multi_turn"] / mean_turns))
    # conversation starts spread over the window less one conversation's length (the last turns fit in it)
    conv_len = mean_turns * float(mt["think_s"])
    convs = multi_turn_workload(conversations=n_conv, turns=turns, system_tokens=int(mt["system_tokens"]),
                                system_prompts=int(mt.get("system_prompts", 1)), user_tokens=int(mt["user_tokens"]),
                                answer_tokens=int(mt["answer_tokens"]), max_tokens=int(mt["max_tokens"]),
                                rate_per_s=n_conv / max(window - conv_len, window / 2), think_s=float(mt["think_s"]),
                                seed=seed)

    faq = faq_requests(params, max(1, round(total * shares["faq"])), window, seed)

    bp = params["batch"]
    docs = max(1, round(total * shares["batch"] / int(bp["questions"])))
    lines = make_lines(docs=docs, questions=int(bp["questions"]), doc_tokens=int(bp["doc_tokens"]),
                       max_tokens=int(bp["max_tokens"]), model=model, seed=seed, salt="kvgate bench bill")

    mix = Mix(params=params, trace=trace, conversations=convs, faq=faq, batch_lines=lines, trace_tenant=tenants)
    counts = mix.counts()
    n = sum(counts.values())
    params["scale"] = scale
    params["measured"] = {
        "counts": counts, "conversations": len(convs),
        "shares": {k: round(v / n, 4) for k, v in counts.items()},
        "multi_turn_history_share": round(history_share(int(mt["system_tokens"]), int(mt["user_tokens"]),
                                                        int(mt["answer_tokens"]), turns), 4),
        "trace_window_s": window, "model": model,
    }
    return mix


# ------------------------------------------------------------------ sending
class _NoProgress:
    """Stands in for a rich Progress when the caller passes none."""

    def add_task(self, *_a: Any, **_k: Any) -> int:
        return 0

    def advance(self, *_a: Any, **_k: Any) -> None:
        pass

    def update(self, *_a: Any, **_k: Any) -> None:
        pass


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _outcome(id_: str, kind: str, tenant: str, r: Any) -> RequestOutcome:
    return RequestOutcome(id=id_, kind=kind, tenant=tenant, ok=r.ok, status=r.status, ttft_s=r.ttft_s,
                          cache=r.cache, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                          completion_tokens=r.completion_tokens, error=r.error)


async def send_timed(gateway: str, items: list[tuple[float, dict, dict[str, str]]], *, speedup: float,
                     concurrency: int, on_done: Callable[[int, Any], None] | None = None,
                     request_timeout_s: float = 600.0) -> list:
    """POST each ``(start_s, body, headers)`` to ``{gateway}/v1/chat/completions`` at
    ``start_s / speedup`` seconds from now, streamed, at most ``concurrency`` in flight (a wait for
    a slot counts in TTFT), with :func:`kvgate.bench.replay._one_request` (no ``no-store``).
    Returns the :class:`~kvgate.bench.replay.RequestResult` of each item, in ``items``' order;
    ``on_done(i, result)`` after each."""
    from .replay import _one_request

    url = gateway.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    t_start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def fire(i: int, start_s: float, body: dict, headers: dict[str, str]):
            delay = start_s / speedup - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            result = await _one_request(session, url, json.dumps(body).encode(), sem, timeout,
                                        time.perf_counter(), headers, no_store=False)
            if on_done:
                on_done(i, result)
            return result

        return list(await asyncio.gather(*(fire(i, *it) for i, it in enumerate(items))))


def _faq_body(params: dict, model: str, q: FaqRequest) -> dict:
    fp = params["faq"]
    return {"model": model, "temperature": 0, "max_tokens": int(fp["max_tokens"]), "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": fp["system"]}, {"role": "user", "content": q.text}]}


def _run_batch_api(gateway: str, key: str, lines: list[dict], progress: Any) -> tuple[dict, dict[str, dict]]:
    """Upload and run ``lines`` through the Batch API (:func:`kvgate.bench.batch.run_batch`, the
    openai SDK), to a terminal status; the Batch object and the output file's usage per custom_id."""
    import openai

    from .batch import RunFigures, run_batch

    client = openai.OpenAI(base_url=gateway.rstrip("/") + "/v1", api_key=key, max_retries=2, timeout=120)
    fig = RunFigures(name="batch (Batch API)", lines=len(lines))
    b = run_batch(client, lines, progress, fig)
    usage: dict[str, dict] = {}
    if b.get("output_file_id"):
        for raw in client.files.content(b["output_file_id"]).text.splitlines():
            if raw.strip():
                rec = json.loads(raw)
                usage[rec["custom_id"]] = ((rec.get("response") or {}).get("body") or {}).get("usage") or {}
    return b, usage


async def run_mix(mix: Mix, *, gateway: str, keys: dict[str, str], mode: str, speedup: float, concurrency: int,
                  progress: Any = None, batch_concurrency: int | None = None) -> MixResults:
    """Send ``mix`` through ``gateway`` once; every kind at once, each at its own arrival times.

    ``keys``: tenant → API key (every tenant of ``mix.tenants``). ``mode`` "baseline" sends the
    batch lines one by one as live requests (tenant of the job, at ``batch_concurrency``, default
    mix.yaml's ``batch.baseline_concurrency``); "kvgate" uploads them and runs them through the
    Batch API, polled to a terminal status, beside the live traffic. ``speedup`` divides every
    arrival and think time; ``concurrency`` bounds the live requests in flight per kind (the
    client's connection pool). ``progress`` is a rich Progress (or None): one task per kind.

    Raises:
        ValueError: ``mode`` is unknown or a tenant has no key.
        ReplayError: the batch did not reach a terminal status in time; openai.OpenAIError from the
            Batch API calls.
    """
    from .multiturn import send_conversations
    from .replay import send_trace

    if mode not in ("baseline", "kvgate"):
        raise ValueError(f"mode must be 'baseline' or 'kvgate', not {mode!r}")
    missing = sorted(mix.tenants - set(keys))
    if missing:
        raise ValueError(f"no API key for tenant(s) {', '.join(missing)}")
    p = mix.params
    prog = progress or _NoProgress()
    model = p["measured"]["model"]
    t0 = time.monotonic()

    def task(name: str, total: int) -> Callable[..., None]:
        tid = prog.add_task(name, total=total)
        return lambda *_a: prog.advance(tid)

    tick = task("trace", len(mix.trace))
    trace_job = send_trace(gateway, model, mix.trace, speedup, concurrency,
                           max_tokens_cap=p["trace"].get("max_tokens_cap"), on_done=tick,
                           headers=lambda r: _auth(keys[mix.trace_tenant[r.index]]), no_store=False)
    mt_tenant = p["multi_turn"]["tenant"]
    tick_mt = task("multi-turn", mix.counts()["multi_turn"])
    mt_job = send_conversations(gateway, model, mix.conversations, speedup=speedup, concurrency=concurrency,
                                headers=lambda _c: _auth(keys[mt_tenant]), on_done=tick_mt)
    faq_tenant = p["faq"]["tenant"]
    tick_faq = task("FAQ", len(mix.faq))
    faq_job = send_timed(gateway, [(q.start_s, _faq_body(p, model, q), _auth(keys[faq_tenant])) for q in mix.faq],
                         speedup=speedup, concurrency=concurrency, on_done=tick_faq)
    job_tenant = p["batch"]["tenant"]
    jobs: list = [trace_job, mt_job, faq_job]
    if mode == "baseline":
        tick_b = task("batch, line by line", len(mix.batch_lines))
        items = [(0.0, {**line["body"], "stream": True, "stream_options": {"include_usage": True}},
                  _auth(keys[job_tenant])) for line in mix.batch_lines]
        jobs.append(send_timed(gateway, items, speedup=speedup,
                               concurrency=batch_concurrency or int(p["batch"]["baseline_concurrency"]),
                               on_done=tick_b))
    else:
        jobs.append(asyncio.to_thread(_run_batch_api, gateway, keys[job_tenant], mix.batch_lines, prog))
    trace_res, mt_res, faq_res, batch_res = await asyncio.gather(*jobs)

    live = [_outcome(f"trace-{r.index}", "trace", mix.trace_tenant[r.index], res) for r, res in zip(mix.trace, trace_res)]
    live += [RequestOutcome(id=f"{t.conversation}-{t.turn}", kind="multi_turn", tenant=mt_tenant, ok=t.ok,
                            status=t.status, ttft_s=t.ttft_s, cache=t.cache, prompt_tokens=t.prompt_tokens,
                            cached_tokens=t.cached_tokens, completion_tokens=t.completion_tokens, error=t.error)
             for t in mt_res]
    live += [_outcome(q.id, "faq", faq_tenant, res) for q, res in zip(mix.faq, faq_res)]
    if mode == "baseline":
        live += [_outcome(f"batch-{line['custom_id']}", "batch_live", job_tenant, res)
                 for line, res in zip(mix.batch_lines, batch_res)]
        return MixResults(live=live, batch_id=None, batch_status=None, batch_ok=0, batch_failed=0,
                          wall_s=time.monotonic() - t0)
    b, usage = batch_res
    rc = b.get("request_counts") or {}
    return MixResults(live=live, batch_id=b.get("id"), batch_status=b.get("status"),
                      batch_ok=int(rc.get("completed", 0)), batch_failed=int(rc.get("failed", 0)),
                      wall_s=time.monotonic() - t0, batch_output=usage)
