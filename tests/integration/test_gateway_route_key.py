"""Route-key edge cases through the real gateway (nginx + Lua), with mock engines:
placeholder session ids (``null``, ``undefined``, ...) and the shared-prefix hot key on
``/v1/completions``."""

from __future__ import annotations

import collections
import http.client
import json

import requests

from gwfixtures import MODEL, Gateway

SENTINELS = ["null", "undefined", "None", "NULL", "nil", "NaN", ""]


def _post(s: requests.Session, gw: Gateway, path: str, body: dict, headers: dict | None = None) -> requests.Response:
    r = s.post(gw.url + path, json={"model": MODEL, **body}, headers=headers or {}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def _error_log(gw: Gateway) -> str:
    return (gw.nginx.prefix / "logs/error.log").read_text()


def test_placeholder_session_ids_route_like_no_session(start_mocks, start_gateway) -> None:
    # str(None) / String(undefined) in a client: every prompt would share one key and one node
    gw = start_gateway(start_mocks(3, prefix="s"), None)
    s = requests.Session()
    prompts = [f"question {i}: what is {i} times {i + 7}?" for i in range(140)]
    baseline = {}
    for p in prompts:
        r = _post(s, gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 1})
        assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix"
        baseline[p] = r.headers["X-Kvgate-Node"]
    assert len(set(baseline.values())) == 3, collections.Counter(baseline.values())
    for i, p in enumerate(prompts):
        value = SENTINELS[i % len(SENTINELS)]
        r = _post(s, gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 1},
                  headers={"X-Session-Id": value})
        # the placeholder is no session: the prefix fingerprint routes, to the same node as without it
        assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix", value
        assert r.headers["X-Kvgate-Node"] == baseline[p], value
    assert gw.metric_sum("kvgate_route_key_sentinel_total", pool="default", source="session") == len(prompts)
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="null") == 40
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="undefined") == 20
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="empty") == 20
    assert "treated as absent" in _error_log(gw)
    # a real session id still pins, and is not counted
    nodes = {_post(s, gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 1},
                   headers={"X-Session-Id": "nullable-42"}).headers["X-Kvgate-Node"] for p in prompts[:20]}
    assert len(nodes) == 1
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session") == len(prompts)


def test_placeholder_user_field_routes_like_no_user(start_mocks, start_gateway) -> None:
    gw = start_gateway(start_mocks(3, prefix="u"), None)
    s = requests.Session()
    nodes = collections.Counter()
    for i in range(100):
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 1}
        expected = _post(s, gw, "/v1/completions", body).headers["X-Kvgate-Node"]
        r = _post(s, gw, "/v1/completions", {**body, "user": "None" if i % 2 else "undefined"})
        assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix"
        assert r.headers["X-Kvgate-Node"] == expected
        nodes[expected] += 1
    assert len(nodes) == 3, nodes
    assert gw.metric_sum("kvgate_route_key_sentinel_total", pool="default", source="user") == 100
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session") == 0


def _raw_post(gw: Gateway, session: str) -> tuple[int, dict, dict]:
    """POST a chat body with ``X-Session-Id: <session>`` sent byte for byte (requests refuses
    a value with leading whitespace) → (status, headers, body)."""
    host, port = gw.listen.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.putheader("X-Session-Id", session)
        conn.endheaders(body.encode())
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def test_session_id_tabs_around_the_value_are_trimmed(start_mocks, start_gateway) -> None:
    # RFC 9110 optional whitespace is spaces and tabs; nginx strips only the spaces
    gw = start_gateway(start_mocks(3, prefix="t"), None)
    nodes = set()
    for i in range(30):
        status, h, _ = _raw_post(gw, f"sess-{i}")
        assert status == 200
        for v in (f"\tsess-{i}", f"sess-{i}\t", f"\t sess-{i} \t"):
            status, h2, body = _raw_post(gw, v)
            assert status == 200, (repr(v), body)
            assert h2["x-kvgate-route-key-kind"] == "session"
            assert h2["x-kvgate-node"] == h["x-kvgate-node"], repr(v)
        nodes.add(h["x-kvgate-node"])
    assert len(nodes) > 1, nodes
    status, _, body = _raw_post(gw, "sess\t1")
    assert status == 400 and body["error"]["code"] == "invalid_session_id", body
    assert "control characters" in body["error"]["message"]
    status, _, body = _raw_post(gw, "\t\t")
    assert status == 200
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="empty") == 1


def test_more_placeholder_session_ids_route_like_no_session(start_mocks, start_gateway) -> None:
    gw = start_gateway(start_mocks(3, prefix="p"), None)
    s = requests.Session()
    values = {"(null)": "null", "nullptr": "null", "[object Object]": "object", '"null"': "null",
              '"undefined"': "undefined"}
    for i in range(40):
        body = {"messages": [{"role": "user", "content": f"question {i}: what is {i} times {i + 3}?"}],
                "max_tokens": 1}
        expected = _post(s, gw, "/v1/chat/completions", body).headers["X-Kvgate-Node"]
        v = list(values)[i % len(values)]
        r = _post(s, gw, "/v1/chat/completions", body, headers={"X-Session-Id": v})
        assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix", v
        assert r.headers["X-Kvgate-Node"] == expected, v
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session") == 40
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="null") == 24
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="object") == 8
    assert gw.metric_sum("kvgate_route_key_sentinel_total", source="session", value="undefined") == 8


WINDOW = 256  # pool prefix_chars in the hot-prefix tests
# a few-shot template far longer than the window (and than twice the window)
TEMPLATE = "".join(f"Q: example question number {i}?\nA: example answer {i}.\n" for i in range(40))


def test_completions_hot_shared_prefix_is_flagged(start_mocks, start_gateway) -> None:
    gw = start_gateway(start_mocks(3, prefix="h"), None, pool={"prefix_chars": WINDOW})
    assert len(TEMPLATE) > 4 * WINDOW
    s = requests.Session()
    nodes = collections.Counter()
    n = 300
    for i in range(n):
        r = _post(s, gw, "/v1/completions", {"prompt": f"{TEMPLATE}Q: what is {i} plus {i * 3}?\nA:", "max_tokens": 1})
        nodes[r.headers["X-Kvgate-Node"]] += 1
    assert len(nodes) == 1  # the hot key itself (spreading it is the balancer's job)
    flagged = gw.metric_sum("kvgate_route_key_shared_prefix_total", pool="default", endpoint="completions")
    # each worker (2) flags from the request that shows it the 4th distinct prompt on the key
    assert n - 2 * 3 <= flagged <= n, flagged
    assert "completions prompts share their first" in _error_log(gw)
    # the chat rule is unchanged: a window covering only the system prompt is flagged at once
    system = {"role": "system", "content": "You are the support bot of ACME Corp. " * 10}
    for i in range(8):
        _post(s, gw, "/v1/chat/completions",
              {"messages": [system, {"role": "user", "content": f"ticket {i}"}], "max_tokens": 1})
    gw.wait_metric("kvgate_route_key_shared_prefix_total", 8, endpoint="chat")
    assert "prefix route keys cover only the system prompt" in _error_log(gw)


def test_completions_conversations_are_not_flagged(start_mocks, start_gateway) -> None:
    # each turn's prompt extends the previous one: one conversation's turns share the
    # fingerprint by design; five such conversations, interleaved, are no hot prefix
    gw = start_gateway(start_mocks(3, prefix="c"), None, pool={"prefix_chars": WINDOW})
    s = requests.Session()
    prompts = [f"Conversation {c}. " + "The user and the assistant talk about rivers. " * 8 for c in range(5)]
    for turn in range(30):
        for c in range(5):
            r = _post(s, gw, "/v1/completions", {"prompt": prompts[c], "max_tokens": 1})
            assert r.headers["X-Kvgate-Route-Key-Kind"] == "prefix"
            prompts[c] += f"\nUser: question {turn}?\nAssistant: {r.json()['choices'][0]['text']}"
    assert all(len(p) > 4 * WINDOW for p in prompts)
    assert gw.metric_sum("kvgate_route_key_shared_prefix_total", pool="default") == 0
    assert "completions prompts share their first" not in _error_log(gw)
    # the same traffic with token-id prompts (a list of ints), also not flagged; then many
    # different token prompts with one long shared start are
    base = list(range(1000, 1200))
    for c in range(5):
        ids = [c] + base
        for turn in range(10):
            _post(s, gw, "/v1/completions", {"prompt": ids, "max_tokens": 1})
            ids = ids + [7, 8, 9, turn]
    assert gw.metric_sum("kvgate_route_key_shared_prefix_total", pool="default") == 0
    for i in range(40):
        _post(s, gw, "/v1/completions", {"prompt": base + [i, i + 1, i + 2], "max_tokens": 1})
    assert gw.metric_sum("kvgate_route_key_shared_prefix_total", endpoint="completions") >= 40 - 2 * 3
