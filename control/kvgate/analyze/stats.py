"""Block-level statistics of a workload: what repeats, how much, shared or per conversation.

Every figure is computed on the requests' block chains (:mod:`kvgate.analyze.workload`: 512-
token blocks, equal id = equal content and equal prefix), in arrival order, with no cache
limit — what the traffic offers, before any capacity or routing.

Definitions (each one unit-tested in ``tests/unit/test_analyze_stats.py``):

* **first-500 repetition** (the seed's measure): a request's *first-500 prefix* is its first
  ``min(500, input_tokens)`` tokens. Two requests **see the same first 500 tokens** when
  their first blocks have the same id and their prefixes have the same length (500, or the
  same shorter prompt length): 500 < 512, so the first block decides, and block ids are the
  finest grain a trace has. A request's first 500 tokens were **seen at least twice** when
  its first-500 prefix occurs in at least 2 requests of the analysed set (itself included):
  ``first500_repeat_share`` = such requests ÷ requests. ``first500_seen_before_share`` is the
  stricter online variant: the prefix occurred in an *earlier* request.
* **token-weighted prefix reuse**: Σ over requests of the tokens of its leading blocks that
  an earlier request already had (a block is reused for at most as many tokens as an earlier
  request held of it: a partial last block is a prefix of the full one) ÷ Σ prompt tokens.
  One unbounded cache: the most any routing could reach.
* **shared vs per-conversation**: a block *branches* when at least :data:`COMMON_FANOUT`
  different full blocks follow it in the workload (a system prompt or template that many
  conversations continue; one edited or regenerated turn gives only 2). A request's *common
  prefix* runs from its start to its deepest branching block (a two-block system prompt is
  common when its second block branches). Reuse of blocks in some request's common prefix is
  the **shared** part, the rest **per-conversation**. A conversation regenerated 3 times at
  one turn is counted shared down to that turn (rare: the hottest prefixes show it).
* **conversation**: the requests whose first block after the common prefix is the same
  (a request that is all common prefix is a conversation of its own); its **length** is
  its number of requests (turns). ``turn_gap_s``: seconds between consecutive turns.
* **hottest prefixes**: the prefixes most requests share, each the longest with its count
  (a prefix whose only continuation has the same count is not listed: its longer form is),
  named by ``sha256`` of the block-id chain (16 hex) — hashes and counts, never text.
* **reuse by depth**: per block depth ``k`` (tokens ``512k .. 512(k+1)``), of the requests
  whose prompt reaches it, the share whose block ``k`` was already seen (shared or not).
"""

from __future__ import annotations

import hashlib
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from .workload import BLOCK_TOKENS, Request

SEED_PREFIX_TOKENS = 500
COMMON_FANOUT = 3
HOT_PREFIXES = 10
SESSION_BUCKETS = ((1, 1), (2, 2), (3, 5), (6, 10), (11, 20), (21, None))


def first500_key(r: Request) -> tuple:
    """The first-500 prefix's identity: ``(first block id, min(500, input tokens))``."""
    return (r.blocks[0] if r.blocks else None, min(SEED_PREFIX_TOKENS, r.input_tokens))


def prefix_digest(chain: Sequence) -> str:
    """16 hex of ``sha256`` over a block-id chain (ids joined by ``/``): a prefix's name."""
    return hashlib.sha256("/".join(str(b) for b in chain).encode()).hexdigest()[:16]


@dataclass
class TraceStats:
    """What :func:`trace_stats` finds; tokens are prompt tokens unless named otherwise."""

    requests: int
    span_s: float
    request_rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    prompt_tokens: int
    first500_repeat_share: float
    first500_seen_before_share: float
    reuse_tokens: int
    reuse_share: float
    shared_reuse_tokens: int
    conversation_reuse_tokens: int
    shared_reuse_share: float
    conversation_reuse_share: float
    common_prefix_tokens_mean: float
    conversations: int
    session_length_mean: float
    session_length_p50: float
    session_length_p90: float
    session_length_max: int
    session_length_histogram: dict[str, int]
    turn_gap_p50_s: float
    hottest_prefixes: list[dict] = field(default_factory=list)
    reuse_by_depth: list[dict] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, int(round(q * (len(s) - 1))))])


def trace_stats(reqs: Sequence[Request]) -> TraceStats:
    """The block-level statistics of ``reqs`` (in arrival order); see the module's definitions."""
    n = len(reqs)
    # --- the seed's measure
    f500 = Counter(first500_key(r) for r in reqs)
    seen500: set = set()
    before500 = 0
    for r in reqs:
        k = first500_key(r)
        before500 += k in seen500
        seen500.add(k)
    # --- the block trie: full continuations per block, requests through each block
    full_children: dict = defaultdict(set)
    through: Counter = Counter()
    for r in reqs:
        for k, b in enumerate(r.blocks):
            through[b] += 1
            if k + 1 < len(r.blocks) and r.block_len(k + 1) == r.block_tokens:
                full_children[b].add(r.blocks[k + 1])
    # common = a chain from the start of blocks with >= COMMON_FANOUT full continuations;
    # the common prefix of a request ends at its last common block
    branching = {b for b, ch in full_children.items() if len(ch) >= COMMON_FANOUT}
    common: set = set()
    depth_common: list[int] = []
    for r in reqs:
        last = -1
        for k, b in enumerate(r.blocks):
            if b in branching:
                last = k
        # every block up to the deepest branching one, if the path to it starts at the root
        depth_common.append(last + 1)
        common.update(r.blocks[:last + 1])
    # --- reuse, online, unbounded
    held: dict = {}
    reuse = shared = 0
    depth_seen: Counter = Counter()
    depth_reach: Counter = Counter()
    depth_shared: Counter = Counter()
    for r in reqs:
        matching = True
        for k, b in enumerate(r.blocks):
            ln = r.block_len(k)
            depth_reach[k] += 1
            had = held.get(b, 0) if matching else 0
            if had:
                got = min(ln, had)
                reuse += got
                depth_seen[k] += 1
                if b in common:
                    shared += got
                    depth_shared[k] += 1
                if got < ln:
                    matching = False
            else:
                matching = False
            if ln > held.get(b, 0):
                held[b] = ln
    prompt_tokens = sum(r.input_tokens for r in reqs)
    # --- conversations
    conv_of: list = []
    for r, d in zip(reqs, depth_common):
        conv_of.append(("c", r.blocks[d]) if d < len(r.blocks) else ("r", r.index))
    convs: dict = defaultdict(list)
    for r, c in zip(reqs, conv_of):
        convs[c].append(r.timestamp_s)
    lengths = [len(v) for v in convs.values()]
    gaps = [b - a for ts in convs.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]
    hist: dict[str, int] = {}
    for lo, hi in SESSION_BUCKETS:
        label = f"{lo}" if lo == hi else (f"{lo}+" if hi is None else f"{lo}-{hi}")
        hist[label] = sum(1 for x in lengths if x >= lo and (hi is None or x <= hi))
    # --- hottest prefixes: the longest prefix with each count
    chain_of: dict = {}
    for r in reqs:
        for k, b in enumerate(r.blocks):
            chain_of.setdefault(b, (r, k))
    only_child_same: set = set()
    for b, ch in full_children.items():
        if len(ch) == 1 and through[next(iter(ch))] == through[b]:
            only_child_same.add(b)
    hot = []
    for b, c in through.most_common():
        if c < 2 or len(hot) >= HOT_PREFIXES:
            break
        if b in only_child_same:
            continue
        r, k = chain_of[b]
        hot.append({"prefix": prefix_digest(r.blocks[:k + 1]), "requests": c,
                    "tokens": r.block_tokens * k + r.block_len(k), "common": b in common})
    span = (reqs[-1].timestamp_s - reqs[0].timestamp_s) if n else 0.0
    depth = [{"depth": k, "tokens_from": BLOCK_TOKENS * k, "requests": depth_reach[k],
              "seen_share": depth_seen[k] / depth_reach[k], "shared_share": depth_shared[k] / depth_reach[k]}
             for k in sorted(depth_reach)]
    return TraceStats(
        requests=n, span_s=span, request_rate_per_s=(n / span) if span > 0 else 0.0,
        mean_input_tokens=prompt_tokens / n if n else 0.0,
        mean_output_tokens=sum(r.output_tokens for r in reqs) / n if n else 0.0,
        prompt_tokens=prompt_tokens,
        first500_repeat_share=sum(1 for r in reqs if f500[first500_key(r)] >= 2) / n if n else 0.0,
        first500_seen_before_share=before500 / n if n else 0.0,
        reuse_tokens=reuse, reuse_share=reuse / prompt_tokens if prompt_tokens else 0.0,
        shared_reuse_tokens=shared, conversation_reuse_tokens=reuse - shared,
        shared_reuse_share=shared / prompt_tokens if prompt_tokens else 0.0,
        conversation_reuse_share=(reuse - shared) / prompt_tokens if prompt_tokens else 0.0,
        common_prefix_tokens_mean=(sum(sum(r.block_len(k) for k in range(d)) for r, d in zip(reqs, depth_common)) / n
                                   if n else 0.0),
        conversations=len(convs),
        session_length_mean=statistics.fmean(lengths) if lengths else 0.0,
        session_length_p50=_pct(lengths, 0.5), session_length_p90=_pct(lengths, 0.9),
        session_length_max=max(lengths, default=0), session_length_histogram=hist,
        turn_gap_p50_s=_pct(gaps, 0.5),
        hottest_prefixes=hot, reuse_by_depth=depth,
    )
