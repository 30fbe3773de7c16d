"""The simulator's ``POST /v1/embeddings`` (issue 14): OpenAI's shape through the openai SDK,
deterministic unit vectors, the prefill cost and vLLM's counters."""

from __future__ import annotations

import base64
import math
import struct
import time

import openai
import requests

from .conftest import MODEL, scrape


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)


def test_openai_sdk_shape_and_determinism(sim):
    r = client(sim).embeddings.create(model=MODEL, input=["the rhine", "the danube"])
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1]
    a, b = (d.embedding for d in r.data)
    # (the SDK asks for base64: float32 precision)
    assert len(a) == 384 and math.isclose(math.fsum(x * x for x in a), 1.0, rel_tol=1e-6)
    assert abs(math.fsum(x * y for x, y in zip(a, b))) < 0.3  # different inputs: nearly orthogonal
    again = client(sim).embeddings.create(model=MODEL, input="the rhine")
    assert again.data[0].embedding == a
    assert r.usage.prompt_tokens == r.usage.total_tokens == 4


def test_base64_dimensions_and_token_ids(sim):
    r = requests.post(sim.url + "/v1/embeddings", timeout=5,
                      json={"model": MODEL, "input": [[1, 2, 3]], "dimensions": 16, "encoding_format": "base64"}).json()
    vec = struct.unpack("<16f", base64.b64decode(r["data"][0]["embedding"]))
    assert math.isclose(math.fsum(x * x for x in vec), 1.0, rel_tol=1e-5)
    assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert list(r) == ["id", "object", "created", "model", "data", "usage"]  # usage last, as vLLM's


def test_errors_in_openais_format(sim):
    for body, param in (({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": "x", "dimensions": 0},
                        "dimensions"), ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        r = requests.post(sim.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    r = requests.post(sim.url + "/v1/embeddings", json={"model": "other", "input": "x"}, timeout=5)
    assert r.status_code == 404


def test_prefill_cost_and_vllm_counters(start_sim):
    sim = start_sim(prefill_s_per_token=0.002, time_scale=1.0)
    before = scrape(sim.url)
    text = " ".join(f"w{i}" for i in range(200))
    t0 = time.monotonic()
    r = requests.post(sim.url + "/v1/embeddings", json={"model": MODEL, "input": text}, timeout=10).json()
    took = time.monotonic() - t0
    n = r["usage"]["prompt_tokens"]
    assert n == 200 and took >= n * 0.002 * 0.9
    after = scrape(sim.url)
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == n
    key = 'vllm:request_success_total{finished_reason=stop}'
    assert after[key] - before.get(key, 0) == 1
    assert after["vllm:generation_tokens_total"] == before.get("vllm:generation_tokens_total", 0)
