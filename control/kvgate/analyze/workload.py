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
* **Gateway log** (a line with ``blocks`` and ``pool``: an entry of the ``kvgate:log`` stream,
  as ``kvgate log export`` writes it; keys.LOG_FIELDS): blocks are the entry's ``blocks``
  (16 hex digits per ``prefix_index.chunk_chars``-byte chunk of the canonical prompt, chained),
  each ``log_block_tokens`` (= chunk_chars ÷ chars_per_token) tokens; ``prompt`` and
  ``completion`` the token counts (prompt unknown: the blocks' tokens); ``ts`` (epoch s) the
  arrival; ``tenant`` + ``key`` (the route key's hash) the session; ``point`` the ring point;
  ``cache`` = ``HIT`` an answer from the response cache; ``batch`` a batch request.
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
    block_tokens: int = BLOCK_TOKENS
    identity: str | None = None      # equal = an exact repeat (chat requests: the body); None unknown
    cache_hit: bool = False          # log: answered by the response cache
    reached_engine: bool = True      # log: false for a HIT and an entry without a node (refused, failed early)
    batch: bool = False              # log: a Batch API request
    point: int | None = None         # log: the route key's ring point (crc32)
    _trace: TraceRequest | None = field(default=None, repr=False)

    def block_len(self, k: int) -> int:
        """Tokens of block ``k`` (512, the last one what is left of ``input_tokens``)."""
        bt = self.block_tokens
        if k < len(self.blocks) - 1:
            return bt
        return max(1, min(bt, self.input_tokens - bt * (len(self.blocks) - 1)))

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


def load_workload(path: str | Path, limit: int | None = None, log_block_tokens: int = 256) -> list[Request]:
    """Read the first ``limit`` requests (lines) of ``path``, sorted by arrival; a gateway log's
    blocks are ``log_block_tokens`` tokens each.

    Raises:
        WorkloadError: a line is not JSON, or neither format.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as fh:
        return load_lines(fh, str(path), limit, log_block_tokens)


def load_lines(lines, name: str = "-", limit: int | None = None, log_block_tokens: int = 256) -> list[Request]:
    """:func:`load_workload` on an iterable of JSON lines (or already decoded dicts)."""
    out: list[Request] = []
    path = name
    for lineno, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if isinstance(line, dict):
            obj = line
        elif not line.strip():
            continue
        else:
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({exc})") from None
        try:
            out.append(_record(obj, len(out), log_block_tokens))
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{path}:{lineno}: neither a Mooncake trace record (hash_ids) nor a chat "
                                f"request (messages) nor a gateway log entry (blocks, pool): {exc!r}") from None
    out.sort(key=lambda r: (r.timestamp_s, r.index))
    if out and out[0].source == "log":
        t0 = out[0].timestamp_s
        for r in out:
            r.timestamp_s -= t0
    return out


def _int(v) -> int | None:
    return int(v) if v not in (None, "") else None


def _record(obj: dict, index: int, log_block_tokens: int = 256) -> Request:
    if "blocks" in obj and "pool" in obj and "messages" not in obj:
        hexes = str(obj.get("blocks") or "")
        if len(hexes) % 16:
            raise ValueError(f"blocks is not a chain of 16-hex-digit hashes ({len(hexes)} digits)")
        blocks = tuple(hexes[i:i + 16] for i in range(0, len(hexes), 16))
        prompt = _int(obj.get("prompt"))
        tenant = str(obj.get("tenant") or "")
        key = str(obj.get("key") or "")
        return Request(index, float(obj.get("ts") or 0), prompt if prompt is not None else len(blocks) * log_block_tokens,
                       _int(obj.get("completion")) or 0, blocks, session=f"{tenant}/{key}" if key else None,
                       user=tenant or None, source="log", block_tokens=log_block_tokens,
                       cache_hit=str(obj.get("cache") or "").upper() == "HIT", batch=bool(obj.get("batch")),
                       reached_engine=str(obj.get("cache") or "").upper() != "HIT"
                       and str(obj.get("node") or "") not in ("", "cache"),
                       point=_int(obj.get("point")))
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
    # an exact repeat: the same body (what the response cache keys on), arrival and session aside
    ident = {k: v for k, v in body.items() if k not in ("timestamp", "session", "output_length")}
    identity = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return Request(index, float(obj.get("timestamp", 0)) / 1000.0, len(tokens), out_tokens, chain_blocks(tokens),
                   messages=messages, session=obj.get("session"), user=body.get("user"), source="requests",
                   identity=identity)
