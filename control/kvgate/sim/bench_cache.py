"""Micro-benchmark of the simulator's per-request hot path: tokenise + block-hash, and the prefix cache.

Prints numbers, asserts nothing (speed targets do not belong in unit tests on a shared box)::

    python -m kvgate.sim.bench_cache              # defaults: 12k-token prompt, 20 repeats
    python -m kvgate.sim.bench_cache --tokens 32000 --repeat 50

Target on the 2-core dev box: tokenise + hash a 12k-token chat prompt in a few ms (≈3 ms),
i.e. well under 10 ms. Report the best of the repeats (least disturbed by other load) and
the median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from .prefix_cache import PrefixCache
from .tokenizer import tokenize_chat


def _times(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(tokens: int = 12000, repeat: int = 20, block_size: int = 16) -> dict[str, tuple[float, float]]:
    """Benchmark; returns ``{case: (best_ms, median_ms)}``."""
    words = " ".join(f"w{i % 4096}" for i in range(tokens))
    messages = [{"role": "user", "content": words}]
    prompt = tokenize_chat(messages)
    hashes = PrefixCache.block_hashes(prompt, block_size)

    def tokenize_and_hash() -> None:
        PrefixCache.block_hashes(tokenize_chat(messages), block_size)

    def pin_release_hit() -> None:
        cache = PrefixCache(num_blocks=len(hashes) * 2, block_size=block_size)
        _, pinned = cache.pin(hashes)
        cache.release(hashes[:pinned])
        _, pinned = cache.pin(hashes)  # the second time every block hits
        cache.release(hashes[:pinned])

    cases = {
        "tokenize_chat": lambda: tokenize_chat(messages),
        "block_hashes": lambda: PrefixCache.block_hashes(prompt, block_size),
        "tokenize+hash": tokenize_and_hash,
        "pin/release x2": pin_release_hit,
    }
    return {name: (min(t) * 1000, statistics.median(t) * 1000)
            for name, t in ((name, _times(fn, repeat)) for name, fn in cases.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12000, help="words in the chat prompt")
    parser.add_argument("--repeat", type=int, default=20, help="runs per case")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"prompt: {args.tokens} words, block size {args.block_size}, {args.repeat} runs per case")
    for name, (best, median) in run(args.tokens, args.repeat, args.block_size).items():
        print(f"{name:16s} best {best:8.2f} ms   median {median:8.2f} ms")


if __name__ == "__main__":
    main()
