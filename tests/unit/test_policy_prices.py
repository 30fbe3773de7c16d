"""Prices in the policy (control/kvgate/policy/pricing.py): validation at the field's path and
the nano-dollar conversion every cost is built on."""

from __future__ import annotations

import pytest

from kvgate.policy.loader import PolicyError, parse_policy_text
from kvgate.policy.pricing import PricesConfig

BASE = """
pools:
  - name: p
    models: [m]
    nodes: [{id: n1, url: "http://127.0.0.1:8101"}]
    prices: %s
"""


def test_token_prices_become_whole_nano_dollars_per_token():
    p = PricesConfig(input_usd_per_1m_tokens=0.15, cached_input_usd_per_1m_tokens=0.075,
                     output_usd_per_1m_tokens=0.6)
    t = p.nano_usd_per_token()
    # $0.15 per 1M tokens = 0.15 µ$ per token = 150 n$
    assert (t.input, t.cached_input, t.output) == (150, 75, 600)


def test_cached_price_defaults_to_the_input_price():
    t = PricesConfig(input_usd_per_1m_tokens=2, output_usd_per_1m_tokens=8).nano_usd_per_token()
    assert t.cached_input == t.input == 2000


def test_gpu_price_is_hourly_price_over_tokens_per_hour():
    # $3.60 per GPU-hour, 2 GPUs, 1,000 tokens/s: $7.20 / 3.6M tokens = $2 per 1M tokens
    t = PricesConfig(gpu_usd_per_hour=3.6, gpus_per_node=2, throughput_tokens_per_s=1000,
                     cached_input_factor=0.25, output_factor=2).nano_usd_per_token()
    assert (t.input, t.cached_input, t.output) == (2000, 500, 4000)


@pytest.mark.parametrize("prices, path, words", [
    ("{input_usd_per_1m_tokens: 1}", "pools[0].prices", "output_usd_per_1m_tokens"),
    ("{input_usd_per_1m_tokens: 1, output_usd_per_1m_tokens: 1, gpu_usd_per_hour: 2}", "pools[0].prices", "not both"),
    ("{gpu_usd_per_hour: 2}", "pools[0].prices", "throughput_tokens_per_s"),
    ("{input_usd_per_1m_tokens: -1, output_usd_per_1m_tokens: 1}", "pools[0].prices.input_usd_per_1m_tokens", ""),
    ("{input_usd_per_1m_tokens: 1, cached_input_usd_per_1m_tokens: 2, output_usd_per_1m_tokens: 1}",
     "pools[0].prices", "must not exceed"),
    ("{input_usd_per_1m_tokens: 1, output_usd_per_1m_tokens: 1, batch_discount: 1}",
     "pools[0].prices.batch_discount", ""),
    ("{input_usd_per_1m_tokens: 1, output_usd_per_1m_tokens: 1, input_usd_per_1M: 1}",
     "pools[0].prices.input_usd_per_1M", ""),
])
def test_bad_prices_are_rejected_at_the_fields_path(prices, path, words):
    with pytest.raises(PolicyError) as e:
        parse_policy_text(BASE % prices)
    text = str(e.value)
    assert path in text, text
    assert words in text, text


def test_prices_are_optional():
    policy = parse_policy_text(BASE % "null")
    assert policy.pools[0].prices is None
    assert policy.usage.retention_days == 35
