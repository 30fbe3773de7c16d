"""The requests ``kvgate analyze`` reads: a Mooncake trace or a JSONL of chat requests.

Both become :class:`Request`: arrival time, prompt and completion lengths, the prompt as a
chain of 512-token blocks (``blocks``: equal ids = equal content *and* equal prefix, the
Mooncake convention) and the chat ``messages`` the gateway and the engines would see.

* **Mooncake** (a line with ``hash_ids``; ``kvgate.bench.trace``): blocks are the trace's
  ``hash_ids``; messages are the replay's rendering (:func:`kvgate.bench.trace.render_messages`),
  so the token-level models see exactly what ``make demo`` sends.
* **Requests** (a line with ``messages``, or ``body.messages``; optional ``timestamp`` in ms,
  ``session`` (the session header's value), ``user``, ``max_tokens``/``output_length``):
  the prompt is tokenised with the simulator's tokeniser and chat template
  (:func:`kvgate.sim.tokenizer.tokenize_chat`) and cut into chained blocks of 512 tokens
  (``sha256(previous id || tokens)``, the last block partial), so the block statistics mean
  the same on both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.trace import TRACE_BLOCK_TOKENS, render_messages, TraceRequest
from ..sim.tokenizer import tokenize_chat

BLOCK_TOKENS = TRACE_BLOCK_TOKENS
"""Tokens per block of a request's ``blocks`` chain (the Mooncake traces' 512)."""


@dataclass
class Request:
    """One request. ``blocks``: chained block ids (int for a trace, hex for requests);
    ``timestamp_s`` seconds from the start; lengths in tokens."""

    index: int
    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple
    messages: list[dict] | None = None
    session: str | None = None
    user: str | None = None
    source: str = "trace"
    _trace: TraceRequest | None = field(default=None, repr=False)

    def block_len(self, k: int) -> int:
        """Tokens of block ``k`` (512, the last one what is left of ``input_tokens``)."""
        if k < len(self.blocks) - 1:
            return BLOCK_TOKENS
        return max(1, min(BLOCK_TOKENS, self.input_tokens - BLOCK_TOKENS * (len(self.blocks) - 1)))

    def chat(self) -> list[dict]:
        """The chat messages sent for this request (the replay's rendering for a trace line)."""
        if self.messages is None and self._trace is not None:
            return render_messages(self._trace)
        return self.messages or []


def chain_blocks(tokens: list[str], block_tokens: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """Chained ids of ``tokens`` cut into ``block_tokens`` blocks (the last may be partial):
    ``id_i = sha256(id_{i-1} || "\\x00".join(block_i))[:16 hex]``."""
    out, prev = [], b""
    for start in range(0, len(tokens), block_tokens):
        prev = hashlib.sha256(prev + "\x00".join(tokens[start:start + block_tokens]).encode("utf-8")).digest()
        out.append(prev.hex()[:16])
    return tuple(out)


class WorkloadError(ValueError):
    """A line that is neither a trace record nor a chat request; the message names the line."""


def load_workload(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read the first ``limit`` requests (lines) of ``path``, sorted by arrival.

    Raises:
        WorkloadError: a line is not JSON, or neither format.
        OSError: the file cannot be read.
    """
    out: list[Request] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({exc})") from None
            try:
                out.append(_record(obj, len(out)))
            except (KeyError, TypeError, ValueError) as exc:
                raise WorkloadError(f"{path}:{lineno}: neither a Mooncake trace record (hash_ids) nor a chat "
                                    f"request (messages): {exc!r}") from None
    out.sort(key=lambda r: (r.timestamp_s, r.index))
    return out


def _record(obj: dict, index: int) -> Request:
    if "hash_ids" in obj:
        tr = TraceRequest(index=index, timestamp_s=float(obj["timestamp"]) / 1000.0,
                          input_length=int(obj["input_length"]), output_length=int(obj["output_length"]),
                          hash_ids=tuple(int(h) for h in obj["hash_ids"]))
        return Request(index, tr.timestamp_s, tr.input_length, tr.output_length, tr.hash_ids, _trace=tr)
    body = obj.get("body", obj)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise TypeError("messages is not a list")
    tokens = tokenize_chat(messages)
    out_tokens = int(obj.get("output_length", body.get("max_tokens", 0)) or 0)
    return Request(index, float(obj.get("timestamp", 0)) / 1000.0, len(tokens), out_tokens, chain_blocks(tokens),
                   messages=messages, session=obj.get("session"), user=body.get("user"), source="requests")
