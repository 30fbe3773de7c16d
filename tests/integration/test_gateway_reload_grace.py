"""Streams that outlive a reload's grace (gateway.worker_shutdown_timeout_s) end with an error
event and a proper end of body, never an unterminated chunked body (issue 9, item 7)."""

from __future__ import annotations

import json
import os
import signal
import time

import requests

from gwfixtures import MODEL, Gateway
from mockengine import MockEngine

# read timeout 1 s, grace 3 s: a stream still sending 1 s after the reload is ended
GRACE = {"read_timeout_s": 1, "worker_shutdown_timeout_s": 3}


def _open_stream(gw: Gateway) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "stream": True,
            "temperature": 0.7}
    r = requests.post(gw.url + "/v1/chat/completions", json=body, stream=True, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _reload(gw: Gateway) -> float:
    pid = gw.nginx.pid()
    assert pid
    os.kill(pid, signal.SIGHUP)
    return time.monotonic()


def test_a_stream_outliving_the_grace_ends_with_an_error_event(start_mocks, start_gateway) -> None:
    mock: MockEngine = start_mocks(1)[0]
    mock.set(chunks=100, chunk_delay_s=0.1)  # a 10 s stream, far longer than the 3 s grace
    gw = start_gateway([mock], None, gateway=GRACE, cache={"enabled": False})
    r = _open_stream(gw)
    lines = r.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))
    assert "answer" in first
    t0 = _reload(gw)
    # a ChunkedEncodingError here is the defect: nginx's forced close cut the body
    rest = _events(list(lines))
    took = time.monotonic() - t0
    assert rest, "no event after the reload"
    last = json.loads(rest[-1])
    assert last["error"]["code"] == "gateway_shutdown", last
    assert last["error"]["type"] == "server_error"
    assert "[DONE]" not in rest
    # cut at grace - read timeout - 1 s = 1 s after the reload, before the grace (3 s) ends
    assert 0.5 <= took < 3.0, took
    assert len(rest) < 60  # the stream was cut, not run to its end
    print(f"stream ended {took:.2f} s after the reload (grace 3 s) with {len(rest) - 1} more content events "
          f"and the gateway_shutdown error event")
    deadline = time.monotonic() + 5
    while gw.metric_sum("kvgate_stream_cuts_total", reason="shutdown-grace") < 1:
        assert time.monotonic() < deadline, "kvgate_stream_cuts_total{reason=shutdown-grace} not counted"
        time.sleep(0.1)
    assert gw.metric_sum("kvgate_stream_cuts_total", reason="shutdown-forced") == 0


def test_a_stream_that_ends_within_the_cut_window_is_untouched(start_mocks, start_gateway) -> None:
    mock: MockEngine = start_mocks(1)[0]
    mock.set(chunks=5, chunk_delay_s=0.1)  # 0.5 s: ends before the cut (1 s after the reload)
    gw = start_gateway([mock], None, gateway=GRACE, cache={"enabled": False})
    r = _open_stream(gw)
    lines = r.iter_lines(decode_unicode=True)
    next(line for line in lines if line.startswith("data: "))
    _reload(gw)
    rest = _events(list(lines))
    assert rest[-1] == "[DONE]"
    assert not any('"error"' in e for e in rest)
    assert gw.metric_sum("kvgate_stream_cuts_total") == 0
