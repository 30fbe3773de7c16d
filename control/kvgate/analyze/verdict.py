"""The seed's verdict: does affinity routing pay on this traffic, or is warming enough?

Three questions, in order, each a documented threshold (docs/analyze.md, *The verdict*):

1. **Is there reuse at all?** ``reuse_share`` (token-weighted, unbounded) below
   :data:`MIN_REUSE` (5 % of prompt tokens): *not worth it* — no cache-aware routing saves
   much on prompts that do not repeat.
2. **Does affinity pay?** All of: the per-conversation part of the reuse is at least
   :data:`MIN_CONVERSATION_REUSE` (5 % of prompt tokens); conversations have more than one
   turn on average (``session_length_mean`` ≥ :data:`MIN_TURNS`, 1.2); the request rate lets a
   node's cache keep a conversation until its next turn — the cache's **retention**,
   ``num_gpu_blocks × block_size`` ÷ the new (uncached) prompt tokens a node takes per second
   at this rate (prompt tokens × (1 − reuse) ÷ span ÷ N), is at least the median gap between
   turns; and, when predicted, chash beats round robin by at least :data:`MIN_GAIN` (0.02).
   Then *affinity pays*.
3. Otherwise, if the **shared part** (system prompts common to many conversations) is at
   least :data:`MIN_SHARED_REUSE` (5 %): *warming the common prefixes is enough* — every node
   soon holds them under any balancer (kvgate's ``warmup.hot_prefixes`` puts them on a node
   that joins); else *not worth it*.
"""

from __future__ import annotations

from dataclasses import dataclass

from .stats import TraceStats

MIN_REUSE = 0.05
MIN_CONVERSATION_REUSE = 0.05
MIN_SHARED_REUSE = 0.05
MIN_TURNS = 1.2
MIN_GAIN = 0.02

AFFINITY = "affinity pays"
WARM = "warming the common prefixes is enough"
NOT_WORTH = "not worth it"


@dataclass
class Row:
    """One line of the verdict table: ``passed`` says whether the value meets the threshold."""

    factor: str
    value: float
    threshold: str
    passed: bool

    def as_json(self) -> dict:
        return {"factor": self.factor, "value": round(self.value, 4), "threshold": self.threshold,
                "passed": self.passed}


def retention_s(stats: TraceStats, nodes: int, num_gpu_blocks: int, block_size: int) -> float:
    """Seconds a node's cache keeps a prompt at this rate (``inf`` without new tokens)."""
    if stats.span_s <= 0 or nodes < 1:
        return float("inf")
    new_per_s = stats.prompt_tokens * (1 - stats.reuse_share) / stats.span_s / nodes
    return num_gpu_blocks * block_size / new_per_s if new_per_s > 0 else float("inf")


def verdict(stats: TraceStats, nodes: int, num_gpu_blocks: int, block_size: int,
            gain: float | None = None) -> tuple[str, list[Row]]:
    """``(verdict, rows)`` for the statistics, the fleet's caches and chash's predicted gain
    over round robin (hit ratio points; None when not predicted)."""
    keep = retention_s(stats, nodes, num_gpu_blocks, block_size)
    rows = [
        Row("prefix reuse (share of prompt tokens)", stats.reuse_share, f">= {MIN_REUSE}",
            stats.reuse_share >= MIN_REUSE),
        Row("per-conversation reuse", stats.conversation_reuse_share, f">= {MIN_CONVERSATION_REUSE}",
            stats.conversation_reuse_share >= MIN_CONVERSATION_REUSE),
        Row("conversation length (mean turns)", stats.session_length_mean, f">= {MIN_TURNS}",
            stats.session_length_mean >= MIN_TURNS),
        Row("cache retention at this rate (s)", keep, f">= median turn gap ({stats.turn_gap_p50_s:.0f} s)",
            keep >= stats.turn_gap_p50_s),
        Row("shared prefix reuse (system prompts)", stats.shared_reuse_share, f">= {MIN_SHARED_REUSE}",
            stats.shared_reuse_share >= MIN_SHARED_REUSE),
    ]
    if gain is not None:
        rows.append(Row("predicted chash - round robin hit ratio", gain, f">= {MIN_GAIN}", gain >= MIN_GAIN))
    if not rows[0].passed:
        return NOT_WORTH, rows
    affinity = rows[1].passed and rows[2].passed and rows[3].passed and (gain is None or rows[5].passed)
    if affinity:
        return AFFINITY, rows
    return (WARM if rows[4].passed else NOT_WORTH), rows
