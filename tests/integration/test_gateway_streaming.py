"""Streaming through the gateway with the openai SDK: chunks arrive as they are generated."""

from __future__ import annotations

import time

import openai

from gwfixtures import MODEL, Gateway


def test_openai_sdk_stream_is_incremental(fleet_clean: Gateway) -> None:
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=30, stream=True, temperature=0.8,
        messages=[{"role": "user", "content": "Count slowly."}],
    )
    arrivals, text = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
            text.append(chunk.choices[0].delta.content)
    # 30 tokens at ~10 ms each: the chunks spread over the generation, they are not
    # released in one burst at the end
    assert len(arrivals) >= 20
    assert arrivals[-1] - arrivals[0] > 0.15, arrivals
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(1 for g in gaps if g > 0.003) >= len(gaps) // 2, gaps


def test_openai_sdk_non_streaming_and_completions(fleet_clean: Gateway) -> None:
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in comp if c.choices)
    assert [m.id for m in client.models.list()] == [MODEL]
