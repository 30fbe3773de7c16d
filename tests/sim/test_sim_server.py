"""The simulator over real HTTP: the openai SDK, SSE streaming, prefix caching, metrics, queueing."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL, scrape

LONG_SYSTEM = " ".join(f"policy{i}" for i in range(300))


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)


def chat(sim, content: str = "hello there", **kwargs):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": content}]
    kwargs.setdefault("max_tokens", 8)
    return client(sim).chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_chat_non_streaming_openai_sdk(sim):
    raw = client(sim).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert raw.headers["X-Kvgate-Sim-Node"] == "sim"
    resp = raw.parse()
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.message.content.split()) == 5
    u = resp.usage
    # "<|im_start|>user", "hi<|im_end|>", "<|im_start|>assistant"
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (3, 5, 8)
    assert u.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_chunks_arrive_incrementally(start_sim):
    step = 0.1  # 5 decode steps after the first token: a modelled span of 0.5 s
    sim = start_sim(decode_s_per_token=step)
    stream = chat(sim, max_tokens=6, temperature=0, stream=True)
    chunks, arrivals = [], []
    for chunk in stream:
        chunks.append(chunk)
        arrivals.append(time.monotonic())
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = chunks[1:]
    assert len(content) == 6 and all(c.choices[0].delta.content for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 5 + ["length"]
    # the stream is spread over the decode steps, not one burst at the end. Only a lower
    # bound, and half of the modelled span: a loaded box delays chunks, it never hurries them
    # (the client reading token 1 late is the only way to shrink the span).
    assert arrivals[-1] - arrivals[1] >= 0.5 * 5 * step
    text = "".join(c.choices[0].delta.content for c in content)
    assert text == chat(sim, max_tokens=6, temperature=0).choices[0].message.content


def test_stream_interval_groups_tokens(start_sim):
    sim = start_sim(stream_interval=4)
    chunks = list(chat(sim, max_tokens=9, stream=True))
    sizes = [len(c.choices[0].delta.content.split()) for c in chunks[1:]]
    assert sizes == [1, 4, 4]


def test_include_usage_chunk(sim):
    chat(sim, max_tokens=4)  # warm the cache
    chunks = list(chat(sim, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_repeated_prompt_hits_prefix_cache_and_metrics(sim):
    before = scrape(sim.url)
    first = chat(sim).usage
    second = chat(sim).usage
    assert first.prompt_tokens == second.prompt_tokens > 300
    n = first.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    after = scrape(sim.url)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert hits == second.prompt_tokens_details.cached_tokens and queries == 2 * n
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * n
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 16
    # busy time: two requests one after the other, each at least its decode time (7 steps of 2 ms)
    busy = after["kvgate_sim_busy_seconds_total"] - before["kvgate_sim_busy_seconds_total"]
    assert 2 * 7 * 0.002 <= busy < 5.0
    # a later turn of the same conversation reuses the shared prefix
    third = chat(sim, content="hello there, different question").usage
    assert third.prompt_tokens_details.cached_tokens == 303 // 16 * 16  # tokens before "there,"


def test_reset_prefix_cache(sim):
    chat(sim)
    assert chat(sim).usage.prompt_tokens_details.cached_tokens > 0
    r = requests.post(sim.url + "/reset_prefix_cache", timeout=5)
    assert r.status_code == 200
    before = scrape(sim.url)["vllm:prefix_cache_hits_total"]
    assert chat(sim).usage.prompt_tokens_details.cached_tokens == 0
    assert scrape(sim.url)["vllm:prefix_cache_hits_total"] == before


def test_determinism_and_unique_ids(sim):
    a, b = chat(sim, temperature=0, max_tokens=20), chat(sim, temperature=0, max_tokens=20)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.id != b.id
    s1, s2 = chat(sim, temperature=0.8, seed=7, max_tokens=20), chat(sim, temperature=0.8, seed=7, max_tokens=20)
    assert s1.choices[0].message.content == s2.choices[0].message.content
    assert s1.choices[0].message.content != a.choices[0].message.content
    r1, r2 = chat(sim, temperature=1.0, max_tokens=20), chat(sim, temperature=1.0, max_tokens=20)
    assert r1.choices[0].message.content != r2.choices[0].message.content
    other = chat(sim, content="another prompt", temperature=0, max_tokens=20)
    assert other.choices[0].message.content != a.choices[0].message.content


def test_max_completion_tokens_and_default(sim):
    assert chat(sim, max_tokens=None, max_completion_tokens=3).usage.completion_tokens == 3
    assert chat(sim, max_tokens=None).usage.completion_tokens == 64


def test_errors_are_openai_shaped(sim):
    with pytest.raises(openai.NotFoundError) as e:
        client(sim).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    body = requests.post(sim.url + "/v1/chat/completions", timeout=5,
                         json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}).json()
    assert body == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}

    r = requests.post(sim.url + "/v1/chat/completions", data=b'{"model": ', timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert r.headers["X-Kvgate-Sim-Node"] == "sim"

    with pytest.raises(openai.BadRequestError):
        chat(sim, n=2)
    with pytest.raises(openai.BadRequestError):
        client(sim).chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        chat(sim, max_tokens=200_000)
    assert "maximum context length" in str(e.value)


def test_completions_endpoint(sim):
    c = client(sim)
    r = c.completions.create(model=MODEL, prompt="one two three", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices[0].text.split()) == 4 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 3
    assert c.completions.create(model=MODEL, prompt=["one two", "three"], max_tokens=1).usage.prompt_tokens == 3
    assert c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=1).usage.prompt_tokens == 4
    chunks = list(c.completions.create(model=MODEL, prompt="one two three", max_tokens=4, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="", max_tokens=1)


def test_info_endpoints(sim):
    h = requests.get(sim.url + "/health", timeout=5)
    assert h.status_code == 200 and h.content == b"" and h.headers["X-Kvgate-Sim-Node"] == "sim"
    assert requests.get(sim.url + "/health_generate", timeout=5).status_code == 200
    models = client(sim).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "vllm"
    raw = requests.get(sim.url + "/v1/models", timeout=5).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 131072
    for path in ("/model_info", "/get_model_info"):
        assert requests.get(sim.url + path, timeout=5).json() == {
            "model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(sim.url + path, timeout=5).json()
        assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert requests.get(sim.url + "/nope", timeout=5).json()["error"]["code"] == 404


EXPECTED_SAMPLES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:cache_config_info",
    "process_start_time_seconds",  # prometheus_client's process collector in real vLLM; the engine's creation time
    "kvgate_sim_busy_seconds_total",  # the simulator's own: modelled busy seconds (the bill demo's engine time)
} | {f"{h}_{s}" for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                          "vllm:request_queue_time_seconds") for s in ("bucket", "count", "sum")}


def test_metrics_exact_vllm_names(sim):
    chat(sim, max_tokens=2)
    r = requests.get(sim.url + "/metrics", timeout=5)
    assert r.headers["Content-Type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    names = {s.name for f in families for s in f.samples}
    assert names == EXPECTED_SAMPLES
    types = {f.name: f.type for f in families}
    assert types["vllm:prefix_cache_hits"] == "counter" and types["vllm:num_requests_waiting"] == "gauge"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    labels = {tuple(sorted(s.labels)) for f in families for s in f.samples if s.name == "vllm:num_requests_running"}
    assert labels == {("engine", "model_name")}
    m = scrape(sim.url)
    assert m["vllm:request_success_total{finished_reason=length}"] == 1
    assert m["vllm:request_success_total{finished_reason=stop}"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:e2e_request_latency_seconds_count"] == 1
    ttft_les = [s.labels["le"] for f in families for s in f.samples
                if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert ttft_les[:3] == ["0.001", "0.005", "0.01"] and ttft_les[-1] == "+Inf"


def test_two_apps_in_one_process_have_separate_metrics(start_sim):
    a, b = start_sim("a"), start_sim("b")
    chat(a, max_tokens=2)
    assert scrape(a.url)["vllm:prompt_tokens_total"] > 0
    assert scrape(b.url)["vllm:prompt_tokens_total"] == 0
    assert requests.get(b.url + "/health", timeout=5).headers["X-Kvgate-Sim-Node"] == "b"


def _wait_until(pred, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` (generous: the box may be loaded) runs out."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def test_max_num_seqs_queues_second_request(start_sim):
    step, n = 0.05, 30  # the first request decodes for (n - 1) × step ≈ 1.45 s after its first token
    sim = start_sim(max_num_seqs=1, decode_s_per_token=step)
    done: dict[str, bool] = {}

    def run(name: str, max_tokens: int) -> None:
        content = "".join(c.choices[0].delta.content or "" for c in
                          chat(sim, content=name, max_tokens=max_tokens, stream=True) if c.choices)
        done[name] = len(content.split()) == max_tokens

    t_start = time.monotonic()
    first = threading.Thread(target=run, args=("first", n))
    first.start()
    assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_running"] >= 1)
    second = threading.Thread(target=run, args=("second", 2))
    second.start()
    seen_waiting, max_running, t_seen = 0.0, 0.0, None
    while first.is_alive():
        m = scrape(sim.url)
        max_running = max(max_running, m["vllm:num_requests_running"])
        if m["vllm:num_requests_waiting"] >= 1 and t_seen is None:
            t_seen = time.monotonic()
        seen_waiting = max(seen_waiting, m["vllm:num_requests_waiting"])
        time.sleep(0.01)
    first.join(30)
    second.join(30)
    assert done == {"first": True, "second": True}
    assert seen_waiting == 1 and max_running == 1
    m = scrape(sim.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:request_queue_time_seconds_count"] == 2
    assert m["vllm:request_success_total{finished_reason=length}"] == 2
    # The second request was queued (arrived ≤ t_seen) until the first finished, which was no
    # earlier than t_start + (n - 1) × step (the sim shares this process's monotonic clock).
    # A causal bound, so load cannot break it; it only gets looser if the poll saw the queue late.
    assert m["vllm:request_queue_time_seconds_sum"] > 0
    assert m["vllm:request_queue_time_seconds_sum"] >= t_start + (n - 1) * step - t_seen - 0.01


def test_kv_usage_while_running_and_client_disconnect_frees(start_sim):
    sim = start_sim(decode_s_per_token=0.05, num_gpu_blocks=64)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "x"}]
    with requests.post(sim.url + "/v1/chat/completions", stream=True, timeout=5,
                       json={"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len(b"data: "):])["choices"][0]["delta"]["role"] == "assistant"
        m = scrape(sim.url)
        assert m["vllm:num_requests_running"] == 1
        assert m["vllm:kv_cache_usage_perc"] == pytest.approx(19 / 64)  # 304-ish prompt tokens → 19 full blocks
    # the client went away after one chunk; the engine must free the slot and the blocks
    assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_running"] == 0)
    m = scrape(sim.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total{finished_reason=length}"] == 0
    # the blocks stay cached and the server still works
    assert chat(sim, content="x", max_tokens=2).usage.prompt_tokens_details.cached_tokens > 0


def test_client_leaving_the_queue_frees_its_place(start_sim):
    # the running request lasts ≈ 1.5 s: time for the queued client to arrive and leave, even on a loaded box
    sim = start_sim(max_num_seqs=1, decode_s_per_token=0.02)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 75, "stream": True}
    with requests.post(sim.url + "/v1/chat/completions", json=body, stream=True, timeout=10) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
        next(line for line in lines if line)
        # headers come back at once (like vLLM), so a queued client can give up before its first token
        with requests.post(sim.url + "/v1/chat/completions", json=dict(body, max_tokens=1), stream=True,
                           timeout=10):
            assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_waiting"] >= 1)
            assert scrape(sim.url)["vllm:num_requests_waiting"] == 1
        assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_waiting"] == 0)
        assert [line for line in lines if line][-1] == b"data: [DONE]"
    # the slot was not handed to the departed client: a new request runs at once
    assert chat(sim, max_tokens=1).usage.completion_tokens == 1
    assert scrape(sim.url)["vllm:num_requests_running"] == 0


def _open_stream(sim, content: str, max_tokens: int) -> socket.socket:
    """A raw streaming chat request (a raw socket: the test decides exactly when it goes away)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": True}).encode()
    s = socket.create_connection((sim.host, sim.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        data = s.recv(65536)
        assert data, buf
        buf += data
    return buf


def test_queued_clients_disconnecting_as_the_slot_frees(start_sim, caplog):
    """Clients that give up while queued, in the same loop turn as the running one finishes.

    Regression: a queued handler's future was cancelled, the finishing request's ``_leave``
    popped (and skipped) it before the handler resumed, and the handler's own removal then
    raised ``ValueError`` instead of ``CancelledError`` ("Error handling request" in aiohttp).
    Closing the running connection first and the queued ones right after puts their
    cancellations in one batch of the server loop, which hit that order nearly every round.
    """
    caplog.set_level(logging.WARNING)
    sim = start_sim(max_num_seqs=1, decode_s_per_token=0.05)
    queued_per_round = 6
    for rnd in range(4):
        running = _open_stream(sim, f"running {rnd}", 1000)
        _read_until(running, b"data: ")  # admitted and streaming
        queued = [_open_stream(sim, f"queued {rnd} {i}", 2) for i in range(queued_per_round)]
        for q in queued:
            _read_until(q, b"\r\n\r\n")  # headers come before admission
        assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_waiting"] >= queued_per_round)
        for s in [running, *queued]:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset at once
            s.close()
        assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_waiting"] == 0)
        assert _wait_until(lambda: scrape(sim.url)["vllm:num_requests_running"] == 0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()} {r.exc_info and r.exc_info[1]!r}" for r in errors]
    m = scrape(sim.url)
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    # nothing finished normally; whatever was admitted was aborted, and the slot is free again
    assert m["vllm:request_success_total{finished_reason=length}"] == 0
    assert chat(sim, max_tokens=1).usage.completion_tokens == 1
