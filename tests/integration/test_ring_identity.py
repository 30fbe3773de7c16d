"""A node's place on the chash ring comes from its id, not its address (issue 9 item 4),
against the real gateway (nginx + the Lua ring of kvgate.balancer.chash) with mock engines:
a node that moves to a new port keeps its keys, two gateways that spell a node's host
differently route every key alike, and removing a node moves only its keys; a node at a unix
socket is reached through the Lua balancer."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from gwfixtures import MODEL, Gateway, free_port, make_policy
from kvgate.bench.balancer import bare_nginx_conf
from kvgate.render import default_lua_dir
from oracles.ring import Ring, key_point, pool_ring
from mockengine import MockEngine

KEYS = [f"session-{i}" for i in range(240)]
_FROM = re.compile(r" from (\S+)$")


def _route(gw: Gateway, sessions: list[str], only: set[str] | None = None) -> dict[str, str]:
    """session → the node that answered (checked against the engine's own answer)."""
    http = requests.Session()
    out: dict[str, str] = {}
    for s in sessions:
        r = http.post(gw.url + "/v1/chat/completions", timeout=30, headers={"X-Session-Id": s},
                      json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {s}"}]})
        assert r.status_code == 200, r.text
        engine = _FROM.search(r.json()["choices"][0]["message"]["content"]).group(1)
        assert r.headers["X-Kvgate-Node"] == engine, (s, r.headers["X-Kvgate-Node"], engine)
        out[s] = engine
    return out


def _nodes(mocks: list[MockEngine], host: str = "127.0.0.1") -> list[dict]:
    return [{"id": m.node_id, "url": f"http://{host}:{m.port}"} for m in mocks]


def test_a_node_moved_to_a_new_port_keeps_its_keys(start_mocks, start_gateway) -> None:
    n1, n2, n3 = start_mocks(3)
    gw = start_gateway([n1, n2, n3], None, cache={"enabled": False})
    before = _route(gw, KEYS)
    assert set(before.values()) == {"n1", "n2", "n3"}
    # the gateway's ring is the oracle's
    ring = pool_ring(gw.policy, "default", {})
    assert all(before[s] == ring.home(key_point("s:" + s)) for s in KEYS)

    # n2's engine restarts on another port: same id, new address, not listening yet
    n2.stop()
    moved = MockEngine("n2")
    moved.start()
    new_port = moved.port
    moved.stop()
    policy = make_policy([n1, n2, n3], None, gateway={"listen": gw.listen}, cache={"enabled": False},
                         pool={"nodes": [{"id": "n1", "url": n1.url}, {"id": "n2", "url": f"http://127.0.0.1:{new_port}"},
                                         {"id": "n3", "url": n3.url}]})
    assert gw.nginx.apply(policy) == "reloaded"
    gw.policy = policy
    # while it is away, no key of another node moves (none of them touches n2)
    others = [s for s in KEYS if before[s] != "n2"]
    assert _route(gw, others) == {s: before[s] for s in others}

    # reachable again at its new port: no key at all has moved
    back = MockEngine("n2", port=new_port).start()
    try:
        after = _route(gw, KEYS)
        assert after == before
        assert len(back.completions()) == sum(1 for s in KEYS if before[s] == "n2") > 40
    finally:
        back.stop()


def test_two_gateways_spelling_a_host_differently_route_alike(start_mocks, start_gateway) -> None:
    mocks = start_mocks(4)
    by_ip = start_gateway(mocks, None, cache={"enabled": False}, pool={"nodes": _nodes(mocks, "127.0.0.1")})
    by_name = start_gateway(mocks, None, cache={"enabled": False}, pool={"nodes": _nodes(mocks, "localhost")})
    assert "localhost" in by_name.policy.pools[0].nodes[0].address
    a, b = _route(by_ip, KEYS), _route(by_name, KEYS)
    assert set(a.values()) == {m.node_id for m in mocks}
    differ = [s for s in KEYS if a[s] != b[s]]
    assert not differ, f"{len(differ)} of {len(KEYS)} keys differ, e.g. {[(s, a[s], b[s]) for s in differ[:5]]}"


def test_removing_a_node_moves_only_its_keys(start_mocks, start_gateway) -> None:
    mocks = start_mocks(4)
    gw = start_gateway(mocks, None, cache={"enabled": False})
    before = _route(gw, KEYS)
    # reordered too: the order of the nodes in the policy does not matter either
    kept = [mocks[3], mocks[0], mocks[2]]
    policy = make_policy(kept, None, gateway={"listen": gw.listen}, cache={"enabled": False})
    assert gw.nginx.apply(policy) == "reloaded"
    after = _route(gw, KEYS)
    gone = mocks[1].node_id
    for s in KEYS:
        if before[s] != gone:
            assert after[s] == before[s], s
        else:
            assert after[s] != gone
    assert sum(1 for s in KEYS if before[s] == gone) > 30


def test_a_unix_socket_node_is_reached_through_the_lua_balancer(tmp_path) -> None:
    """ngx_lua 0.10.23's set_current_peer takes "unix:/path" (ngx_parse_url): a node at a unix
    socket works with the Lua chash balancer, and $upstream_addr names the socket (the
    policy's node URLs are http://HOST:PORT today, so a bare nginx runs the module here)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kvgate-unix-"))
    sock_dir.chmod(0o755)  # workers (nobody) must reach the socket; nginx makes it 0666
    sock = sock_dir / "engine.sock"
    prefix = tmp_path / "prefix"
    for d in ("conf", "logs", "tmp"):
        (prefix / d).mkdir(parents=True)
    listen, tcp = free_port(), free_port()
    (prefix / "conf" / "nginx.conf").write_text(bare_nginx_conf(default_lua_dir(), http_body=f"""
    init_by_lua_block {{
        local chash = require "kvgate.balancer.chash"
        UNIX_POOL = assert(chash.new({{ name = "u", nodes = {{
            {{ id = "sock", address = "unix:{sock}", weight = 100 }},
            {{ id = "tcp", address = "127.0.0.1:{tcp}", weight = 100 }} }} }}))
    }}
    upstream u {{
        server 0.0.0.1;
        balancer_by_lua_block {{ require("kvgate.balancer.chash").balance(UNIX_POOL) }}
        keepalive 8;
    }}
    server {{ listen unix:{sock}; location / {{ return 200 "sock"; }} }}
    server {{ listen 127.0.0.1:{tcp}; location / {{ return 200 "tcp"; }} }}
    server {{
        listen 127.0.0.1:{listen};
        set $kvgate_route_key $http_x_key;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        location / {{ add_header X-Up $upstream_addr always; proxy_pass http://u; }}
    }}"""))
    subprocess.run(["nginx", "-p", str(prefix), "-c", "conf/nginx.conf"], check=True)
    try:
        ring = Ring([("sock", 100), ("tcp", 100)])
        http = requests.Session()
        deadline = time.monotonic() + 10
        while True:
            try:
                http.get(f"http://127.0.0.1:{listen}/", timeout=2)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, (prefix / "logs" / "error.log").read_text()
                time.sleep(0.05)
        seen = set()
        for i in range(60):
            key = f"s:unix-{i}"
            r = http.get(f"http://127.0.0.1:{listen}/", headers={"X-Key": key}, timeout=5)
            assert r.status_code == 200, (r.text, (prefix / "logs" / "error.log").read_text())
            assert r.text == ring.home(key_point(key))
            assert r.headers["X-Up"] == (f"unix:{sock}" if r.text == "sock" else f"127.0.0.1:{tcp}")
            seen.add(r.text)
        assert seen == {"sock", "tcp"}
    finally:
        subprocess.run(["nginx", "-p", str(prefix), "-c", "conf/nginx.conf", "-s", "stop"], check=False)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_pool_with_one_serving_node_passes_its_own_503_on(start_mocks, start_gateway) -> None:
    # as with nginx's native hash: no node to fail over to, so no retry; the engine's answer
    # (say, vLLM refusing while overloaded) reaches the client, and the node is not marked failed
    [mock] = start_mocks(1, prefix="one")
    gw = start_gateway([mock], None, cache={"enabled": False})
    mock.set(status=503)
    r = gw.chat("busy?", headers={"X-Session-Id": "s1"})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == "mock one1 answers 503", r.text  # the engine's body, not the gateway's
    assert len(mock.completions()) == 1  # tried once
    mock.set(status=200)
    r = gw.chat("fine now", headers={"X-Session-Id": "s1"})
    assert r.status_code == 200, r.text
