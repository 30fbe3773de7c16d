"""The prefix-stability lint: stable content placed after variable content.

An engine's prefix cache reuses a prompt only up to its first differing token. A per-user
id, a date or a request id written *before* a long stable part (a system prompt, a document,
a tool list) makes every request differ early, so the stable part is recomputed each time
although every request carries it. The lint finds such requests and says where the variable
span starts and how many tokens of reuse it costs.

Method, per request in arrival order, on its prompt tokens (the simulator's tokeniser and
chat template):

1. **Cached prefix** ``start``: the longest common token prefix with any earlier request
   (chained blocks of :data:`PROBE_BLOCK` tokens find the earlier request, then tokens are
   compared one by one) — what an unbounded prefix cache would reuse.
2. **Shift-proof chunks**: the tokens are cut into content-defined chunks (a chunk ends
   after a token whose CRC-32 is ``0 mod`` :data:`CHUNK_DIVISOR`, mean 16 tokens), so the
   same text gives the same chunks wherever it sits — an id of any length before it does
   not move its chunk boundaries.
3. The **stable tail**: the chunks after ``start`` that some earlier request also had
   (anywhere). ``lost_tokens`` = their tokens: reuse the prompt's order costs. ``end`` = the
   first of them: the variable span is tokens ``[start, end)``.
4. A request is **flagged** when ``lost_tokens >= min_lost`` (default :data:`MIN_LOST`
   tokens, a "long tail"): ordinary traffic (a conversation growing at its end, different
   questions under one system prompt) loses nothing.

A Mooncake trace cannot show this: its block ids are chained, so a block after a difference
never matches anything (and its rendering inherits that). The lint runs on chat requests.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from ..sim.tokenizer import IM_END, IM_START, tokenize, tokenize_chat
from .workload import Request

PROBE_BLOCK = 16
CHUNK_DIVISOR = 16
MIN_LOST = 256
EXAMPLES = 5


@dataclass
class LintFinding:
    """One flagged request: token offsets in its prompt, the message the span starts in."""

    request: int
    start: int
    end: int
    lost_tokens: int
    message: int | None
    role: str | None

    def as_json(self) -> dict:
        return {"request": self.request, "start": self.start, "end": self.end, "lost_tokens": self.lost_tokens,
                "message": self.message, "role": self.role}


@dataclass
class LintReport:
    """``flagged`` requests of ``checked``; ``lost_tokens`` Σ over them (÷ ``prompt_tokens``:
    ``lost_share``); ``start_mode``: the commonest span start (token offset) and its message."""

    checked: int
    applicable: bool
    flagged: int = 0
    lost_tokens: int = 0
    prompt_tokens: int = 0
    start_mode: int | None = None
    start_message: int | None = None
    start_role: str | None = None
    examples: list[LintFinding] = field(default_factory=list)
    note: str = ""

    @property
    def lost_share(self) -> float:
        return self.lost_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_json(self) -> dict:
        return {"checked": self.checked, "applicable": self.applicable, "flagged": self.flagged,
                "lost_tokens": self.lost_tokens, "lost_share": round(self.lost_share, 4),
                "start_mode": self.start_mode, "start_message": self.start_message, "start_role": self.start_role,
                "examples": [e.as_json() for e in self.examples], "note": self.note}


def _chunks(tokens: Sequence[str]) -> list[tuple[int, int, int]]:
    """Content-defined chunks ``(start, end, id)``: a chunk ends after a token t with
    ``crc32(t) % CHUNK_DIVISOR == 0`` (and at the prompt's end)."""
    out, start, prev = [], 0, 0
    for i, t in enumerate(tokens):
        c = zlib.crc32(t.encode("utf-8"))
        prev = zlib.crc32(t.encode("utf-8") + b"\0", prev)
        if c % CHUNK_DIVISOR == 0:
            out.append((start, i + 1, prev))
            start, prev = i + 1, 0
    if start < len(tokens):
        out.append((start, len(tokens), prev))
    return out


def _message_starts(messages: Sequence[dict]) -> list[tuple[int, str]]:
    # the template renders messages one after another, each ending in "\n": tokens never
    # straddle two messages, so a message's first token offset is the sum of those before
    out, pos = [], 0
    for m in messages:
        role = m.get("role", "user") if isinstance(m, dict) else "user"
        out.append((pos, role))
        content = m.get("content") if isinstance(m, dict) else m
        pos += len(tokenize_chat([{"role": role, "content": content}])) - len(tokenize(f"{IM_START}assistant\n"))
    return out


def prefix_lint(reqs: Sequence[Request], min_lost: int = MIN_LOST) -> LintReport:
    """Run the lint on ``reqs`` (arrival order); see the module."""
    if reqs and all(r.source == "trace" for r in reqs):
        return LintReport(checked=len(reqs), applicable=False,
                          note="a Mooncake trace's block ids are chained: content after a difference never matches, "
                               "so the lint needs chat requests (a JSONL of request bodies)")
    seen_chunks: set[int] = set()
    probe: dict[tuple[int, int], int] = {}  # (offset, chained CRC-32) -> an earlier request's index
    toks_of: list[list[str]] = []
    findings: list[LintFinding] = []
    prompt_tokens = 0
    for n, r in enumerate(reqs):
        messages = r.chat()
        tokens = tokenize_chat(messages)
        prompt_tokens += len(tokens)
        # 1. the cached prefix
        prev, best, hashes = 0, None, []
        for s in range(0, len(tokens) - PROBE_BLOCK + 1, PROBE_BLOCK):
            prev = zlib.crc32("\x00".join(tokens[s:s + PROBE_BLOCK]).encode("utf-8"), prev)
            hashes.append((s, prev))
        matched = 0
        for h in hashes:
            other = probe.get(h)
            if other is None:
                break
            best, matched = other, matched + PROBE_BLOCK
        candidates = [best] if best is not None else list(range(max(0, n - 64), n))
        start = matched
        for c in candidates:
            o = toks_of[c]
            k = matched
            while k < len(tokens) and k < len(o) and tokens[k] == o[k]:
                k += 1
            start = max(start, k)
        # 2-3. the stable tail after it
        chunks = _chunks(tokens)
        lost, end = 0, None
        for a, b, cid in chunks:
            if a >= start and cid in seen_chunks:
                lost += b - a
                if end is None:
                    end = a
        if lost >= min_lost:
            msg, role = None, None
            for i, (pos, rl) in enumerate(_message_starts(messages)):
                if pos <= start:
                    msg, role = i, rl
            findings.append(LintFinding(r.index, start, end if end is not None else start, lost, msg, role))
        seen_chunks.update(cid for _, _, cid in chunks)
        for h in hashes:
            probe.setdefault(h, n)
        toks_of.append(tokens)
    rep = LintReport(checked=len(reqs), applicable=True, flagged=len(findings),
                     lost_tokens=sum(f.lost_tokens for f in findings), prompt_tokens=prompt_tokens,
                     examples=findings[:EXAMPLES])
    if findings:
        (mode, _), = Counter(f.start for f in findings).most_common(1)
        rep.start_mode = mode
        first = next(f for f in findings if f.start == mode)
        rep.start_message, rep.start_role = first.message, first.role
    return rep
