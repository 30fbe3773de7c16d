"""PrefixCache: chained block hashes, LRU eviction, pinning, vLLM's hit cap."""

import time

import pytest

from kvgate.sim.prefix_cache import PrefixCache, max_hit_blocks
from kvgate.sim.tokenizer import tokenize_chat


def toks(n: int, tag: str = "t") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_block_hashes_full_blocks_only_and_chained():
    a = toks(50)
    ha = PrefixCache.block_hashes(a, 16)
    assert len(ha) == 3 and all(len(h) == 32 for h in ha)
    assert PrefixCache.block_hashes(a, 16) == ha  # deterministic
    b = list(a)
    b[20] = "changed"  # inside block 1
    hb = PrefixCache.block_hashes(b, 16)
    assert hb[0] == ha[0]
    assert hb[1] != ha[1] and hb[2] != ha[2]  # chaining: every later block changes too
    # same block content after a different prefix hashes differently
    c = toks(16, "x") + a[16:32]
    assert PrefixCache.block_hashes(c, 16)[1] != ha[1]
    # token boundaries matter: "ab","c" != "a","bc"
    assert PrefixCache.block_hashes(["ab", "c"], 2) != PrefixCache.block_hashes(["a", "bc"], 2)


def test_lookup_acquire_release_counts():
    cache = PrefixCache(num_blocks=10, block_size=4)
    h = PrefixCache.block_hashes(toks(12), 4)
    assert cache.lookup(h) == 0
    assert cache.acquire(h) == 0
    assert cache.num_used_blocks == 3 and cache.usage == pytest.approx(0.3)
    assert cache.acquire(h) == 3  # a second sequence with the same prompt shares the blocks
    assert cache.num_used_blocks == 3
    cache.release(h)
    assert cache.usage == pytest.approx(0.3)  # still pinned by the other sequence
    cache.release(h)
    assert cache.usage == 0 and cache.num_used_blocks == 3  # cached, evictable
    assert cache.lookup(h) == 3


def test_lru_eviction_order():
    cache = PrefixCache(num_blocks=4, block_size=2)
    a, b, c = (PrefixCache.block_hashes(toks(4, tag), 2) for tag in "abc")
    for h in (a, b):
        cache.acquire(h)
        cache.release(h)
    cache.lookup(a)  # lookup does not touch the LRU
    cache.acquire(a)  # ...but using a does: b is now the least recently used
    cache.release(a)
    cache.acquire(c)
    cache.release(c)
    assert cache.lookup(a) == 2
    assert cache.lookup(b) == 0
    assert cache.lookup(c) == 2
    assert cache.num_used_blocks == 4


def test_release_frees_tail_first():
    cache = PrefixCache(num_blocks=3, block_size=1)
    h = PrefixCache.block_hashes(toks(3), 1)
    cache.acquire(h)
    cache.release(h)
    other = PrefixCache.block_hashes(["z"], 1)
    cache.acquire(other)  # evicts one block: the tail of the released prompt
    assert cache.lookup(h) == 2


def test_pinned_blocks_are_not_evicted_and_overflow_allocates_what_fits():
    cache = PrefixCache(num_blocks=4, block_size=2)
    a = PrefixCache.block_hashes(toks(6, "a"), 2)  # 3 blocks
    b = PrefixCache.block_hashes(toks(6, "b"), 2)
    cache.acquire(a)  # pinned
    hits, pinned = cache.pin(b)
    assert (hits, pinned) == (0, 1)  # only one free block left
    assert cache.lookup(a) == 3
    cache.release(b[:pinned])
    cache.release(a)
    assert cache.usage == 0


def test_reset_drops_unpinned_only():
    cache = PrefixCache(num_blocks=8, block_size=2)
    a = PrefixCache.block_hashes(toks(4, "a"), 2)
    b = PrefixCache.block_hashes(toks(4, "b"), 2)
    cache.acquire(a)
    cache.release(a)
    assert cache.reset() is True
    assert cache.lookup(a) == 0 and cache.num_used_blocks == 0
    cache.acquire(a)
    cache.acquire(b)
    cache.release(b)
    assert cache.reset() is False  # a is still running
    assert cache.lookup(a) == 2 and cache.lookup(b) == 0


def test_lookup_and_insert_and_vllm_last_token_cap():
    cache = PrefixCache(num_blocks=100, block_size=16)
    prompt = toks(40)
    assert cache.lookup_and_insert(prompt) == 0
    assert cache.lookup_and_insert(prompt) == 32  # 2 full blocks of 40 tokens
    assert cache.usage == 0  # offline insertion leaves nothing pinned
    exact = toks(32, "e")  # every block full: the last token must still be computed
    assert cache.lookup_and_insert(exact) == 0
    assert cache.lookup_and_insert(exact) == 16  # (32 - 1) // 16 blocks, like vLLM
    assert max_hit_blocks(33, 16) == 2 and max_hit_blocks(32, 16) == 1 and max_hit_blocks(0, 16) == 0
    # a shared prefix hits across prompts
    assert cache.lookup_and_insert(toks(40) + ["more"] * 10) == 32


def test_tokenize_and_hash_12k_token_prompt():
    """Correctness, plus a sanity bound only: the speed target (a few ms) is measured by
    ``python -m kvgate.sim.bench_cache``, not asserted here (the test box is shared and loaded)."""
    words = " ".join(f"w{i % 4096}" for i in range(12000))
    t0 = time.perf_counter()
    tokens = tokenize_chat([{"role": "user", "content": words}])
    hashes = PrefixCache.block_hashes(tokens, 16)
    elapsed = time.perf_counter() - t0
    assert len(tokens) == 12002  # "<|im_start|>user", 12000 words (the last with <|im_end|>), the generation prompt
    assert len(hashes) == len(tokens) // 16 == 750
    assert elapsed < 1.0, f"tokenize+hash of 12k tokens took {elapsed * 1000:.1f} ms: something is badly wrong"
