"""Mooncake-format request traces and their rendering to chat requests.

Trace format (Qin et al., "Mooncake", FAST 2025; ``shared/traces/README.md``): one JSON
object per line with ``timestamp`` (ms from the trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` — the prompt as a chain of 512-token
blocks, where equal ids mean equal content *and* equal prefix before it.

Rendering (documented in docs/benchmarks.md): every block id becomes a fixed,
deterministic text of :data:`TRACE_BLOCK_TOKENS` whitespace-separated words (one
word = one token under the simulator's tokeniser, ``kvgate.sim.tokenizer``), so two
rendered prompts share a text prefix exactly as far as their ``hash_ids`` agree.
The last block is cut to the trace's ``input_length``. The first block becomes the
system message and the remaining blocks, joined, the user message; the chat
template adds a few tokens per message, which is the only deviation from the
trace's token counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TRACE_BLOCK_TOKENS = 512

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "do", "fu", "ga", "hi", "jo", "pe", "zu"]


def _vocabulary() -> list[str]:
    # 16^3 = 4096 three-syllable words of 6 characters: ~3.5k characters per 512-token block.
    return [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES]


_VOCAB = _vocabulary()


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. ``timestamp_s`` is seconds from the trace start."""

    index: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (the first ``limit`` requests if given), sorted by arrival.

    Raises:
        ValueError: a line is not valid JSON or misses a field; the message names the line.
        OSError: the file cannot be read.
    """
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                out.append(TraceRequest(
                    index=len(out),
                    timestamp_s=float(obj["timestamp"]) / 1000.0,
                    input_length=int(obj["input_length"]),
                    output_length=int(obj["output_length"]),
                    hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                ))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record ({exc})") from None
    out.sort(key=lambda r: (r.timestamp_s, r.index))
    return out


@lru_cache(maxsize=65536)
def block_words(block_id: int) -> tuple[str, ...]:
    """The fixed 512-word text of one trace block: same id → same words, in every process."""
    rng = random.Random(f"kvgate-trace-block-{block_id}")
    return tuple(rng.choices(_VOCAB, k=TRACE_BLOCK_TOKENS))


def render_messages(req: TraceRequest) -> list[dict[str, str]]:
    """Render one trace request as OpenAI chat messages: block 0 → system, the rest → user."""
    if not req.hash_ids:
        return [{"role": "user", "content": ""}]
    last_len = req.input_length - TRACE_BLOCK_TOKENS * (len(req.hash_ids) - 1)
    last_len = max(1, min(TRACE_BLOCK_TOKENS, last_len))
    texts = []
    for i, block_id in enumerate(req.hash_ids):
        words = block_words(block_id)
        if i == len(req.hash_ids) - 1:
            words = words[:last_len]
        texts.append(" ".join(words))
    messages = [{"role": "system", "content": texts[0]}]
    if len(texts) > 1:
        messages.append({"role": "user", "content": " ".join(texts[1:])})
    return messages
