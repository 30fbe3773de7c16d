"""Fixtures for the engine-simulator tests: real simulators on free ports, in-process threads."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvgate.policy.model import SimulatorConfig
from kvgate.sim.server import SimServerThread

MODEL = "test-model"


def make_config(**overrides) -> SimulatorConfig:
    """Fast defaults for tests: 2 ms per decoded token, 10 µs per prefilled token."""
    base = dict(model=MODEL, time_scale=1.0, prefill_s_per_token=1e-5, decode_s_per_token=0.002,
                max_num_seqs=8, block_size=16, num_gpu_blocks=4096, stream_interval=1)
    base.update(overrides)
    return SimulatorConfig(**base)


@pytest.fixture
def start_sim() -> Iterator[Callable[..., SimServerThread]]:
    """``start_sim(node_id="sim", **config_overrides)`` → a running simulator, stopped after the test."""
    started: list[SimServerThread] = []

    def start(node_id: str = "sim", app_options: dict | None = None, **overrides) -> SimServerThread:
        sim = SimServerThread(make_config(**overrides), node_id, **(app_options or {})).start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def sim(start_sim) -> SimServerThread:
    """One simulator with the fast test defaults."""
    return start_sim()


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` of a simulator as ``{sample name + sorted labels: value}``, via prometheus_client's parser.

    Keys look like ``vllm:prefix_cache_hits_total`` when the only labels are model_name/engine,
    else ``name{label=value,...}`` with the extra labels.
    """
    text = requests.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
            out[key] = s.value
    return out
