"""The online round-robin baseline: what the same requests would have found in the engines'
prefix caches had the pool been balanced round robin (the baseline of the affinity saving).

Per pool, N modelled caches (N = the pool's serving nodes now), each a
:class:`kvgate.sim.prefix_cache.PrefixCache` — the LRU model ``kvgate analyze`` predicts with
(:mod:`kvgate.analyze.predict`) — fed in round-robin order (request *i* → cache ``i mod N``)
with each request-log entry's ``blocks``: the chained hashes of the canonical prompt's
``prefix_index.chunk_chars``-byte chunks, 16 hex digits each. One logged block stands for
``chunk_chars / chars_per_token`` tokens. A cache holds the node's KV capacity: the simulator's
``num_gpu_blocks × block_size`` tokens when every node of the pool is simulated, else
``prefix_index.kv_capacity_tokens``, in logged blocks.

A request's baseline hit is ``leading cached blocks × tokens per block``, at most
``prompt − 1`` (vLLM always computes the last prompt token, :func:`max_hit_blocks`). The log
keeps at most ``usage.log_blocks`` blocks of a prompt, and only full chunks: what the engine
had cached past the logged blocks is credited to round robin as well, and a request with no
logged block (a prompt shorter than one chunk) credits its whole ``cached`` to round robin, so
the affinity saving is a lower bound of what the log can show, never an overstatement.
The state is in memory: a restarted control plane starts with cold modelled caches (as a fresh
round-robin fleet would), which only makes the baseline smaller for the first requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sim.prefix_cache import PrefixCache

HEX_PER_BLOCK = 16


def parse_blocks(blocks: str) -> list[bytes]:
    """``"<16 hex><16 hex>..."`` → one key per block (a trailing partial group is dropped)."""
    n = len(blocks) // HEX_PER_BLOCK
    return [blocks[i * HEX_PER_BLOCK:(i + 1) * HEX_PER_BLOCK].encode("ascii") for i in range(n)]


@dataclass
class PoolModel:
    """One pool's modelled caches: ``capacity_blocks`` logged blocks each, ``tokens_per_block`` tokens
    per logged block, ``nodes`` caches served round robin."""

    capacity_blocks: int
    tokens_per_block: float
    caches: list[PrefixCache] = field(default_factory=list)
    turn: int = 0

    def resize(self, nodes: int) -> None:
        """Keep ``nodes`` caches (≥ 1): new ones start empty, removed ones are forgotten."""
        nodes = max(1, nodes)
        while len(self.caches) < nodes:
            self.caches.append(PrefixCache(self.capacity_blocks, 1))
        del self.caches[nodes:]
        self.turn %= nodes

    def serve(self, chain: list[bytes], prompt: int | None, cached: int | None = None) -> int:
        """Serve one request on the next cache: its cached prompt tokens there (int), then cache
        its blocks (LRU, tail first evictable, as the simulator does). ``cached``: what the
        engine really had; the part of it past the logged blocks (a partial last chunk, blocks
        beyond ``usage.log_blocks``) is invisible to the model and credited to round robin too,
        so the affinity saving is never overstated by what the log does not show."""
        cache = self.caches[self.turn]
        self.turn = (self.turn + 1) % len(self.caches)
        hit_blocks = cache.lookup(chain)
        _, pinned = cache.pin(chain)
        cache.release(chain[:pinned])
        tokens = int(hit_blocks * self.tokens_per_block)
        covered = int(len(chain) * self.tokens_per_block)
        if cached is not None and cached > covered:
            tokens += cached - covered
        if prompt is not None:
            tokens = min(tokens, max(0, prompt - 1))
        return tokens


def pool_capacity(policy, pool) -> tuple[int, float]:
    """``(capacity in logged blocks, tokens per logged block)`` of one policy pool (see the module)."""
    pi = pool.prefix_index
    tokens_per_block = pi.chunk_chars / pi.chars_per_token
    if pool.nodes and all(n.simulate for n in pool.nodes):
        capacity_tokens = policy.simulator.num_gpu_blocks * policy.simulator.block_size
    else:
        capacity_tokens = pi.kv_capacity_tokens
    return max(1, int(capacity_tokens // tokens_per_block)), tokens_per_block


class RoundRobinBaseline:
    """The modelled round-robin caches of every pool; :meth:`serve` one entry at a time, in log order."""

    def __init__(self) -> None:
        self.pools: dict[str, PoolModel] = {}

    def configure(self, policy, serving: dict[str, int] | None = None) -> None:
        """Follow the policy (a pool whose capacity changed starts cold) and the serving node
        counts (``pool → nodes``; default: every node the policy lists)."""
        if policy is None:
            return
        for pool in policy.pools:
            cap, tpb = pool_capacity(policy, pool)
            model = self.pools.get(pool.name)
            if model is None or model.capacity_blocks != cap or model.tokens_per_block != tpb:
                model = self.pools[pool.name] = PoolModel(cap, tpb)
            n = len(pool.nodes) if serving is None else serving.get(pool.name, len(pool.nodes))
            model.resize(n)
        for name in set(self.pools) - {p.name for p in policy.pools}:
            del self.pools[name]

    def serve(self, pool: str, blocks: str, prompt: int | None, cached: int | None = None) -> int | None:
        """Cached tokens round robin would have given this request (``cached``: the engine's, see
        :meth:`PoolModel.serve`); None for an unknown pool or no blocks (the caller then credits
        the request's whole ``cached`` to round robin: no affinity is claimed without evidence)."""
        model = self.pools.get(pool)
        chain = parse_blocks(blocks)
        if model is None or not chain:
            return None
        return model.serve(chain, prompt, cached)
