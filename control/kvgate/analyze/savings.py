"""The predicted saving per lever at the policy's prices, in integer nano-dollars (n$).

Prices: the pool's ``prices`` (:meth:`kvgate.policy.pricing.PricesConfig.nano_usd_per_token`:
input, cached_input, output in n$ per token). Each lever against its baseline (docs/costs.md):

* ``full_price``: every request at the full price, Σ prompt × input + completion × output
  (on the log: the entries an engine or the response cache answered; one refused before a
  node cost nothing).
* ``cache`` (response cache): each exact repeat saves its full price. Identifiable on chat
  requests (equal bodies: the later ones are repeats) and on the gateway's log (its ``HIT``
  entries, measured); a Mooncake trace does not say which requests are exact repeats
  (``identifiable`` false, 0).
* ``prefix`` per balancer: predicted cached tokens × (input − cached_input).
* ``affinity``: ``prefix[chash_bounded] − prefix[round_robin]`` (what routing adds over the
  round-robin baseline; may be negative).
* ``batch``: requests the workload marks as batch (the log's ``batch``) × ``batch_discount``
  of their full price (floor); 0 when it marks none.
"""

from __future__ import annotations

from typing import Sequence

from .predict import Prediction
from .workload import Request

NANO_PER_USD = 1_000_000_000


def predicted_savings(reqs: Sequence[Request], pred: dict[str, Prediction], prices) -> dict:
    """The ``savings`` object of ``--json``: n$ integers (``*_nusd``) and dollars (``*_usd``);
    ``prices`` a PricesConfig or None (then ``priced`` false and no figures)."""
    if prices is None:
        return {"priced": False, "note": "the policy's pool has no prices (pools[].prices)"}
    p = prices.nano_usd_per_token()
    full = sum(r.input_tokens * p.input + r.output_tokens * p.output for r in reqs
               if r.reached_engine or r.cache_hit)
    source = reqs[0].source if reqs else "trace"
    cache_note = ""
    if source == "log":
        cache, identifiable, repeats = 0, True, 0
        for r in reqs:
            if r.cache_hit:
                repeats += 1
                cache += r.input_tokens * p.input + r.output_tokens * p.output
        cache_note = "measured: the log's response-cache HITs"
    elif source == "requests":
        seen: set = set()
        cache, identifiable, repeats = 0, True, 0
        for r in reqs:
            if r.identity in seen:
                repeats += 1
                cache += r.input_tokens * p.input + r.output_tokens * p.output
            seen.add(r.identity)
        cache_note = "exact repeats (equal request bodies) after the first; only deterministic requests are cacheable"
    else:
        cache, identifiable, repeats = 0, False, 0
        cache_note = "a Mooncake trace does not identify exact-repeat requests"
    prefix = {b: v.hits * (p.input - p.cached_input) for b, v in pred.items()}
    batch_reqs = [r for r in reqs if r.batch]
    batch = sum(int((r.input_tokens * p.input + r.output_tokens * p.output) * prices.batch_discount)
                for r in batch_reqs)
    nusd = {"full_price": full, "cache": cache, "prefix": prefix,
            "affinity": prefix.get("chash_bounded", 0) - prefix.get("round_robin", 0), "batch": batch}
    usd = {k: ({b: x / NANO_PER_USD for b, x in v.items()} if isinstance(v, dict) else v / NANO_PER_USD)
           for k, v in nusd.items()}
    return {"priced": True, "prices_nusd_per_token": p.model_dump(), "nusd": nusd, "usd": usd,
            "cache_identifiable": identifiable, "cache_repeats": repeats, "cache_note": cache_note,
            "batch_requests": len(batch_reqs),
            "batch_note": "" if batch_reqs else "the workload marks no batch requests"}
