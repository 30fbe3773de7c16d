"""Prices and usage accounting in the policy: what a pool's tokens cost, how long rollups live.

A pool is priced either per token (``input_usd_per_1m_tokens``, ``cached_input_usd_per_1m_tokens``,
``output_usd_per_1m_tokens``: what a hosted API bills) or per GPU-hour (``gpu_usd_per_hour`` ×
``gpus_per_node`` ÷ the node's sustained ``throughput_tokens_per_s``: the seed's cost mapping,
hourly price ÷ tokens per hour). Either way the gateway works with whole **nano-dollars per
token** (:meth:`PricesConfig.nano_usd_per_token`): at common prices a token costs less than a
micro-dollar ($0.15 per 1M tokens is 0.15 µ$), so per-request micro-dollars would not sum
exactly; with integer nano-dollars per token every cost is an integer and every sum is exact.
Prices therefore resolve to $0.001 per 1M tokens (docs/costs.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

NANO_PER_USD = 1_000_000_000
"""Nano-dollars per dollar: the unit of every money figure the gateway logs and the rollups sum."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenPrices(BaseModel):
    """Whole nano-dollars per token by kind (what :meth:`PricesConfig.nano_usd_per_token` returns)."""

    model_config = ConfigDict(frozen=True)

    input: int
    cached_input: int
    output: int


def _nano_per_token(usd_per_1m_tokens: float) -> int:
    # $/1M tokens → n$/token: × 1e9 / 1e6
    return round(usd_per_1m_tokens * 1000)


class PricesConfig(_Strict):
    """What a pool's tokens cost (docs/costs.md). Give token prices or a GPU price, not both."""

    input_usd_per_1m_tokens: float | None = Field(
        None, ge=0, le=10_000, description="$ per 1M uncached prompt tokens (the prefill the engine computed).")
    cached_input_usd_per_1m_tokens: float | None = Field(
        None, ge=0, le=10_000, description="$ per 1M prompt tokens served from the engine's prefix cache "
        "(`usage.prompt_tokens_details.cached_tokens`). Omitted with token prices: the input price (no discount).")
    output_usd_per_1m_tokens: float | None = Field(
        None, ge=0, le=10_000, description="$ per 1M completion tokens.")
    gpu_usd_per_hour: float | None = Field(
        None, gt=0, le=10_000, description="$ per GPU-hour (instead of token prices): per-token prices are this × "
        "`gpus_per_node` ÷ (`throughput_tokens_per_s` × 3600).")
    gpus_per_node: int = Field(1, ge=1, le=64, description="GPUs per node (GPU pricing).")
    throughput_tokens_per_s: float | None = Field(
        None, gt=0, description="GPU pricing: tokens per second (prompt + completion) one node sustains at full "
        "load, e.g. from a vLLM benchmark; the Costs page shows the engines' measured throughput beside it.")
    cached_input_factor: float = Field(
        0.1, ge=0, le=1, description="GPU pricing: a cached prompt token's cost as a share of an uncached one "
        "(its prefill is skipped; attention still reads its KV).")
    output_factor: float = Field(
        1.0, ge=0, le=100, description="GPU pricing: a completion token's cost relative to an uncached prompt token.")
    batch_discount: float = Field(
        0.0, ge=0, lt=1, description="Share of the price a Batch API request does not pay (0.5: half price); the "
        "discount is counted as the batch lever's saving.")

    @model_validator(mode="after")
    def _check_kind(self) -> "PricesConfig":
        tokens = [self.input_usd_per_1m_tokens, self.cached_input_usd_per_1m_tokens, self.output_usd_per_1m_tokens]
        if self.gpu_usd_per_hour is not None:
            if any(v is not None for v in tokens):
                raise ValueError("give token prices (input_usd_per_1m_tokens, ...) or gpu_usd_per_hour, not both")
            if self.throughput_tokens_per_s is None:
                raise ValueError("gpu_usd_per_hour needs throughput_tokens_per_s (tokens/s one node sustains)")
        else:
            if self.input_usd_per_1m_tokens is None or self.output_usd_per_1m_tokens is None:
                raise ValueError("token prices need input_usd_per_1m_tokens and output_usd_per_1m_tokens "
                                 "(or give gpu_usd_per_hour)")
            if self.cached_input_usd_per_1m_tokens is not None and \
                    self.cached_input_usd_per_1m_tokens > self.input_usd_per_1m_tokens:
                raise ValueError("cached_input_usd_per_1m_tokens must not exceed input_usd_per_1m_tokens")
        return self

    def usd_per_1m_tokens(self) -> tuple[float, float, float]:
        """(input, cached input, output) in $ per 1M tokens, derived for GPU pricing."""
        if self.gpu_usd_per_hour is not None:
            assert self.throughput_tokens_per_s is not None
            per_token = self.gpu_usd_per_hour * self.gpus_per_node / (self.throughput_tokens_per_s * 3600)
            base = per_token * 1e6
            return base, base * self.cached_input_factor, base * self.output_factor
        assert self.input_usd_per_1m_tokens is not None and self.output_usd_per_1m_tokens is not None
        cached = self.cached_input_usd_per_1m_tokens
        return (self.input_usd_per_1m_tokens, self.input_usd_per_1m_tokens if cached is None else cached,
                self.output_usd_per_1m_tokens)

    def nano_usd_per_token(self) -> TokenPrices:
        """Whole nano-dollars per token (input, cached input, output): what the gateway multiplies
        token counts by. Rounded to the nearest nano-dollar ($0.001 per 1M tokens)."""
        i, c, o = self.usd_per_1m_tokens()
        return TokenPrices(input=_nano_per_token(i), cached_input=_nano_per_token(c), output=_nano_per_token(o))


class UsageConfig(_Strict):
    """Usage records and cost rollups (docs/costs.md)."""

    retention_days: int = Field(
        35, ge=1, le=3660, description="Days the hourly rollups (tenant × model × pool × hour) are kept in Redis.")
    log_blocks: int = Field(
        64, ge=0, le=4096, description="The request log keeps the first this many block hashes of each prompt "
        "(chained hashes of `prefix_index.chunk_chars`-byte chunks, 16 hex digits each, never text), so "
        "`kvgate analyze` can replay the gateway's own traffic; 0: none.")
