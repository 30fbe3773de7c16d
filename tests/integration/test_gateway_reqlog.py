"""The request log in Redis (stream ``kvgate:log``, hot sets ``kvgate:hot:<pool>:<minute>``)
and the opt-in prompt-prefix capture (``kvgate:prefix:<pool>:<fp>``), written by the
gateway's per-worker flush timer, never from the request path."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import zlib
from pathlib import Path

import redis as redis_lib
import requests
from kvgate import keys

from gwfixtures import MODEL, Gateway, RedisServer, _wait, wait_cached

# home: the key's home node (kctx.balancer.home, issue 10); keys.LOG_FIELDS is the contract
FIELDS = set(keys.LOG_FIELDS)  # the contract (kvgate.keys): every entry has every field


def _entries(gw: Gateway) -> list[dict[str, str]]:
    assert gw.redis is not None
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in gw.redis.client().xrange("kvgate:log")]


def _wait_entries(gw: Gateway, n: int, timeout: float = 10) -> list[dict[str, str]]:
    _wait(lambda: len(_entries(gw)) >= n, timeout, f"{n} request-log entries")
    return _entries(gw)


def _short(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _redis_dump(client: redis_lib.Redis) -> bytes:
    """Every key and value in Redis, whatever its type, as one blob."""
    out = []
    for k in client.scan_iter("*"):
        t = client.type(k)
        out.append(k)
        if t == b"string":
            out.append(client.get(k) or b"")
        elif t == b"zset":
            out.extend(m for m, _ in client.zrange(k, 0, -1, withscores=True))
        elif t == b"stream":
            for _, fields in client.xrange(k):
                out.extend(b"%s=%s" % kv for kv in fields.items())
        elif t == b"list":
            out.extend(client.lrange(k, 0, -1))
        elif t == b"hash":
            out.extend(b"%s=%s" % kv for kv in client.hgetall(k).items())
        elif t == b"set":
            out.extend(client.smembers(k))
    return b"\n".join(out)


SYSTEM = {"role": "system", "content": "You answer questions about rivers."}
FIRST = {"role": "user", "content": "Tell me about the Rhine."}


def test_entries_fields_fingerprints_and_hot_sets(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(2, prefix="l"), start_redis())
    t0 = time.time()
    r_prefix = gw.chat([SYSTEM, FIRST], max_tokens=2, temperature=0)
    wait_cached(gw)
    r_hit = gw.chat([SYSTEM, FIRST], max_tokens=2, temperature=0)
    assert r_hit.headers["X-Kvgate-Cache"] == "HIT"
    # a later turn of the same chat, routed by its session header: same fingerprint
    turn2 = [SYSTEM, FIRST, {"role": "assistant", "content": "It is long."}, {"role": "user", "content": "And?"}]
    r_session = gw.chat(turn2, max_tokens=2, headers={"X-Session-Id": "sess-1"})
    r_user = gw.chat([SYSTEM, FIRST], max_tokens=2, user="user-1")
    # no prompt (vLLM's prompt_embeds instead; `messages: []` is refused by the gateway itself):
    # fallback key, the node answers 400
    r_empty = requests.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt_embeds": "AAAA",
                                                              "max_tokens": 2}, timeout=10)
    assert r_empty.status_code == 400
    entries = _wait_entries(gw, 5)
    assert len(entries) == 5
    for e in entries:
        assert set(e) == FIELDS, e
        assert t0 - 1 <= float(e["ts"]) <= time.time() + 1
        assert int(e["ms"]) >= 0
        assert e["pool"] == "default"
    by_kind = {}
    for e in entries:
        by_kind.setdefault((e["kind"], e["cache"]), e)
    miss = by_kind[("prefix", "MISS")]
    fp = miss["fp"]
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert miss["node"] == r_prefix.headers["X-Kvgate-Node"] and miss["status"] == "200"
    assert miss["key"] == _short("p:" + fp)
    # the key's place on nginx's ring (ngx.crc32_long) and one node tried
    assert (miss["point"], miss["tries"]) == (str(zlib.crc32(b"p:" + fp.encode())), "1")
    hit = by_kind[("prefix", "HIT")]
    assert (hit["node"], hit["status"], hit["fp"]) == ("cache", "200", fp)
    assert (hit["point"], hit["tries"]) == (miss["point"], "0")  # no upstream for a hit
    # chash without a failover: the node that answered is the key's home; a hit has none
    assert miss["home"] == miss["node"] and hit["home"] == ""
    session = by_kind[("session", "BYPASS")]
    assert session["fp"] == fp  # computed although the session header decided the route
    assert session["key"] == _short("s:sess-1")
    assert (session["point"], session["tries"]) == (str(zlib.crc32(b"s:sess-1")), "1")
    assert session["node"] == r_session.headers["X-Kvgate-Node"]
    user = by_kind[("user", "BYPASS")]
    assert (user["fp"], user["key"], user["node"]) == (fp, _short("u:user-1"), r_user.headers["X-Kvgate-Node"])
    fallback = by_kind[("fallback", "BYPASS")]
    assert (fallback["fp"], fallback["status"]) == ("", "400")
    assert fallback["key"] == _short(gw.policy.gateway.fallback_route_key)

    client = gw.redis.client()
    hot_keys = list(client.scan_iter("kvgate:hot:default:*"))
    assert hot_keys
    minutes = {int(float(e["ts"]) // 60) for e in entries}
    assert {int(k.rsplit(b":", 1)[1]) for k in hot_keys} <= minutes
    assert sum(client.zscore(k, fp) or 0 for k in hot_keys) == 4
    for k in hot_keys:
        ttl = client.ttl(k)
        assert 3600 < ttl <= 3600 + 120, ttl  # hot_window_s (default 3600) + 120
    assert gw.metric_sum("kvgate_request_log_written_total") == 5
    assert gw.metric_sum("kvgate_request_log_dropped_total") == 0
    # capture is off by default
    assert list(client.scan_iter("kvgate:prefix:*")) == []


def test_capture_off_no_prompt_text_reaches_redis(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(1, prefix="p"), start_redis(), cache={"enabled": False})
    secret = "zebra-secret-4417"
    msgs = [{"role": "system", "content": f"system {secret}"}, {"role": "user", "content": f"user {secret}"}]
    tools = [{"type": "function", "function": {"name": f"tool_{secret.replace('-', '_')}", "parameters": {}}}]
    assert gw.chat(msgs, max_tokens=2).status_code == 200
    assert gw.chat(msgs, max_tokens=2, tools=tools, headers={"X-Session-Id": "s"}).status_code == 200
    assert gw.chat(msgs, max_tokens=2, user=f"user-{secret}").status_code == 200
    requests.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": f"complete {secret}", "max_tokens": 2},
                  timeout=30).raise_for_status()
    _wait_entries(gw, 4)
    dump = _redis_dump(gw.redis.client())
    assert b"kvgate:log" in dump
    assert secret.encode() not in dump
    assert secret.replace("-", "_").encode() not in dump
    assert b"kvgate:prefix:" not in dump
    assert gw.metric_sum("kvgate_prefix_captures_total") == 0


def test_capture_opt_in_stores_the_prefix_once(start_sims, start_redis, start_gateway) -> None:
    gw = start_gateway(start_sims(1, prefix="c"), start_redis(),
                       pool={"warmup": {"capture_prefix_text": True, "capture_ttl_s": 600,
                                        "capture_max_bytes": 1024}})
    tools = [{"type": "function", "function": {"name": "lookup", "parameters":
                                               {"type": "object", "properties": {"q": {}}, "required": []}}}]
    later = [{"role": "assistant", "content": "It is long."}, {"role": "user", "content": "And?"}]
    for i in range(6):
        assert gw.chat([SYSTEM, FIRST, *later][: 2 + 2 * (i % 2)], tools=tools, max_tokens=1).status_code == 200
    one_off = {"role": "system", "content": "a prefix seen once is never stored"}
    assert gw.chat([one_off, FIRST], max_tokens=1).status_code == 200
    # 3 of each: with 2 workers, one of them sees it twice (the second sighting is the one captured)
    big = {"role": "system", "content": "x" * 2000}
    for _ in range(3):
        assert gw.chat([big, FIRST], max_tokens=1).status_code == 200
        requests.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
                      timeout=30).raise_for_status()
    entries = _wait_entries(gw, 13)
    fps = {e["fp"] for e in entries if e["kind"] == "prefix"}
    assert len(fps) == 4  # the chat (all turns share it), the one-off, the big one, the completion
    client = gw.redis.client()
    keys = list(client.scan_iter("kvgate:prefix:*"))
    assert len(keys) == 1, keys
    fp = keys[0].decode().rsplit(":", 1)[1]
    assert keys[0].decode() == f"kvgate:prefix:default:{fp}" and fp in fps
    doc = json.loads(client.get(keys[0]))
    assert doc == {"model": MODEL, "messages": [SYSTEM, FIRST], "tools": tools}
    assert 0 < client.ttl(keys[0]) <= 600
    # once per fingerprint per worker per minute, not once per request (2 workers)
    assert 1 <= gw.metric_sum("kvgate_prefix_captures_total") <= 2
    assert 1 <= gw.metric_sum("kvgate_prefix_capture_skipped_total", reason="too-large") <= 2
    assert 1 <= gw.metric_sum("kvgate_prefix_capture_skipped_total", reason="not-chat") <= 2


def test_all_nodes_failed_is_logged(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(1, prefix="d")
    gw = start_gateway(sims, start_redis())
    sims[0].stop()
    r = gw.chat("anyone?", max_tokens=1, headers={"X-Session-Id": "s-down"})
    assert r.status_code == 502
    (e,) = _wait_entries(gw, 1)
    assert (e["status"], e["node"], e["kind"], e["cache"]) == ("502", "", "session", "BYPASS")
    assert e["key"] == _short("s:s-down") and len(e["fp"]) == 64
    # the one node was tried (the failed address is in $upstream_addr after the redirect)
    assert (e["point"], e["tries"]) == (str(zlib.crc32(b"s:s-down")), "1")
    # the context came back after the redirect (kvgate.ctx): the balancer's home is known
    assert e["home"] == "d1"


def _redis_on(port: int, d: Path) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_redis_down_drops_and_counts_then_recovers(start_sims, start_redis, start_gateway, tmp_path: Path) -> None:
    redis = start_redis()
    gw = start_gateway(start_sims(1, prefix="r"), redis)
    redis.stop()
    for i in range(3):
        assert gw.chat(f"while redis is down {i}", max_tokens=1).status_code == 200
    _wait(lambda: gw.metric_sum("kvgate_request_log_dropped_total") >= 3, 10, "3 dropped entries")
    assert gw.metric_sum("kvgate_request_log_written_total") == 0
    # Redis back on the same port: logging resumes (the breaker closes after 1 s)
    proc = _redis_on(redis.port, tmp_path / "redis-again")
    again = RedisServer(redis.port, proc, tmp_path / "redis-again")
    try:
        _wait(lambda: _ping(again), 10, "redis back")

        def logged_again() -> bool:
            # a flush within a second of the last failure is still dropped (breaker): retry
            assert gw.chat("redis is back", max_tokens=1).status_code == 200
            time.sleep(0.3)
            return again.client().xlen("kvgate:log") >= 1

        _wait(logged_again, 15, "an entry after recovery")
        assert gw.metric_sum("kvgate_request_log_written_total") >= 1
    finally:
        again.stop()


def _ping(server: RedisServer) -> bool:
    try:
        return bool(server.client().ping())
    except redis_lib.RedisError:
        return False
