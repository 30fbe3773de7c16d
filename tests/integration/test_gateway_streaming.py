"""Streaming through the gateway with the openai SDK: chunks arrive as they are generated."""

from __future__ import annotations

import time

import openai

from gwfixtures import MODEL, SIM_ARGS, Gateway

# the simulators' modelled decode time per output token (decode_s_per_token × time_scale)
DECODE_S = (float(SIM_ARGS[SIM_ARGS.index("--decode-s-per-token") + 1])
            * float(SIM_ARGS[SIM_ARGS.index("--time-scale") + 1]))


def test_openai_sdk_stream_is_incremental(fleet_clean: Gateway) -> None:
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    tokens = 60
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=tokens, stream=True, temperature=0.8,
        messages=[{"role": "user", "content": "Count slowly."}],
    )
    arrivals, text = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
            text.append(chunk.choices[0].delta.content)
    # The engine needs ~tokens × DECODE_S (0.6 s) to generate. Streamed through, the
    # first chunk arrives that long before the last; released in one burst at the end,
    # they would arrive together. Load only slows decoding, which widens the span, so
    # a lower bound of half the modelled time is robust on a busy machine.
    modelled = (tokens - 1) * DECODE_S
    assert len(arrivals) >= tokens // 2, arrivals
    assert arrivals[-1] - arrivals[0] >= 0.5 * modelled, (modelled, arrivals)
    # and they spread over the span: the middle chunk is not bunched with the last one
    middle = arrivals[len(arrivals) // 2]
    assert arrivals[-1] - middle >= 0.2 * modelled, (modelled, arrivals)


def test_openai_sdk_non_streaming_and_completions(fleet_clean: Gateway) -> None:
    client = openai.OpenAI(base_url=fleet_clean.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in comp if c.choices)
    assert [m.id for m in client.models.list()] == [MODEL]
