"""Bodies the gateway must refuse itself (issue 9 item 8), against real nginx, Redis and the
mock engine: a wrong `messages` / `prompt` shape or invalid UTF-8 is a 400 in OpenAI's
format that never reaches the engine nor the cache; a body that stalls or trickles gets a
JSON 408 at the configured idle timeout / total deadline; a malformed request line and
`Transfer-Encoding` with `Content-Length` get a JSON 400, not nginx's HTML page.
The odd HTTP cases go over raw sockets, since an HTTP client library would refuse to send them."""

from __future__ import annotations

import json
import select
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from gwfixtures import MODEL, Gateway, _start_gateway, _start_redis, make_policy
from mockengine import MockEngine, start_mock_engines

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One mock engine + Redis + gateway (default body timeouts), shared by the module."""
    base = tmp_path_factory.mktemp("bodies")
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        mocks = start_mock_engines(1, "b")
        stack.callback(mocks[0].stop)
        g = _start_gateway(base, make_policy(mocks, redis), mocks, redis)
        stack.callback(g.stop)
        yield g


@pytest.fixture
def clean(gw: Gateway) -> Gateway:
    assert gw.redis is not None
    gw.redis.client().flushdb()
    _mock(gw).clear()
    return gw


def _mock(gw: Gateway) -> MockEngine:
    return gw.sims[0]  # type: ignore[return-value]


def _post(gw: Gateway, path: str, body: bytes | str) -> requests.Response:
    data = body.encode() if isinstance(body, str) else body
    return requests.post(gw.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=10)


def _cache_keys(gw: Gateway) -> list[bytes]:
    assert gw.redis is not None
    return list(gw.redis.client().scan_iter("kvgate:resp:*"))


def _chat(messages: str, extra: str = "") -> str:
    return '{"model": "%s", "temperature": 0, "max_tokens": 4%s, "messages": %s}' % (MODEL, extra, messages)


def _completion(prompt: str) -> str:
    return '{"model": "%s", "temperature": 0, "max_tokens": 4, "prompt": %s}' % (MODEL, prompt)


# (path, body, param, code)
BAD = {
    "messages-missing": (CHAT, '{"model": "%s", "temperature": 0}' % MODEL, "messages", "missing_required_parameter"),
    "messages-string": (CHAT, _chat('"hello"'), "messages", "invalid_type"),
    "messages-object": (CHAT, _chat('{"role": "user", "content": "hi"}'), "messages", "invalid_type"),
    "messages-empty": (CHAT, _chat("[]"), "messages", "empty_array"),
    "message-not-object": (CHAT, _chat('["hi"]'), "messages[0]", "invalid_type"),
    "role-missing": (CHAT, _chat('[{"content": "hi"}]'), "messages[0].role", "missing_required_parameter"),
    "role-number": (CHAT, _chat('[{"role": 3, "content": "hi"}]'), "messages[0].role", "invalid_type"),
    "content-number": (CHAT, _chat('[{"role": "user", "content": 5}]'), "messages[0].content", "invalid_type"),
    "content-bool": (CHAT, _chat('[{"role": "system", "content": "s"}, {"role": "user", "content": true}]'),
                     "messages[1].content", "invalid_type"),
    "content-object": (CHAT, _chat('[{"role": "user", "content": {"text": "hi"}}]'), "messages[0].content",
                       "invalid_type"),
    "content-null-user": (CHAT, _chat('[{"role": "user", "content": null}]'), "messages[0].content",
                          "missing_required_parameter"),
    "content-part-number": (CHAT, _chat('[{"role": "user", "content": [{"type": "text", "text": "a"}, 1]}]'),
                            "messages[0].content[1]", "invalid_type"),
    "text-part-number": (CHAT, _chat('[{"role": "user", "content": [{"type": "text", "text": 5}]}]'),
                         "messages[0].content[0].text", "invalid_type"),
    "text-part-no-text": (CHAT, _chat('[{"role": "user", "content": [{"type": "text"}]}]'),
                          "messages[0].content[0].text", "missing_required_parameter"),
    "image-part-number": (CHAT, _chat('[{"role": "user", "content": [{"type": "image_url", "image_url": 1}]}]'),
                          "messages[0].content[0].image_url", "invalid_type"),
    "stream-string": (CHAT, _chat('[{"role": "user", "content": "hi"}]', ', "stream": "yes"'), "stream",
                      "invalid_type"),
    "stream-options-not-object": (COMPLETIONS, '{"model": "%s", "stream": true, "stream_options": true, '
                                  '"prompt": "a"}' % MODEL, "stream_options", "invalid_type"),
    "model-number": (CHAT, '{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', "model",
                     "invalid_type"),
    "prompt-missing": (COMPLETIONS, '{"model": "%s", "temperature": 0}' % MODEL, "prompt",
                       "missing_required_parameter"),
    "prompt-number": (COMPLETIONS, _completion("5"), "prompt", "invalid_type"),
    "prompt-object": (COMPLETIONS, _completion('{"text": "a"}'), "prompt", "invalid_type"),
    "prompt-empty": (COMPLETIONS, _completion("[]"), "prompt", "empty_array"),
    "prompt-mixed": (COMPLETIONS, _completion('["a", 1]'), "prompt[1]", "invalid_type"),
    "prompt-bad-token": (COMPLETIONS, _completion("[1, -2]"), "prompt[1]", "invalid_type"),
    "prompt-bad-token-list": (COMPLETIONS, _completion('[[1, 2], [3, "x"]]'), "prompt[1][1]", "invalid_type"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_body_is_a_400_the_engine_never_sees(clean: Gateway, case: str) -> None:
    path, body, param, code = BAD[case]
    bad_before = clean.metric_sum("kvgate_bad_requests_total", status="400")
    r = _post(clean, path, body)
    assert r.status_code == 400, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["code"] == code
    assert param in err["message"]
    assert _mock(clean).completions() == []
    # counted in the log phase, which may run just after the client has the answer
    deadline = time.monotonic() + 5
    while (n := clean.metric_sum("kvgate_bad_requests_total", status="400")) < bad_before + 1:
        assert time.monotonic() < deadline, "the refusal was never counted"
        time.sleep(0.02)
    assert n == bad_before + 1


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_a_400(clean: Gateway, number: str) -> None:
    """Not JSON (cjson accepts them by default); an engine would take them as the temperature."""
    r = _post(clean, CHAT, _chat('[{"role": "user", "content": "hi"}]', ', "top_p": %s' % number)
              .replace('"temperature": 0', '"temperature": %s' % number))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json", err
    assert _mock(clean).completions() == []
    r = _post(clean, CHAT, _chat('[{"role": "user", "content": "hi"}]'))
    assert r.status_code == 200, r.text


def test_a_bad_body_is_never_cached(clean: Gateway) -> None:
    """Before the fix the engine answered 200 to `messages` as a string, and the repeat was a HIT."""
    body = _chat('"tell me a story"')
    for _ in range(2):
        r = _post(clean, CHAT, body)
        assert r.status_code == 400, r.text
        assert r.headers.get("X-Kvgate-Cache") != "HIT"
    time.sleep(0.3)  # the cache writes from a timer: give a wrong write the time to land
    assert _cache_keys(clean) == []
    assert _mock(clean).completions() == []


def test_good_bodies_still_pass(clean: Gateway) -> None:
    ok = [
        (CHAT, _chat('[{"role": "user", "content": "Grüße, 世界 😀"}]')),
        (CHAT, _chat('[{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": '
                     '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, '
                     '{"role": "tool", "tool_call_id": "c1", "content": "42"}]')),
        (CHAT, _chat('[{"role": "user", "content": [{"type": "text", "text": "a"}]}]')),
        (CHAT, _chat('[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", '
                     '"image_url": {"url": "data:,"}}]}]', ', "stream": false, "stream_options": null')),
        (COMPLETIONS, _completion('"Once upon a time"')),
        (COMPLETIONS, _completion('["a", "b"]')),
        (COMPLETIONS, _completion("[1, 2, 3]")),
        (COMPLETIONS, _completion("[[1, 2], [3]]")),
    ]
    for path, body in ok:
        r = _post(clean, path, body)
        assert r.status_code == 200, (body, r.text)
    assert len(_mock(clean).completions()) == len(ok)


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"caf\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"ok \x80 no"],
                         ids=["ff-fe", "truncated", "surrogate", "overlong", "lone-continuation"])
def test_invalid_utf8_is_a_400(clean: Gateway, raw: bytes) -> None:
    body = b'{"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x' + raw + b'"}]}'
    r = _post(clean, CHAT, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_encoding"
    assert _mock(clean).completions() == []
    time.sleep(0.2)
    assert _cache_keys(clean) == []


# --------------------------------------------------------------------------- raw HTTP
class _Conn:
    """A raw client connection: bytes out as given, responses parsed off one buffered reader
    (so pipelined answers are not lost)."""

    def __init__(self, gw: Gateway) -> None:
        host, port = gw.listen.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.reader = self.sock.makefile("rb")

    def __enter__(self) -> "_Conn":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reader.close()
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
        """One HTTP/1.1 response: Content-Length, chunked, or up to the close."""
        self.sock.settimeout(timeout)
        f = self.reader
        line = f.readline()
        if not line:
            raise ConnectionError("closed before a response")
        status = int(line.split()[1])
        headers: dict[str, str] = {}
        while True:
            ln = f.readline()
            if ln in (b"\r\n", b"\n", b""):
                break
            k, v = ln.decode("latin-1").split(":", 1)
            headers[k.strip().lower()] = v.strip()
        if status == 100:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, f.read(int(headers["content-length"]))
        if headers.get("transfer-encoding") != "chunked":
            # an HTTP/1.0-style answer (nginx's own, to a request line it could not parse)
            return status, headers, f.read()
        body = b""
        while True:
            size = int(f.readline().strip(), 16)
            body += f.read(size)
            f.readline()
            if size == 0:
                return status, headers, body

    def closed(self, within: float) -> bool:
        """True when the server closes the connection (EOF or reset) within ``within`` seconds."""
        self.sock.settimeout(within)
        try:
            return self.reader.read(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


def _head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


GOOD = _chat('[{"role": "user", "content": "hello there"}]').encode()


def test_a_body_split_across_writes_keepalive_and_pipelining_still_work(clean: Gateway) -> None:
    with _Conn(clean) as c:
        c.send(_head(CHAT, len(GOOD)) + GOOD[:10])
        time.sleep(0.2)
        c.send(GOOD[10:30])
        time.sleep(0.2)
        c.send(GOOD[30:])
        status, _, body = c.response()
        assert status == 200, body
        # the same connection carries the next request: the body was read to its exact end
        nxt = _completion('"next"').encode()
        c.send(_head(COMPLETIONS, len(nxt)) + nxt)
        status, _, body = c.response()
        assert status == 200, body
        # pipelined: the second request follows the first body in the same segment
        first, second = _chat('[{"role": "user", "content": "third"}]').encode(), _completion('"fourth"').encode()
        c.send(_head(CHAT, len(first)) + first + _head(COMPLETIONS, len(second)) + second)
        assert c.response()[0] == 200
        assert c.response()[0] == 200
    assert [r.path for r in _mock(clean).completions()] == [CHAT, COMPLETIONS, CHAT, COMPLETIONS]
    assert [r.body["max_tokens"] for r in _mock(clean).completions()] == [4] * 4


def test_a_client_gone_mid_body_reaches_no_engine(clean: Gateway) -> None:
    before = clean.metric_sum("kvgate_bad_requests_total", status="499")
    with _Conn(clean) as c:
        c.send(_head(CHAT, len(GOOD)) + GOOD[:20])
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while clean.metric_sum("kvgate_bad_requests_total", status="499") < before + 1:
        assert time.monotonic() < deadline, "the abandoned request was never counted"
        time.sleep(0.05)
    assert _mock(clean).completions() == []


def test_expect_100_continue_is_answered(clean: Gateway) -> None:
    with _Conn(clean) as c:
        c.send(_head(CHAT, len(GOOD), "Expect: 100-continue\r\n"))
        assert c.response(timeout=5)[0] == 100
        c.send(GOOD)
        status, _, body = c.response()
        assert status == 200, body


def test_a_chunked_body_still_passes(clean: Gateway) -> None:
    def gen() -> Iterator[bytes]:
        yield GOOD[:20]
        yield GOOD[20:]

    r = requests.post(clean.url + CHAT, data=gen(), headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200, r.text
    assert len(_mock(clean).completions()) == 1


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1 extra\r\nHost: gw\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
], ids=["garbage-line", "three-part-line", "te-and-cl", "bad-chunk-size"])
def test_a_malformed_request_is_a_json_400(clean: Gateway, raw: bytes) -> None:
    with _Conn(clean) as c:
        c.send(raw)
        status, headers, body = c.response()
    assert status == 400
    assert headers["content-type"].startswith("application/json"), (headers, body)
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "malformed_request"
    assert _mock(clean).completions() == []


# --------------------------------------------------------------------------- timeouts
TIMEOUT_S, DEADLINE_S = 1.0, 3.0


@pytest.fixture
def slow_gw(tmp_path: Path) -> Iterator[Gateway]:
    """A gateway with a 1 s body idle timeout and a 3 s body deadline."""
    with ExitStack() as stack:
        mocks = start_mock_engines(1, "t")
        stack.callback(mocks[0].stop)
        policy = make_policy(mocks, None, cache={"enabled": False},
                             gateway={"client_body_timeout_s": TIMEOUT_S, "client_body_deadline_s": DEADLINE_S})
        g = _start_gateway(tmp_path, policy, mocks, None)
        stack.callback(g.stop)
        yield g


def _timeout_answer(c: _Conn) -> dict:
    status, headers, body = c.response()
    assert status == 408, body
    assert headers["content-type"].startswith("application/json")
    # the rest of the body must not be read as a next request
    assert headers.get("connection") == "close"
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_timeout"
    return err


def test_a_stalled_body_is_a_408_at_the_idle_timeout(slow_gw: Gateway) -> None:
    with _Conn(slow_gw) as c:
        t0 = time.monotonic()
        c.send(_head(CHAT, len(GOOD)) + GOOD[:15])
        err = _timeout_answer(c)
        elapsed = time.monotonic() - t0
        assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 1.5, elapsed
        assert "stopped arriving" in err["message"]
        assert c.closed(3)
    assert _mock(slow_gw).completions() == []
    slow_gw.wait_metric("kvgate_bad_requests_total", 1, status="408")


def test_a_trickling_body_is_a_408_at_the_deadline(slow_gw: Gateway) -> None:
    step = 0.3  # a byte every 0.3 s: never idle for the 1 s timeout; the whole body would take ~40 s
    with _Conn(slow_gw) as c:
        t0 = time.monotonic()
        c.send(_head(CHAT, len(GOOD)))
        answered = False
        for i in range(int((DEADLINE_S + 3) / step)):
            if select.select([c.sock], [], [], step)[0]:
                answered = True
                break
            try:
                c.send(GOOD[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
        elapsed = time.monotonic() - t0
        assert answered, "no answer before the test's own limit"
        err = _timeout_answer(c)
        assert DEADLINE_S * 0.9 <= elapsed < DEADLINE_S + 1.5, elapsed
        assert "did not arrive within" in err["message"]
        assert c.closed(3)
    assert _mock(slow_gw).completions() == []
