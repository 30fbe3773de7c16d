"""Requests in flight per node (``kvgate_upstream_inflight``, read by the control plane's
drain), and streams whose node fails while they are in flight: the client gets an SSE
error event (OpenAI's streaming error shape), never a silently truncated answer."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import openai
import pytest
import requests

from gwfixtures import MODEL, Gateway, _wait, free_port

GAUGE = "kvgate_upstream_inflight"


def _gauge(gw: Gateway) -> dict[str, float]:
    """node → in-flight count, from one /metrics scrape (prometheus_client parses it)."""
    out: dict[str, float] = {}
    for key, value in gw.metrics().items():
        if key.startswith(GAUGE + "{"):
            node = key.split('node="', 1)[1].split('"', 1)[0]
            out[node] = out.get(node, 0.0) + value
    return out


def _stream(gw: Gateway, content: str, *, headers: dict | None = None, timeout: float = 30,
            **params) -> requests.Response:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": content}], **params}
    return requests.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}, stream=True,
                         timeout=timeout)


def _events(raw: bytes) -> list[str]:
    """The data of each SSE event (events end with a blank line)."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [ln[5:].lstrip().decode() for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if lines:
            out.append("\n".join(lines))
    return out


def _read_all(resp: requests.Response, after_first=None) -> bytes:
    """Everything the client received, also when the connection was cut; ``after_first()``
    runs once the first piece arrived."""
    got = bytearray()
    try:
        for chunk in resp.raw.stream(1024, decode_content=False):
            got += chunk
            if after_first is not None:
                after_first()
                after_first = None
    except Exception:  # a cut chunked body raises; what arrived is what counts
        pass
    return bytes(got)


# --------------------------------------------------------------------------- in-flight gauge
def test_inflight_gauge_counts_streams_across_a_reload(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(2, prefix="f")
    redis = start_redis()
    # old workers must be allowed to finish their streams after the reload
    gw = start_gateway(sims, redis, gateway={"worker_shutdown_timeout_s": 60})
    session = "drain-me"
    n = 5
    results: list[list[str] | Exception] = [None] * n  # type: ignore[list-item]

    def run(i: int) -> None:
        try:
            with _stream(gw, f"long story {i}", headers={"X-Session-Id": session}, max_tokens=400) as r:
                assert r.status_code == 200
                results[i] = _events(_read_all(r))
        except Exception as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: max(_gauge(gw).values(), default=0) == n, 20, f"{n} streams in flight")
        gauge = _gauge(gw)
        node = max(gauge, key=lambda k: gauge[k])
        # every node of the config is listed, the idle one with 0
        assert set(gauge) == {s.node_id for s in sims}, gauge
        assert sorted(gauge.values()) == [0, n], gauge
        text = requests.get(gw.url + "/metrics", timeout=5).text
        assert f"# TYPE {GAUGE} gauge" in text

        # a balancer switch alone is pushed (no reload); the read timeout is static: a reload
        reloaded = gw.policy.with_balancer("round_robin")
        reloaded = reloaded.model_copy(update={"gateway": reloaded.gateway.model_copy(update={"read_timeout_s": 31})})
        assert gw.nginx.apply(reloaded) == "reloaded"
        done_before = sum(not t.is_alive() for t in threads)
        after_reload = _gauge(gw)
        done_after = sum(not t.is_alive() for t in threads)
        if done_before == done_after == 0:
            # the old workers still hold all streams: the shared dict kept their count
            assert after_reload[node] == n, after_reload
    finally:
        for t in threads:
            t.join(60)
    for r in results:
        assert isinstance(r, list) and r[-1] == "[DONE]", r
    # the old workers' log phases decremented the same counter
    _wait(lambda: _gauge(gw).get(node) == 0, 10, "the gauge back at 0")
    # their request-log entries were not lost with the exiting workers (handed over to the new ones)
    key = hashlib.sha256(f"s:{session}".encode()).hexdigest()[:16]
    client = redis.client()

    def logged() -> int:
        return sum(1 for _, f in client.xrange("kvgate:log") if f.get(b"key") == key.encode())

    _wait(lambda: logged() == n, 10, "the streams' request-log entries")


def test_inflight_gauge_after_client_abort(start_sims, start_gateway) -> None:
    sims = start_sims(1, prefix="a")
    gw = start_gateway(sims, None)
    with _stream(gw, "abort me", max_tokens=400) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep the generator: dropping it closes the connection
        next(lines)
        _wait(lambda: _gauge(gw).get(sims[0].node_id) == 1, 10, "one stream in flight")
    # closed by the client mid-stream: the log phase still runs and undoes the +1
    _wait(lambda: _gauge(gw).get(sims[0].node_id) == 0, 10, "the gauge back at 0")
    assert gw.metric_sum("kvgate_stream_errors_total") == 0


# --------------------------------------------------------------------------- mid-stream failures
def test_killed_node_mid_stream_raises_api_error_in_openai_client(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(1, prefix="k")
    redis = start_redis()
    gw = start_gateway(sims, redis)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    # deterministic and with usage: a complete stream would be cached
    stream = client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=500, temperature=0, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "tell a long story"}])
    chunks = 0
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            chunks += 1
            if chunks == 10:
                sims[0].proc.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    err = info.value
    # not the transport's "Connection error." (APIConnectionError): the gateway's error event
    assert not isinstance(err, openai.APIConnectionError), repr(err)
    assert err.code == "upstream_failed", err.body
    assert err.type == "server_error"
    assert err.message == f"node {sims[0].node_id} failed mid-stream; the response is incomplete"
    assert elapsed < 15  # a generous bound: in practice well under a second
    _wait(lambda: gw.metric_sum("kvgate_stream_errors_total", pool="default", node=sims[0].node_id) == 1,
          5, "the stream error counted")
    _wait(lambda: _gauge(gw).get(sims[0].node_id) == 0, 10, "the gauge back at 0")
    time.sleep(0.5)  # a store would be written from a 0-delay timer
    assert list(redis.client().scan_iter("kvgate:resp:*")) == []


def test_node_timing_out_mid_stream_ends_with_error_event(start_sims, start_gateway) -> None:
    sims = start_sims(1, prefix="t")
    gw = start_gateway(sims, None, gateway={"read_timeout_s": 1})
    try:
        with _stream(gw, "then stall", max_tokens=400) as r:
            assert r.status_code == 200
            # alive but silent after the first piece: proxy_read_timeout fires
            raw = _read_all(r, lambda: sims[0].proc.send_signal(signal.SIGSTOP))
    finally:
        sims[0].proc.send_signal(signal.SIGCONT)
    events = _events(raw)
    assert events, raw[-300:]
    last = json.loads(events[-1])
    assert last["error"]["code"] == "upstream_failed", events[-1]
    for data in events[:-1]:  # everything before it is a whole, valid chunk
        assert "error" not in json.loads(data)
    assert gw.metric_sum("kvgate_stream_errors_total", node=sims[0].node_id) == 1


def test_normal_streams_never_get_an_error_event(fleet_clean: Gateway) -> None:
    gw = fleet_clean
    before = gw.metric_sum("kvgate_stream_errors_total")

    def one(i: int) -> list[str]:
        usage = {"stream_options": {"include_usage": True}} if i % 2 else {}
        if i % 5 == 0:
            body = {"model": MODEL, "stream": True, "prompt": f"complete {i}", "max_tokens": 1 + i % 17, **usage}
            url = gw.url + "/v1/completions"
        else:
            body = {"model": MODEL, "stream": True, "max_tokens": 1 + i % 17, "temperature": 0.7,
                    "messages": [{"role": "user", "content": f"stream number {i}"}], **usage}
            url = gw.url + "/v1/chat/completions"
        with requests.post(url, json=body, stream=True, timeout=30) as r:
            assert r.status_code == 200, r.text
            return _events(r.content)

    with ThreadPoolExecutor(8) as ex:
        streams = list(ex.map(one, range(50)))
    for events in streams:
        assert events[-1] == "[DONE]", events
        for data in events[:-1]:
            assert "error" not in json.loads(data), data
    assert gw.metric_sum("kvgate_stream_errors_total") == before


# --------------------------------------------------------------------------- a node cut inside an event
@dataclass
class _Backend:
    node_id: str
    url: str


EVENT = b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'


@pytest.fixture
def cut_node() -> Iterator[_Backend]:
    """A node that streams one event in two pieces, then half of a second one, then dies."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", free_port()))
    srv.listen(8)
    stop = threading.Event()

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, body = buf.split(b"\r\n\r\n", 1)
                length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                                  if ln.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for piece in (EVENT[:40], EVENT[40:], EVENT[:50]):
                    conn.sendall(chunk(piece))
                    time.sleep(0.2)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield _Backend("cut", f"http://127.0.0.1:{srv.getsockname()[1]}")
    stop.set()
    srv.close()


def test_node_dying_inside_an_event_sends_whole_events_then_the_error(start_gateway, cut_node) -> None:
    gw = start_gateway([cut_node], None)
    with _stream(gw, "hello") as r:
        assert r.status_code == 200
        raw = _read_all(r)
    # the half event is not passed on: the client gets one whole event, then the error
    assert raw.startswith(EVENT), raw
    events = _events(raw)
    assert len(events) == 2, raw
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hi"
    assert json.loads(events[1])["error"]["message"] == "node cut failed mid-stream; the response is incomplete"
