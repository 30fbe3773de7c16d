"""Predicted prefix-cache hit ratios for N engines under each balancer, offline.

One pass over the requests in arrival order. Every request is rendered as the replay sends
it (:meth:`Request.chat`), tokenised with the simulator's tokeniser and template, and cut
into the engines' chained blocks (``simulator.block_size``). Each balancer's engines are
modelled as :class:`kvgate.sim.prefix_cache.PrefixCache` instances of ``num_gpu_blocks``
blocks each — the simulator's own cache (LRU, tail blocks freed first, at most
``(n - 1) // block_size`` blocks hit) — served in arrival order; a request's hit is the
number of its prompt tokens the chosen engine already held. The ratio is token-weighted,
Σ hits ÷ Σ prompt tokens, as the replay measures it from ``vllm:prefix_cache_*``.

* **round_robin**: request *i* goes to engine ``i mod N`` (each gateway worker's smooth
  round robin interleaves to the same chance, 1/N, that a turn lands where the last one did).
* **chash**: the gateway's route key (:func:`kvgate.analyze.routing.route_key`, the pool's
  affinity, session header and prefix window) on the gateway's ring
  (:class:`kvgate.analyze.routing.Ring`, node ids at policy weight × ``WEIGHT_SCALE``):
  exact routing, so its error is the cache model's alone.
* **chash_bounded** (APPROXIMATE): the ring walk with the bound ``load < c × (total + cost) ×
  w / W`` (``lua/kvgate/balancer/chash_bounded.lua``; c = ``bound_factor``, 1 for a key whose
  window covers only a shared prefix), load = the estimated prompt tokens (body bytes ÷ 4)
  of the requests in flight on the node. In flight = from arrival until arrival + the
  simulator's service time, ``prefill_s_per_token`` × uncached tokens + ``decode_s_per_token``
  × output tokens, in trace seconds (the replay runs at ``1 / time_scale``, so trace time is
  the engines' modelled time). Not modelled: engine queueing and batching (which lengthen
  the time in flight), the queue signal (``saturated_queue``), the client's concurrency cap.
* **pooled ceiling**: one cache of N × ``num_gpu_blocks`` blocks (``kvgate.bench.ceiling``).

On the **gateway's log** (``Request.source == "log"``) there is no text: the blocks are the
log's chained hashes of ``chunk_chars``-byte chunks (``block_tokens`` tokens each), the caches
hold ``num_gpu_blocks × block_size ÷ block_tokens`` of them, chash routes on the entry's ring
``point``, chash_bounded's load is the prompt tokens, and a response-cache HIT is not modelled
(the engines never saw it), nor an entry without a node (refused or failed before one; the
rollups' round-robin baseline skips the same entries, kvgate.costs.baseline). Prompt tokens past the logged blocks (the partial last chunk,
blocks beyond ``usage.log_blocks``) count as queried and never hit: the prediction is then a
lower bound.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..render import WEIGHT_SCALE
from ..sim.prefix_cache import PrefixCache, max_hit_blocks
from ..sim.tokenizer import tokenize_chat
from .routing import Ring, key_point, route_key
from .workload import Request

BALANCERS = ("round_robin", "chash", "chash_bounded", "pooled_ceiling")
BYTES_PER_TOKEN = 4  # lua/kvgate/balancer/load.lua's estimate


@dataclass
class CacheConfig:
    """The engines' caches and the routing settings the prediction uses (from the policy)."""

    nodes: list[tuple[str, int]]          # (id, nginx weight)
    num_gpu_blocks: int
    block_size: int
    affinity: list[str] = field(default_factory=lambda: ["session", "user", "prefix"])
    prefix_chars: int = 4096
    fallback_route_key: str = ""
    bound_factor: float = 1.25
    prefill_s_per_token: float = 1e-4
    decode_s_per_token: float = 0.02
    model: str = "demo-model"

    @classmethod
    def from_policy(cls, policy, pool_name: str | None = None, nodes: int | None = None) -> "CacheConfig":
        """The policy's pool (the first by default); ``nodes`` overrides its node count (ids
        ``n1 .. nN`` at weight 1 when it differs from the pool's). Cache size per engine: the
        simulator's ``num_gpu_blocks`` when every node is simulated, else the pool's
        ``prefix_index.kv_capacity_tokens`` (in ``block_size`` blocks)."""
        pool = next((p for p in policy.pools if p.name == pool_name), None) if pool_name else policy.pools[0]
        if pool is None:
            raise KeyError(pool_name)
        node_list = [(n.id, int(n.weight * WEIGHT_SCALE)) for n in pool.nodes]
        if nodes is not None and nodes != len(node_list):
            node_list = [(f"n{i + 1}", WEIGHT_SCALE) for i in range(nodes)]
        sim = policy.simulator
        blocks = sim.num_gpu_blocks
        if pool.nodes and not all(n.simulate for n in pool.nodes):
            # real engines: the pool's declared KV capacity (as kvgate.costs.baseline)
            blocks = max(1, pool.prefix_index.kv_capacity_tokens // sim.block_size)
        return cls(nodes=node_list, num_gpu_blocks=blocks, block_size=sim.block_size,
                   affinity=list(pool.affinity), prefix_chars=pool.prefix_chars,
                   fallback_route_key=policy.gateway.fallback_route_key,
                   bound_factor=float(getattr(pool, "bound_factor", None) or 1.25),
                   prefill_s_per_token=sim.prefill_s_per_token, decode_s_per_token=sim.decode_s_per_token,
                   model=sim.model)


@dataclass
class Prediction:
    """Per balancer: ``hit_ratio`` (token-weighted), ``hits`` and ``queries`` in tokens,
    ``prefill_tokens`` per node and ``imbalance`` (max ÷ mean of them)."""

    balancer: str
    hits: int = 0
    queries: int = 0
    prefill: dict[str, int] = field(default_factory=dict)
    approximate: bool = False
    spills: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def imbalance(self) -> float:
        vals = list(self.prefill.values())
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean else 0.0

    def as_json(self) -> dict:
        out = {"hit_ratio": round(self.hit_ratio, 4), "hits": self.hits, "queries": self.queries,
               "imbalance": round(self.imbalance, 4)}
        if self.balancer == "chash_bounded":
            out["approximate"] = True
            out["spills"] = self.spills
        return out


def _serve(cache: PrefixCache, hashes: list[bytes], n_tokens: int) -> int:
    """``PrefixCache.lookup_and_insert`` on hashes made once for every model: cached tokens."""
    hit = min(cache.lookup(hashes), max_hit_blocks(n_tokens, cache.block_size)) * cache.block_size
    _, pinned = cache.pin(hashes)
    cache.release(hashes[:pinned])
    return hit


def _body_bytes(cfg: CacheConfig, r: Request, messages: list[dict]) -> int:
    # the replay's body (kvgate.bench.replay.send_trace), for load.lua's estimate
    return len(json.dumps({"model": cfg.model, "messages": messages, "max_tokens": max(1, r.output_tokens),
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}))


def predict(reqs: Sequence[Request], cfg: CacheConfig,
            on_request: Callable[[], None] | None = None) -> dict[str, Prediction]:
    """Predicted hit ratios of :data:`BALANCERS` on ``reqs`` (arrival order); see the module."""
    ids = [i for i, _ in cfg.nodes]
    n = len(ids)
    ring = Ring(cfg.nodes)
    weight = dict(cfg.nodes)
    W = sum(weight.values())
    log = bool(reqs) and reqs[0].source == "log"
    bs, nblocks = cfg.block_size, cfg.num_gpu_blocks
    if log:
        bs = max(1, reqs[0].block_tokens)
        nblocks = max(1, cfg.num_gpu_blocks * cfg.block_size // bs)
    caches = {b: {i: PrefixCache(nblocks, bs) for i in ids}
              for b in ("round_robin", "chash", "chash_bounded")}
    pooled = PrefixCache(nblocks * n, bs)
    out = {b: Prediction(b, prefill={i: 0 for i in ids}) for b in BALANCERS}
    out["pooled_ceiling"].prefill = {}
    out["chash_bounded"].approximate = True
    load = {i: 0 for i in ids}
    total = 0
    ends: list[tuple[float, int, str, int]] = []
    seq = -1
    for r in reqs:
        if log:
            if not r.reached_engine:
                if on_request:
                    on_request()
                continue
            seq += 1
            nt = max(1, r.input_tokens)
            hashes = [bytes.fromhex(b) for b in r.blocks]
            point, shared = r.point, False
        else:
            seq += 1
            messages = r.chat()
            tokens = tokenize_chat(messages)
            nt = len(tokens)
            hashes = PrefixCache.block_hashes(tokens, cfg.block_size)
            key, _kind, shared = route_key(messages, affinity=cfg.affinity, prefix_chars=cfg.prefix_chars,
                                           session=r.session, user=r.user, fallback=cfg.fallback_route_key)
            point = key_point(key) if key else None
        # round robin
        node = ids[seq % n]
        h = _serve(caches["round_robin"][node], hashes, nt)
        _account(out["round_robin"], node, h, nt)
        # chash (an empty key: round robin, as the gateway does)
        node = ring.home(point) if point is not None else ids[seq % n]
        h = _serve(caches["chash"][node], hashes, nt)
        _account(out["chash"], node, h, nt)
        # chash_bounded
        while ends and ends[0][0] <= r.timestamp_s:
            _, _, done_node, cost = heapq.heappop(ends)
            load[done_node] -= cost
            total -= cost
        cost = nt if log else -(-_body_bytes(cfg, r, messages) // BYTES_PER_TOKEN)
        c = 1.0 if shared else cfg.bound_factor
        if point is None:
            node = ids[seq % n]
        else:
            walk = list(ring.walk(point))
            node = next((x for x in walk if load[x] < c * (total + cost) * weight[x] / W), walk[0])
            if node != walk[0]:
                out["chash_bounded"].spills += 1
        h = _serve(caches["chash_bounded"][node], hashes, nt)
        _account(out["chash_bounded"], node, h, nt)
        service = cfg.prefill_s_per_token * (nt - h) + cfg.decode_s_per_token * max(1, r.output_tokens)
        heapq.heappush(ends, (r.timestamp_s + service, seq, node, cost))
        load[node] += cost
        total += cost
        # the pooled ceiling
        h = _serve(pooled, hashes, nt)
        out["pooled_ceiling"].hits += h
        out["pooled_ceiling"].queries += nt
        if on_request:
            on_request()
    return out


def _account(p: Prediction, node: str, hit: int, n_tokens: int) -> None:
    p.hits += hit
    p.queries += n_tokens
    p.prefill[node] += n_tokens - hit
