"""A vLLM-style automatic prefix cache: chained block hashes, reference counts, LRU eviction.

Model (vLLM V1 ``KVCacheManager`` / ``BlockPool``, "automatic prefix caching"):

* The prompt is cut into blocks of ``block_size`` tokens; only **full** blocks are
  cached. Block *i* is identified by a hash chained over every block before it, so
  equal hashes mean equal content *and* equal prefix.
* A running sequence pins its blocks (reference count > 0); pinned blocks are never
  evicted. When the last reference goes, the block stays cached and becomes
  evictable; eviction takes the least recently freed block first.
* Like vLLM, a finished sequence frees its blocks tail first, so under pressure the
  end of a prompt is evicted before its (more shared) beginning.
* Capacity is ``num_blocks`` blocks. When every block is pinned, a new sequence
  gets the longest prefix of its blocks that fits; the rest of its prompt is
  computed but not cached (vLLM would queue or preempt instead).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence


class PrefixCache:
    """A finite, reference-counted, LRU-evicting cache of prompt blocks.

    Args:
        num_blocks: capacity in blocks (vLLM ``num_gpu_blocks``), ≥ 1.
        block_size: tokens per block (vLLM ``--block-size``), ≥ 1.

    Raises:
        ValueError: a non-positive ``num_blocks`` or ``block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be ≥ 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # pinned blocks: hash → reference count (> 0)
        self._pinned: dict[bytes, int] = {}
        # cached, unpinned blocks in eviction order (first = least recently used)
        self._free: OrderedDict[bytes, None] = OrderedDict()

    # ------------------------------------------------------------------ hashes
    @staticmethod
    def block_hashes(tokens: Sequence[str], block_size: int) -> list[bytes]:
        """Chained hashes of the full blocks of ``tokens``.

        ``h_i = sha256(h_{i-1} || "\\x00".join(block_i).encode("utf-8"))`` with ``h_{-1} = b""``;
        a trailing partial block has no hash (vLLM caches full blocks only).

        Args:
            tokens: the prompt tokens.
            block_size: tokens per block, ≥ 1.

        Returns:
            ``len(tokens) // block_size`` 32-byte digests.
        """
        sha256 = hashlib.sha256
        out: list[bytes] = []
        prev = b""
        for start in range(0, len(tokens) - block_size + 1, block_size):
            prev = sha256(prev + "\x00".join(tokens[start:start + block_size]).encode("utf-8")).digest()
            out.append(prev)
        return out

    # ----------------------------------------------------------------- queries
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of ``hashes`` that are cached; changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._pinned and h not in self._free:
                break
            n += 1
        return n

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding cached content, pinned or not (≤ ``num_blocks``)."""
        return len(self._pinned) + len(self._free)

    @property
    def usage(self) -> float:
        """Fraction (0..1) of blocks held by running sequences.

        This is what vLLM V1 reports as ``vllm:kv_cache_usage_perc``: cached but unpinned
        blocks count as free because they can be evicted at any time.
        """
        return len(self._pinned) / self.num_blocks

    # ---------------------------------------------------------------- mutation
    def pin(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Pin the blocks of one sequence; like :meth:`acquire` but also says how many were pinned.

        Returns:
            ``(hits, pinned)``: the number of leading blocks that were cached before the
            call, and the number of leading blocks now pinned (``len(hashes)`` unless the
            cache ran out of evictable blocks). Release exactly ``hashes[:pinned]``.
        """
        hits = self.lookup(hashes)
        pinned = 0
        for h in hashes:
            ref = self._pinned.get(h)
            if ref is not None:
                self._pinned[h] = ref + 1
            elif h in self._free:
                del self._free[h]
                self._pinned[h] = 1
            elif len(self._pinned) + len(self._free) < self.num_blocks:
                self._pinned[h] = 1
            elif self._free:
                self._free.popitem(last=False)
                self._pinned[h] = 1
            else:
                break  # every block is pinned: the rest of the prompt is computed, not cached
            pinned += 1
        return hits, pinned

    def acquire(self, hashes: Sequence[bytes]) -> int:
        """Pin all blocks of a sequence, allocating (and evicting LRU unpinned blocks) as needed.

        Cached blocks get one more reference; missing ones are allocated. If the cache
        cannot hold them all (everything else pinned), the longest prefix that fits is
        pinned; use :meth:`pin` to learn how many.

        Returns:
            The number of leading blocks that were already cached (the prefix-cache hit).
        """
        return self.pin(hashes)[0]

    def release(self, hashes: Sequence[bytes]) -> None:
        """Unpin a sequence's blocks; they stay cached and become evictable, tail block first.

        Hashes that are not pinned are ignored, so releasing more than was pinned is harmless
        to this sequence but would unpin another sequence's shared blocks: release what
        :meth:`pin` reported.
        """
        for h in reversed(hashes):
            ref = self._pinned.get(h)
            if ref is None:
                continue
            if ref > 1:
                self._pinned[h] = ref - 1
            else:
                del self._pinned[h]
                self._free[h] = None  # most recently used end

    def lookup_and_insert(self, tokens: Sequence[str]) -> int:
        """Offline use (the replay's pooled ceiling): cached prompt tokens, then cache the prompt.

        The hit follows vLLM: at most ``(len(tokens) - 1) // block_size`` blocks can hit,
        because the engine must compute at least the last prompt token.

        Returns:
            Cached prompt tokens (a multiple of ``block_size``, < ``len(tokens)``).
        """
        hashes = self.block_hashes(tokens, self.block_size)
        hit_blocks = min(self.lookup(hashes), max_hit_blocks(len(tokens), self.block_size))
        _, pinned = self.pin(hashes)
        self.release(hashes[:pinned])
        return hit_blocks * self.block_size

    def reset(self) -> bool:
        """Drop every unpinned block (vLLM ``POST /reset_prefix_cache``).

        Returns:
            ``True`` when the cache is now empty; ``False`` when blocks of running
            sequences stayed (vLLM refuses the whole reset in that case; the simulator
            drops what it can and keeps the pinned blocks cached).
        """
        self._free.clear()
        return not self._pinned


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most blocks of a prompt that may be served from cache.

    vLLM V1 (``KVCacheManager.get_computed_blocks``) caps the cache hit at
    ``num_prompt_tokens - 1`` tokens so the last token is always computed and yields
    logits, and only whole blocks hit: ``(num_prompt_tokens - 1) // block_size``.
    """
    return max(0, num_prompt_tokens - 1) // block_size
