"""Warm-up: fill a node's prefix cache before it takes traffic.

The control plane sends the prompts straight to the node's engine (never through
the gateway, whose ring must not send them elsewhere) as streaming
``/v1/chat/completions`` with ``max_tokens: 1``: the engine prefills the whole
prompt and keeps its KV blocks in the prefix cache (vLLM's automatic prefix caching
keeps freed blocks until evicted). Sources, in order:

1. the pool's ``warmup.prompts`` from the policy (shared system prompts, tools, few-shot);
2. the prompts of the pool's ``warmup.hot_prefixes`` hottest prefix fingerprints of the last
   ``warmup.hot_window_s`` seconds of the gateway's request log (Redis sorted sets
   ``kvgate:hot:<pool>:<minute>``), for those whose text the gateway captured
   (``kvgate:prefix:<pool>:<fp>``, opt-in ``warmup.capture_prefix_text``).

TTFT is measured on the first prompt before anything else is sent and again at the
end: the cold and the warm prefill of the same prompt on this node.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import requests

from ..keys import hot_key, prefix_text_key
from ..policy.model import PoolConfig

log = logging.getLogger("kvgate.control.warmup")


@dataclass
class WarmupResult:
    """Outcome of one warm-up. Times in milliseconds, ``None`` when not measured."""

    prompts: int = 0
    sent: int = 0
    failed: int = 0
    from_policy: int = 0
    from_hot_prefixes: int = 0
    ttft_before_ms: float | None = None
    ttft_after_ms: float | None = None
    duration_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def hot_prefixes(r: redis.Redis, pool: str, window_s: int, limit: int, now: float | None = None) -> list[dict[str, Any]]:
    """The captured prompts of the ``limit`` hottest fingerprints of ``pool`` over the last
    ``window_s`` seconds, hottest first: ``[{"fp", "count", "model", "messages", "tools"?}]``.
    Fingerprints without captured text are skipped. Raises ``redis.RedisError``."""
    if limit <= 0:
        return []
    now = time.time() if now is None else now
    minute = int(now // 60)
    keys = [hot_key(pool, m) for m in range(minute - window_s // 60, minute + 1)]
    counts: dict[str, float] = {}
    pipe = r.pipeline()
    for k in keys:
        pipe.zrevrange(k, 0, 4 * limit + 50, withscores=True)
    for rows in pipe.execute():
        for fp, score in rows:
            fp = fp.decode() if isinstance(fp, bytes) else fp
            counts[fp] = counts.get(fp, 0.0) + float(score)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out: list[dict[str, Any]] = []
    for i in range(0, len(ranked), 100):
        chunk = ranked[i:i + 100]
        texts = r.mget([prefix_text_key(pool, fp) for fp, _ in chunk])
        for (fp, count), text in zip(chunk, texts):
            if not text:
                continue
            try:
                prompt = json.loads(text)
            except ValueError:
                continue
            if isinstance(prompt, dict) and isinstance(prompt.get("messages"), list):
                out.append({"fp": fp, "count": int(count), **prompt})
            if len(out) >= limit:
                return out
    return out


def _ttft(url: str, body: dict[str, Any], timeout: float) -> float:
    """Send one streaming chat request; return seconds to the first SSE data event. Raises on failure."""
    t0 = time.monotonic()
    with requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        first = None
        for line in resp.iter_lines():
            if line.startswith(b"data:"):
                if first is None:
                    first = time.monotonic() - t0
                if line.strip() == b"data: [DONE]":
                    break
        if first is None:
            raise RuntimeError("no SSE event in the response")
        return first


def run_warmup(node_url: str, pool: PoolConfig, r: redis.Redis | None, deadline_s: float | None = None,
               progress=None) -> WarmupResult:
    """Warm ``node_url`` with the pool's prompts and hot prefixes; never raises.

    Args:
        node_url: the engine's base URL (``http://HOST:PORT``).
        pool: the node's pool (its ``warmup`` section and first model).
        r: Redis of the request log (None: policy prompts only).
        deadline_s: overall budget (default ``pool.warmup.timeout_s``).
        progress: optional callable ``(sent, total)``.
    """
    cfg = pool.warmup
    budget = deadline_s if deadline_s is not None else cfg.timeout_s
    result = WarmupResult(started_at=time.time())
    t_start = time.monotonic()
    bodies: list[dict[str, Any]] = []
    for p in cfg.prompts:
        body: dict[str, Any] = {"model": pool.models[0], "messages": p.messages, "max_tokens": 1, "temperature": 0}
        if p.tools:
            body["tools"] = p.tools
        bodies.append(body)
    result.from_policy = len(bodies)
    if r is not None and cfg.hot_prefixes > 0:
        try:
            for hp in hot_prefixes(r, pool.name, cfg.hot_window_s, cfg.hot_prefixes):
                body = {"model": hp.get("model") or pool.models[0], "messages": hp["messages"],
                        "max_tokens": 1, "temperature": 0}
                if hp.get("tools"):
                    body["tools"] = hp["tools"]
                bodies.append(body)
                result.from_hot_prefixes += 1
        except redis.RedisError as exc:
            result.errors.append(f"request log unavailable: {exc}")
    result.prompts = len(bodies)
    if not bodies:
        result.finished_at = time.time()
        return result

    def remaining() -> float:
        return max(0.1, budget - (time.monotonic() - t_start))

    counts = threading.Lock()
    skipped = 0

    def send(body: dict[str, Any]) -> float | None:
        nonlocal skipped
        if time.monotonic() - t_start > budget:
            with counts:
                skipped += 1
            return None
        try:
            t = _ttft(node_url, body, timeout=min(60.0, remaining()))
            with counts:
                result.sent += 1
            return t
        except (requests.RequestException, RuntimeError) as exc:
            with counts:
                result.failed += 1
                if len(result.errors) < 5:
                    result.errors.append(str(exc).splitlines()[0][:200])
            return None
        finally:
            if progress:
                progress(result.sent + result.failed + skipped, len(bodies) + 1)

    before = send(bodies[0])
    result.ttft_before_ms = None if before is None else round(before * 1000, 2)
    rest = bodies[1:]
    if rest:
        with ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="warmup") as pool_ex:
            for f in [pool_ex.submit(send, body) for body in rest]:
                f.result()
    if skipped:
        result.errors.append(f"warm-up budget of {budget:.0f}s spent; {skipped} prompt(s) skipped")
    if time.monotonic() - t_start <= budget:
        after = send(bodies[0])
        result.ttft_after_ms = None if after is None else round(after * 1000, 2)
    result.duration_s = round(time.monotonic() - t_start, 3)
    result.finished_at = time.time()
    return result
