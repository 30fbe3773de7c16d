"""The pooled prefix-cache ceiling of a trace.

The ceiling is the token-weighted prefix-cache hit ratio that ONE cache as large as
all engines together reaches on the same requests in arrival order, computed
offline with the engines' own cache model (:class:`kvgate.sim.prefix_cache.PrefixCache`,
same tokeniser, block size and LRU eviction). No routing can beat it with the same
total KV memory, so ``hit_ratio / ceiling`` says how much of the reachable reuse a
balancer captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..sim.prefix_cache import PrefixCache
from ..sim.tokenizer import tokenize_chat


@dataclass
class CeilingResult:
    """``hits`` and ``queries`` in prompt tokens; ``ratio`` = hits / queries (0 when no queries)."""

    hits: int
    queries: int

    @property
    def ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def pooled_ceiling(prompts: Iterable[list[dict]], num_blocks: int, block_size: int) -> CeilingResult:
    """Replay rendered chat prompts through one prefix cache of ``num_blocks`` blocks.

    Args:
        prompts: chat ``messages`` lists, in arrival order.
        num_blocks: the pooled capacity, i.e. the sum of every engine's KV-cache blocks.
        block_size: tokens per block (vLLM ``--block-size``), as the engines use.
    """
    cache = PrefixCache(num_blocks, block_size)
    hits = queries = 0
    for messages in prompts:
        tokens = tokenize_chat(messages)
        hits += cache.lookup_and_insert(tokens)
        queries += len(tokens)
    return CeilingResult(hits=hits, queries=queries)
