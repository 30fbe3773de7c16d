"""The simulated engine: scheduler, latency model, output text and vLLM-named metrics.

Latency model (all durations are modelled seconds × ``time_scale`` of real sleep):

* **Admission.** At most ``max_num_seqs`` sequences run; later requests wait in a FIFO
  queue (``vllm:num_requests_waiting``). Admission pins the prompt's full blocks in
  the :class:`~kvgate.sim.prefix_cache.PrefixCache` and counts the prefix-cache hit.
* **Prefill** of ``uncached = prompt_tokens - cached_tokens`` tokens takes
  ``uncached × prefill_s_per_token``. Prefill is compute-bound, so prefills run
  through ``prefill_slots`` lanes (default 1: one at a time, FIFO); a long uncached
  prompt therefore delays the first token of the requests admitted after it.
  The first output token is produced by the prefill (TTFT = queue + prefill-lane
  wait + prefill).
* **Decode** of every further token takes ``decode_s_per_token``; decode is
  memory-bound and batched, so running sequences decode in parallel without
  slowing each other.
* Streaming emits the first token at once, then one chunk per ``stream_interval``
  tokens, sleeping once per chunk; a non-streamed request sleeps its decode time once.

Metrics are the vLLM V1 names and label sets (``model_name``, ``engine``; source:
``vllm/v1/metrics/loggers.py``), each app on its own ``CollectorRegistry``. Times are
wall-clock seconds as a scraper sees them, i.e. already multiplied by ``time_scale``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import random
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence as SequenceT

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..policy.model import SimulatorConfig
from .prefix_cache import PrefixCache, max_hit_blocks

# vLLM V1 bucket boundaries (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM FinishReason, str() values

# Output vocabulary: fixed, so deterministic outputs are stable across versions of this file
# only as long as this list is; each entry is one token under the simulator's tokeniser.
VOCAB: tuple[str, ...] = tuple(
    """the a of to and in is it that for on with as was at by be this from or an are not have
    but had his they you were her which she all one can there their we been has when who will
    more no if out so said what up its about into than them only other new some could time
    these two may then do first any my now such like our over man me even most made after
    also did many before must through back years where much your way well down should because
    each just those people how too little state good very make world still own see men work
    long get here between both life being under never day same another know while last might
    us great old year off come since against go came right used take three cache block token
    prefix engine batch decode prefill queue node route key gateway model request stream""".split()
)

_CREATED_LINE = re.compile(r"^(# (HELP|TYPE) )?[^\s{]+_created[\s{]")


@dataclass
class Sequence:
    """One request inside the engine.

    ``prompt_tokens`` and ``max_tokens`` are inputs; the engine fills in ``cached_tokens``
    (prefix-cache hit, tokens), ``output_tokens`` (generated words) and ``finish_reason``
    (``"length"``, or ``"abort"`` when the client went away). ``arrival`` is ``time.monotonic()``.
    """

    prompt_tokens: list[str]
    max_tokens: int
    rng: random.Random
    arrival: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0
    output_tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None


def output_rng(prompt_tokens: SequenceT[str], seed: int | None, deterministic: bool) -> random.Random:
    """The sampler of a request's output words.

    Deterministic (``temperature == 0`` or a ``seed``): seeded by
    ``sha256("\\x00".join(prompt_tokens) [+ "\\x00seed=<seed>"])`` so the same prompt gives
    the same words; otherwise seeded from the OS.
    """
    if not deterministic and seed is None:
        return random.Random()
    digest = hashlib.sha256("\x00".join(prompt_tokens).encode("utf-8"))
    if seed is not None:
        digest.update(f"\x00seed={seed}".encode())
    return random.Random(int.from_bytes(digest.digest()[:8], "big"))


class SimMetrics:
    """vLLM V1 metrics on a private ``CollectorRegistry`` (several apps may share a process).

    Exposed names (counters get ``_total`` from prometheus_client): ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
    ``vllm:prefix_cache_hits_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
    ``vllm:request_success_total{finished_reason}``, ``vllm:time_to_first_token_seconds``,
    ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``, ``vllm:cache_config_info``,
    and ``process_start_time_seconds`` (unix seconds; real vLLM exposes it through prometheus_client's
    process collector), set to ``start_time``: the creation time of the engine, so a scraper can tell a
    restarted engine (counters back at zero) from a quiet one.

    One series is the simulator's own, not vLLM's: ``kvgate_sim_busy_seconds_total``, the modelled
    seconds (wall seconds ÷ ``time_scale``) during which at least one request was admitted — the
    engine busy time a GPU would have been paid for. vLLM has no such counter; on real engines the
    bill demo reads GPU utilisation from the node agent instead.
    """

    def __init__(self, config: SimulatorConfig, start_time: float | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (config.model, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.busy_seconds = counter("kvgate_sim_busy_seconds",
                                    "Modelled seconds with at least one request admitted (simulator only).")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ("finished_reason",), registry=r)
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(*values)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(*values)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"), registry=r)
        info.labels(str(config.block_size), "True", "0", str(config.num_gpu_blocks)).set(1)
        self.start_time = time.time() if start_time is None else start_time
        Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
              registry=r).set(self.start_time)

    def exposition(self) -> bytes:
        """Prometheus text format 0.0.4, without prometheus_client's ``*_created`` series (vLLM has none)."""
        text = generate_latest(self.registry).decode("utf-8")
        return "".join(
            line + "\n" for line in text.splitlines() if line and not _CREATED_LINE.match(line)
        ).encode("utf-8")


class Engine:
    """One simulated vLLM engine: FIFO admission, prefix cache, latency model, metrics.

    Args:
        config: the simulator settings (``kvgate.policy.model.SimulatorConfig``).
        prefill_slots: prefills that may run at once (1 = serialised, like one GPU's compute).
    """

    def __init__(self, config: SimulatorConfig, prefill_slots: int = 1):
        if prefill_slots < 1:
            raise ValueError(f"prefill_slots must be ≥ 1, got {prefill_slots}")
        self.config = config
        self.created = time.time()  # unix s; exposed as process_start_time_seconds
        self.cache = PrefixCache(config.num_gpu_blocks, config.block_size)
        self.metrics = SimMetrics(config, start_time=self.created)
        self.num_running = 0
        self._busy_since: float | None = None  # monotonic s when num_running went 0 → 1
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._prefill = asyncio.Semaphore(prefill_slots)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free sequence slot."""
        return len(self._waiting)

    def _gauges(self) -> None:
        if self.num_running and self._busy_since is None:
            self._busy_since = time.monotonic()
        elif not self.num_running and self._busy_since is not None:
            self.metrics.busy_seconds.inc((time.monotonic() - self._busy_since) / self.config.time_scale)
            self._busy_since = None
        self.metrics.running.set(self.num_running)
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.kv_cache_usage.set(self.cache.usage)

    async def _admit(self) -> None:
        if self.num_running < self.config.max_num_seqs and not self._waiting:
            self.num_running += 1
            self._gauges()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._gauges()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave()  # the slot was handed over just as we were cancelled
            else:
                # Cancelling the task cancelled ``fut``; between that and this task resuming,
                # another request's ``_leave`` may already have popped (and skipped) it.
                self._discard_waiting(fut)
            raise

    def _discard_waiting(self, fut: asyncio.Future[None]) -> None:
        """Drop a cancelled waiter from the queue; idempotent (``_leave`` may have popped it)."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(fut)
        self._gauges()

    def _leave(self) -> None:
        self.num_running -= 1
        while self._waiting and self.num_running < self.config.max_num_seqs:
            fut = self._waiting.popleft()
            if not fut.done():  # a cancelled waiter is skipped; its task drops it again harmlessly
                self.num_running += 1
                fut.set_result(None)
        self._gauges()

    def reset_prefix_cache(self) -> bool:
        """Drop all unpinned cached blocks; see :meth:`PrefixCache.reset`."""
        ok = self.cache.reset()
        self._gauges()
        return ok

    async def generate(self, seq: Sequence, chunk_tokens: int | None) -> AsyncIterator[list[str]]:
        """Run ``seq`` through the engine, yielding its output words as they are produced.

        Args:
            seq: the request; updated in place (``cached_tokens``, ``output_tokens``, ``finish_reason``).
            chunk_tokens: streaming: yield the first token alone, then chunks of this many
                tokens, each when its last token is due; ``None``: yield everything once, at the end.

        Yields:
            Lists of output words (never empty).

        Cancellation or closing the generator early aborts the request: its slot and its
        blocks are released and ``finish_reason`` becomes ``"abort"``. Use it inside
        ``contextlib.aclosing`` so an early exit releases at once.
        """
        cfg = self.config
        scale = cfg.time_scale
        m = self.metrics
        await self._admit()
        admitted = time.monotonic()
        hashes: list[bytes] = []
        pinned = 0
        try:
            n = len(seq.prompt_tokens)
            hashes = PrefixCache.block_hashes(seq.prompt_tokens, cfg.block_size)
            hits, pinned = self.cache.pin(hashes)
            seq.cached_tokens = min(hits, max_hit_blocks(n, cfg.block_size)) * cfg.block_size
            m.prefix_cache_queries.inc(n)
            m.prefix_cache_hits.inc(seq.cached_tokens)
            m.queue_time.observe(admitted - seq.arrival)
            self._gauges()

            async with self._prefill:
                await _sleep((n - seq.cached_tokens) * cfg.prefill_s_per_token * scale)
            loop_t0 = time.monotonic()
            seq.first_token_at = loop_t0
            m.ttft.observe(loop_t0 - seq.arrival)
            m.prompt_tokens.inc(n)

            total = seq.max_tokens
            words = seq.rng.choices(VOCAB, k=total)
            step = cfg.decode_s_per_token * scale
            if chunk_tokens is None:
                await _sleep((total - 1) * step)
                seq.output_tokens.extend(words)
                m.generation_tokens.inc(total)
                seq.finish_reason = "length"
                yield words
            else:
                done = 0
                while done < total:
                    size = 1 if done == 0 else min(chunk_tokens, total - done)
                    if done:
                        # Sleep to an absolute deadline: chunk timing does not drift with loop lag.
                        await _sleep(loop_t0 + (done + size - 1) * step - time.monotonic())
                    chunk = words[done:done + size]
                    done += size
                    seq.output_tokens.extend(chunk)
                    m.generation_tokens.inc(size)
                    if done == total:
                        seq.finish_reason = "length"
                    yield chunk
            m.request_success[seq.finish_reason or "length"].inc()
            m.e2e.observe(time.monotonic() - seq.arrival)
        finally:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self.cache.release(hashes[:pinned])
            self._leave()


    async def embed(self, prompt_tokens: int) -> None:
        """Run one embedding request of ``prompt_tokens`` tokens (all its inputs together).

        It takes a sequence slot like a generation and costs its prefill
        (``prompt_tokens × prefill_s_per_token``, through the prefill lanes), and nothing else:
        no decode, no output tokens. The prefix cache is neither read nor filled (an embedding
        model's encoder attends both ways: no prefix of it can be reused). Counted in
        ``vllm:prompt_tokens_total``, ``vllm:request_success_total{finished_reason="stop"}``, the
        queue-time, TTFT (= end of the prefill) and e2e histograms. Cancellation releases the slot.
        """
        cfg = self.config
        m = self.metrics
        arrival = time.monotonic()
        await self._admit()
        try:
            m.queue_time.observe(time.monotonic() - arrival)
            async with self._prefill:
                await _sleep(prompt_tokens * cfg.prefill_s_per_token * cfg.time_scale)
            m.ttft.observe(time.monotonic() - arrival)
            m.prompt_tokens.inc(prompt_tokens)
            m.request_success["stop"].inc()
            m.e2e.observe(time.monotonic() - arrival)
        finally:
            self._leave()


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)
