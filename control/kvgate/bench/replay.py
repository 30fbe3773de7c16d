"""Trace replay: drive a real production trace through the gateway, once per balancer.

For each balancer the replay (1) re-renders nginx with that balancer and reloads it,
(2) resets every engine's prefix cache (``POST /reset_prefix_cache``, as vLLM has),
(3) snapshots the engines' counters, (4) sends the trace's requests at their arrival
times divided by ``speedup``, streaming, with bounded concurrency, and (5) reads the
engines' ``/metrics`` again. The difference of the engines' own vLLM counters gives
the token-weighted prefix-cache hit ratio and the prefill tokens each engine computed.

Requests carry ``Cache-Control: no-store``: the replay measures routing, so the
gateway's response cache must not answer repeated prompts.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import requests
from prometheus_client.parser import text_string_to_metric_families

from ..policy import NodeConfig, Policy
from .ceiling import pooled_ceiling
from .trace import TraceRequest, render_messages

# vLLM V1 metric names (vllm/v1/metrics/loggers.py); counters are in tokens.
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
_COUNTERS = (QUERIES, HITS, PROMPT_TOKENS, TTFT_SUM, TTFT_COUNT)

REPORT_KEYS = ("requests_ok", "requests_failed", "hit_ratio", "ceiling", "ratio_to_ceiling",
               "imbalance", "ttft_p50_s", "ttft_p99_s")


class ReplayError(RuntimeError):
    """The replay could not run (an engine's /metrics unreachable, nginx rejected the config, ...)."""


@dataclass
class RequestResult:
    """One replayed request: ``ttft_s`` from send to the first content chunk, at the client;
    ``cache`` the response's ``X-Kvgate-Cache`` header (None when absent); the token counts from
    the stream's ``usage`` chunk (``stream_options.include_usage``; None when it sent none)."""

    ok: bool
    status: int = 0
    ttft_s: float | None = None
    error: str | None = None
    cache: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class PolicyReport:
    """What one balancer achieved on the replayed requests.

    ``hit_ratio``: token-weighted prefix-cache hits ÷ queries, summed over engines.
    ``imbalance``: max ÷ mean of prefill tokens computed (queries − hits) per engine.
    ``prefill_tokens``: prefill tokens computed per node id.
    ``engine_ttft_mean_s``: mean TTFT the engines themselves recorded (vLLM histogram), which
    leaves out the client and gateway share of ``ttft_*``.
    """

    requests_ok: int
    requests_failed: int
    hit_ratio: float
    ceiling: float
    ratio_to_ceiling: float
    imbalance: float
    ttft_p50_s: float
    ttft_p99_s: float
    prefill_tokens: dict[str, float] = field(default_factory=dict)
    engine_ttft_mean_s: float = float("nan")
    errors: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, float | int]:
        """Exactly :data:`REPORT_KEYS`, the documented report shape."""
        return {k: getattr(self, k) for k in REPORT_KEYS}

    @property
    def prefill_total(self) -> float:
        return sum(self.prefill_tokens.values())


# ------------------------------------------------------------------ engines
def scrape_engine(node: NodeConfig, timeout: float = 5.0) -> dict[str, float]:
    """Sum of each vLLM sample of interest on one engine's ``/metrics``.

    Raises:
        ReplayError: the engine does not answer or its text does not parse.
    """
    try:
        resp = requests.get(f"{node.url}/metrics", timeout=timeout)
        resp.raise_for_status()
    except requests.RequestException as exc:
        raise ReplayError(f"node {node.id}: cannot read {node.url}/metrics: {exc}") from None
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name in (*_COUNTERS, RUNNING, WAITING):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise ReplayError(f"node {node.id}: unparseable /metrics: {exc}") from None
    return values


def reset_prefix_caches(nodes: list[NodeConfig]) -> None:
    """``POST /reset_prefix_cache`` on every node (vLLM's endpoint). Raises ReplayError."""
    for node in nodes:
        try:
            requests.post(f"{node.url}/reset_prefix_cache", timeout=10).raise_for_status()
        except requests.RequestException as exc:
            raise ReplayError(f"node {node.id}: reset_prefix_cache failed: {exc}") from None


def wait_engines_idle(nodes: list[NodeConfig], timeout: float = 60.0) -> None:
    """Wait until no engine has running or waiting requests (so counters are final).

    Raises:
        ReplayError: an engine is still busy after ``timeout`` seconds (its counters would
            still be moving; another client may be using the engines).
    """
    deadline = time.monotonic() + timeout
    while True:
        busy = [n.id for n in nodes if sum(scrape_engine(n).get(k, 0.0) for k in (RUNNING, WAITING)) > 0]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise ReplayError(f"engine(s) {', '.join(busy)} still busy {timeout:.0f}s after the replay ended "
                              "(is another client using them?)")
        time.sleep(0.2)


# ------------------------------------------------------------------- client
_HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store"}


async def _one_request(session: aiohttp.ClientSession, url: str, body: bytes, sem: asyncio.Semaphore,
                       timeout: aiohttp.ClientTimeout, t0: float,
                       headers: dict[str, str] | None = None, no_store: bool = True) -> RequestResult:
    """Send one streamed request; ``t0`` (``time.perf_counter()``) is when it was ready to
    send, so a wait for a concurrency slot counts in its TTFT, as it would for a real client.
    ``headers`` are sent besides the JSON content type and (``no_store``, the default)
    ``Cache-Control: no-store``; ``no_store=False`` lets the gateway's response cache answer."""
    base = _HEADERS if no_store else {"Content-Type": "application/json"}
    async with sem:
        try:
            async with session.post(url, data=body, timeout=timeout,
                                    headers={**base, **headers} if headers else base) as resp:
                cache = resp.headers.get("X-Kvgate-Cache")
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    return RequestResult(False, resp.status, error=f"HTTP {resp.status}: {text}", cache=cache)
                ttft = None
                done = False
                usage: dict = {}
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    if b'"usage"' in data:
                        try:
                            usage = json.loads(data).get("usage") or usage
                        except ValueError:
                            return RequestResult(False, resp.status, error="bad SSE chunk", cache=cache)
                    if ttft is None:
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            return RequestResult(False, resp.status, error="bad SSE chunk")
                        choices = chunk.get("choices") or []
                        if choices and (choices[0].get("delta") or {}).get("content"):
                            ttft = time.perf_counter() - t0
                tokens = {"prompt_tokens": usage.get("prompt_tokens"),
                          "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                          "completion_tokens": usage.get("completion_tokens")}
                if not done:
                    return RequestResult(False, resp.status, ttft, "stream ended without [DONE]", cache, **tokens)
                return RequestResult(True, resp.status, ttft, None, cache, **tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return RequestResult(False, 0, error=f"{type(exc).__name__}: {exc}")


async def send_trace(gateway: str, model: str, trace: list[TraceRequest], speedup: float, concurrency: int,
                     max_tokens_cap: int | None = None, on_done: Callable[[RequestResult], None] | None = None,
                     request_timeout_s: float = 600.0,
                     headers: Callable[[TraceRequest], dict[str, str]] | None = None,
                     no_store: bool = True) -> list[RequestResult]:
    """Send every trace request to ``{gateway}/v1/chat/completions`` at ``timestamp / speedup``.

    ``gateway`` is any OpenAI-compatible base URL (kvgate, a peer router, an engine).
    Streaming with ``stream_options.include_usage``; ``max_tokens`` = the trace's
    output length (capped by ``max_tokens_cap``). At most ``concurrency`` requests are
    in flight; later arrivals wait (their TTFT includes that wait, as a real client's would).
    ``headers(request)``, when given, adds headers per request (e.g. a session id).
    ``no_store`` (default True) sends ``Cache-Control: no-store`` so the response cache answers
    nothing; False leaves caching to the gateway's policy. Results are in ``trace``'s order.
    """
    url = gateway.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    t_start = time.perf_counter()
    t0_trace = trace[0].timestamp_s if trace else 0.0

    async with aiohttp.ClientSession(connector=connector) as session:
        async def fire(req: TraceRequest) -> RequestResult:
            delay = (req.timestamp_s - t0_trace) / speedup - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            max_tokens = max(1, req.output_length)
            if max_tokens_cap:
                max_tokens = min(max_tokens, max_tokens_cap)
            body = json.dumps({
                "model": model, "messages": render_messages(req), "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            }).encode()
            result = await _one_request(session, url, body, sem, timeout, time.perf_counter(),
                                        headers(req) if headers else None, no_store)
            if on_done:
                on_done(result)
            return result

        return list(await asyncio.gather(*(fire(r) for r in trace)))


# ------------------------------------------------------------------ reports
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def build_report(results: list[RequestResult], before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]], ceiling: float) -> PolicyReport:
    """Combine client results and engine counter deltas into a :class:`PolicyReport`."""
    hits = queries = ttft_sum = ttft_count = 0.0
    prefill: dict[str, float] = {}
    for node_id, a in after.items():
        b = before.get(node_id, {})
        dq = a.get(QUERIES, 0.0) - b.get(QUERIES, 0.0)
        dh = a.get(HITS, 0.0) - b.get(HITS, 0.0)
        ttft_sum += a.get(TTFT_SUM, 0.0) - b.get(TTFT_SUM, 0.0)
        ttft_count += a.get(TTFT_COUNT, 0.0) - b.get(TTFT_COUNT, 0.0)
        queries += dq
        hits += dh
        prefill[node_id] = dq - dh
    hit_ratio = hits / queries if queries else 0.0
    mean = sum(prefill.values()) / len(prefill) if prefill else 0.0
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    errors = sorted({r.error or "" for r in results if not r.ok})[:5]
    return PolicyReport(
        requests_ok=sum(r.ok for r in results),
        requests_failed=sum(not r.ok for r in results),
        hit_ratio=round(hit_ratio, 4),
        ceiling=round(ceiling, 4),
        ratio_to_ceiling=round(hit_ratio / ceiling, 4) if ceiling else 0.0,
        imbalance=round(max(prefill.values()) / mean, 4) if mean else 0.0,
        ttft_p50_s=round(_percentile(ttfts, 50), 4),
        ttft_p99_s=round(_percentile(ttfts, 99), 4),
        prefill_tokens=prefill,
        engine_ttft_mean_s=round(ttft_sum / ttft_count, 4) if ttft_count else float("nan"),
        errors=errors,
    )


def engine_cache_config(node: NodeConfig, timeout: float = 5.0) -> tuple[int, int] | None:
    """``(num_gpu_blocks, block_size)`` from the engine's ``vllm:cache_config_info`` labels
    (exported by vLLM and the simulator), or None when the engine does not export it."""
    try:
        resp = requests.get(f"{node.url}/metrics", timeout=timeout)
        resp.raise_for_status()
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    labels = sample.labels
                    return int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (requests.RequestException, ValueError, KeyError):
        return None
    return None


def pooled_capacity(policy: Policy, nodes: list[NodeConfig]) -> tuple[int, int, str]:
    """``(total blocks, block size, source)`` of the engines' KV caches, for the ceiling.

    Read from each engine's ``vllm:cache_config_info``; engines that do not export it
    count with the policy's ``simulator.num_gpu_blocks``.
    """
    total, block_size, measured = 0, policy.simulator.block_size, 0
    for node in nodes:
        cfg = engine_cache_config(node)
        if cfg:
            total += cfg[0]
            block_size = cfg[1]
            measured += 1
        else:
            total += policy.simulator.num_gpu_blocks
    source = "engines' vllm:cache_config_info" if measured == len(nodes) else \
        f"{measured}/{len(nodes)} engines' vllm:cache_config_info, the rest simulator.num_gpu_blocks"
    return total, block_size, source


def compute_ceiling(trace: list[TraceRequest], num_blocks: int, block_size: int,
                    on_request: Callable[[], None] | None = None) -> float:
    """Pooled ceiling of the rendered trace for ``num_blocks`` blocks in total
    (see :mod:`kvgate.bench.ceiling`); ``on_request`` is called after each request."""

    def prompts():
        for r in trace:
            yield render_messages(r)
            if on_request:
                on_request()

    return pooled_ceiling(prompts(), num_blocks, block_size).ratio
