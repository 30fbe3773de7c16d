"""The nginx renderer: the demo policy renders, nginx -t accepts it, balancers and weights."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest

from kvgate.nginxctl import Nginx, NginxError
from kvgate.policy.loader import load_policy, parse_policy
from kvgate.render import (Runtime, data_config, default_lua_dir, render, runtime_document, runtime_json,
                           static_digest, static_identity)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "policies" / "demo.yaml"

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed")


def _policy(**pool_overrides):
    pool = {
        "name": "p1",
        "models": ["m1", "m2"],
        "nodes": [
            {"id": "a", "url": "http://127.0.0.1:9001", "weight": 3},
            {"id": "b", "url": "http://127.0.0.1:9002"},
        ],
    }
    pool.update(pool_overrides)
    return parse_policy({"version": 1, "pools": [pool]})


def _upstream(conf: str, name: str) -> str:
    # up to the block's own closing brace (a balancer_by_lua_block has braces inside)
    m = re.search(r"upstream " + name + r" \{(.*?)\n    \}", conf, re.S)
    assert m, conf
    return m.group(1)


def test_default_lua_dir() -> None:
    assert (default_lua_dir() / "kvgate" / "gateway.lua").is_file()


def test_demo_renders_both_files() -> None:
    files = render(load_policy(DEMO), default_lua_dir())
    assert set(files) >= {"conf/nginx.conf", "conf/kvgate.json"}
    conf = files["conf/nginx.conf"]
    assert "load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;" in conf
    assert "pid logs/nginx.pid;" in conf
    assert "error_log logs/error.log" in conf
    assert f'lua_package_path "{default_lua_dir()}/?.lua;;";' in conf
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert f"{temp}_temp_path tmp/" in conf
    data = json.loads(files["conf/kvgate.json"])
    assert data["models"] == {"demo-model": "default"}
    assert data["nodes_by_addr"]["127.0.0.1:8101"] == "n1"
    assert data["pools"]["default"]["session_header"] == "X-Session-Id"
    assert data["cache"]["namespace_version"] == 1
    # lowercase, in the policy's order: ngx.req.get_headers() keys are lowercase
    assert data["cache"]["credential_headers"] == ["authorization", "api-key", "x-api-key"]
    assert data["redis"] == {"host": "127.0.0.1", "port": 6390, "db": 0, "timeout_ms": 200, "pool_size": 64}


def test_render_is_deterministic() -> None:
    p = load_policy(DEMO)
    assert render(p, default_lua_dir()) == render(p, default_lua_dir())


def test_chash_upstream_with_weights() -> None:
    files = render(_policy(), default_lua_dir())
    up = _upstream(files["conf/nginx.conf"], "pool_p1")
    # the Lua ring (kvgate.balancer.chash) picks the node; the server lines stay for nginx -t
    assert 'require("kvgate.balancer").balance("p1")' in up
    assert "hash $kvgate_route_key" not in up
    # one server line per node (nginx -t checks the hosts), without weight or down: the weights
    # (300 and 100 here) are the runtime's, in kvgate.json only as defaults
    assert "server 127.0.0.1:9001;  # a" in up
    assert "server 127.0.0.1:9002;  # b" in up
    assert "weight=" not in up and " down" not in up
    # the balancer directive must precede keepalive
    assert up.index("balancer_by_lua_block") < up.index("keepalive 64;")
    pool = json.loads(files["conf/kvgate.json"])["pools"]["p1"]
    assert pool["balancer"] == "chash_bounded"  # the default
    assert pool["bound_factor"] == 1.25 and pool["saturated_queue"] == 16  # defaults too
    assert pool["nodes"] == [
        {"id": "a", "address": "127.0.0.1:9001", "peer": "127.0.0.1:9001", "weight": 300},
        {"id": "b", "address": "127.0.0.1:9002", "peer": "127.0.0.1:9002", "weight": 100},
    ]
    # a node taken out (weight 0) is the runtime's: pushed, the static files stay as they are
    down = Runtime(weights={"b": 0})
    assert render(_policy(), default_lua_dir(), down) == files
    assert runtime_document(_policy(), down)["pools"]["p1"]["nodes"]["b"] == {"weight": 0, "state": "down",
                                                                             "home_weight": 100}


def test_node_hosts_are_resolved_for_the_lua_balancer(monkeypatch: pytest.MonkeyPatch) -> None:
    # set_current_peer resolves nothing: the peer is an IP (IPv4 first), and $upstream_addr maps back
    def fake(host, port, family=0, *_a, **_k):
        if host != "gpu1.internal":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if family == socket.AF_INET6:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", port, 0, 0))]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    p = _policy(nodes=[{"id": "a", "url": "http://gpu1.internal:8000"}, {"id": "b", "url": "http://127.0.0.1:9002"}])
    data = json.loads(render(p, default_lua_dir())["conf/kvgate.json"])
    assert [n["peer"] for n in data["pools"]["p1"]["nodes"]] == ["10.0.0.7:8000", "127.0.0.1:9002"]
    assert data["nodes_by_addr"]["10.0.0.7:8000"] == "a" and data["nodes_by_addr"]["gpu1.internal:8000"] == "a"
    # a host that does not resolve stays a name: its server line fails nginx -t, as before
    data = json.loads(render(_policy(nodes=[{"id": "a", "url": "http://gpu9.invalid:8000"}]),
                             default_lua_dir())["conf/kvgate.json"])
    assert data["pools"]["p1"]["nodes"][0]["peer"] == "gpu9.invalid:8000"


def test_round_robin_and_least_conn() -> None:
    # every balancer is kvgate.balancer's (Lua), chosen by name from the runtime: the upstream
    # block is the same for all three, and a switch (overload degrade) is a push
    ch = _upstream(render(_policy(), default_lua_dir())["conf/nginx.conf"], "pool_p1")
    rr = _upstream(render(_policy(balancer="round_robin"), default_lua_dir())["conf/nginx.conf"], "pool_p1")
    assert "hash " not in rr and "least_conn;" not in rr  # (the comment names every balancer)
    lc = _upstream(render(_policy(balancer="least_conn"), default_lua_dir())["conf/nginx.conf"], "pool_p1")
    assert "least_conn;" not in lc and "hash " not in lc
    assert ch == rr == lc and 'require("kvgate.balancer").balance("p1")' in lc
    assert "hash " not in _upstream(
        render(load_policy(DEMO).with_balancer("round_robin"), default_lua_dir())["conf/nginx.conf"], "pool_default"
    )
    for name in ("round_robin", "least_conn"):
        assert json.loads(render(_policy(balancer=name), default_lua_dir())["conf/kvgate.json"])["pools"]["p1"][
            "balancer"] == name  # the default of a gateway without runtime.json
        assert runtime_document(_policy(balancer=name))["pools"]["p1"]["balancer"] == name
        assert runtime_document(_policy(), Runtime(balancers={"p1": name}))["pools"]["p1"]["balancer"] == name
    # the policy's balancer is a runtime default: changing only it changes no digest
    digest = {json.loads(render(_policy(balancer=b), default_lua_dir())["conf/kvgate.json"])["digest"]
              for b in ("chash", "round_robin", "least_conn")}
    assert len(digest) == 1


def test_limits_and_timeouts() -> None:
    p = parse_policy({
        "version": 1,
        "gateway": {"max_body_bytes": 4096, "connect_timeout_s": 0.5, "read_timeout_s": 30},
        "pools": [{"name": "p", "models": ["m"], "nodes": [{"id": "a", "url": "http://127.0.0.1:9001"}]}],
    })
    conf = render(p, default_lua_dir())["conf/nginx.conf"]
    assert "client_max_body_size 4096;" in conf
    assert "client_body_buffer_size 4096;" in conf
    assert "proxy_connect_timeout 500ms;" in conf
    assert "proxy_read_timeout 30000ms;" in conf
    assert "proxy_next_upstream_tries 2;" in conf
    assert "proxy_buffering off;" in conf


@needs_nginx
@pytest.mark.parametrize("balancer", ["chash", "round_robin", "least_conn"])
def test_nginx_accepts_rendered_config(tmp_path: Path, balancer: str) -> None:
    Nginx(tmp_path / "prefix").test(render(load_policy(DEMO).with_balancer(balancer), default_lua_dir()))


@needs_nginx
def test_nginx_rejects_broken_config_with_emerg_line(tmp_path: Path) -> None:
    files = render(load_policy(DEMO), default_lua_dir())
    files["conf/nginx.conf"] = files["conf/nginx.conf"].replace("proxy_buffering off;", "proxy_buffering sideways;")
    with pytest.raises(NginxError, match=r"\[emerg\].*proxy_buffering"):
        Nginx(tmp_path / "prefix").test(files)


def test_bad_data_config_is_rejected_before_install(tmp_path: Path) -> None:
    files = render(load_policy(DEMO), default_lua_dir())
    files["conf/kvgate.json"] = "{not json"
    with pytest.raises(NginxError, match="kvgate"):
        Nginx(tmp_path / "prefix").test(files)


@needs_nginx
def test_start_fails_loudly_when_lua_init_fails(tmp_path: Path) -> None:
    # nginx -t does not run init_by_lua: a data config the Lua refuses shows at start
    ngx = Nginx(tmp_path / "prefix")
    files = render(_policy(), default_lua_dir())
    (tmp_path / "prefix" / "conf").mkdir(parents=True)
    (tmp_path / "prefix" / "conf" / "nginx.conf").write_text(files["conf/nginx.conf"].replace("127.0.0.1:8080", "127.0.0.1:1"))
    (tmp_path / "prefix" / "conf" / "kvgate.json").write_text("[]")
    with pytest.raises(NginxError, match="kvgate"):
        ngx.start()
    assert ngx.pid() is None


def _redis_policy(url: str):
    return parse_policy({
        "version": 1,
        "redis": {"url": url},
        "pools": [{"name": "p", "models": ["m"], "nodes": [{"id": "a", "url": "http://127.0.0.1:9001"}]}],
    })


def test_redis_host_name_is_resolved_for_lua_cosockets() -> None:
    # Lua cosockets resolve nothing without a `resolver`: kvgate.json must hold an IP
    data = json.loads(render(_redis_policy("redis://localhost:6390/2"), default_lua_dir())["conf/kvgate.json"])
    assert data["redis"]["host"] == "127.0.0.1"
    assert data["redis"]["port"] == 6390 and data["redis"]["db"] == 2


def test_redis_ip_literal_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dns(*_a, **_k):
        raise AssertionError("an IP literal must not be looked up")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    data = json.loads(render(_redis_policy("redis://10.1.2.3:6379/0"), default_lua_dir())["conf/kvgate.json"])
    assert data["redis"]["host"] == "10.1.2.3"


def test_redis_host_prefers_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(host, port, family=0, *_a, **_k):
        assert host == "redis.internal"
        if family == socket.AF_INET6:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", port, 0, 0))]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    data = json.loads(render(_redis_policy("redis://redis.internal:6379/0"), default_lua_dir())["conf/kvgate.json"])
    assert data["redis"]["host"] == "10.0.0.5"


def test_unresolvable_redis_host_fails_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a, **_k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(ValueError, match=r"redis\.url.*no-such-redis\.invalid"):
        render(_redis_policy("redis://no-such-redis.invalid:6390/0"), default_lua_dir())


def test_failover_retries_posts_that_were_sent() -> None:
    # without non_idempotent nginx never passes a POST on after sending it to a node
    conf = render(load_policy(DEMO), default_lua_dir())["conf/nginx.conf"]
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in conf


def test_static_files_do_not_depend_on_the_runtime() -> None:
    # weights, node states, balancer switches and the namespace version are pushed, never rendered
    p = _policy()
    plain = render(p, default_lua_dir())
    busy = Runtime(weights={"a": 0, "b": 17}, balancers={"p1": "least_conn"}, namespace_version=42,
                   states={"a": "draining", "b": "ramping"})
    assert render(p, default_lua_dir(), busy) == plain


def test_digest_leaves_out_the_runtime_defaults() -> None:
    # kvgate.json keeps the policy's base weights, balancer and namespace as the Lua's defaults (no
    # runtime.json yet); a policy changing only those has the same digest: a push, not a reload
    a = data_config(_policy())
    b = data_config(parse_policy({"version": 1, "cache": {"namespace_version": 7}, "pools": [{
        "name": "p1", "models": ["m1", "m2"], "balancer": "round_robin",
        "nodes": [{"id": "a", "url": "http://127.0.0.1:9001", "weight": 5}, {"id": "b", "url": "http://127.0.0.1:9002"}],
    }]}))
    assert a != b
    assert a["pools"]["p1"]["balancer"] == "chash_bounded" and b["pools"]["p1"]["balancer"] == "round_robin"
    assert [n["weight"] for n in b["pools"]["p1"]["nodes"]] == [500, 100] and b["cache"]["namespace_version"] == 7
    assert static_identity(a) == static_identity(b)
    assert static_digest("conf", a) == static_digest("conf", b)
    assert static_digest("conf", a) != static_digest("conf2", a)
    # anything else is structural
    c = data_config(_policy(prefix_chars=4096))
    assert static_digest("conf", c) != static_digest("conf", a)


def test_kvgate_json_carries_the_push_secret_sha256() -> None:
    files = render(_policy(), default_lua_dir(), push_secret_sha256="ab" * 32)
    assert json.loads(files["conf/kvgate.json"])["internal"] == {"push_secret_sha256": "ab" * 32}
    # without a secret: a gateway that refuses every push (fine for nginx -t)
    assert json.loads(render(_policy(), default_lua_dir())["conf/kvgate.json"])["internal"] == {"push_secret_sha256": ""}
    assert "ab" * 32 not in files["conf/nginx.conf"]


def test_runtime_document_shape() -> None:
    # the body of POST /kvgate/config and conf/runtime.json: every pool and node, no others
    p = parse_policy({"version": 1, "cache": {"namespace_version": 3}, "pools": [
        {"name": "p1", "models": ["m1"], "nodes": [{"id": "a", "url": "http://127.0.0.1:9001", "weight": 3},
                                                   {"id": "b", "url": "http://127.0.0.1:9002"}]},
        {"name": "p2", "models": ["m2"], "balancer": "round_robin",
         "nodes": [{"id": "c", "url": "http://127.0.0.1:9003"}]},
    ]})
    assert runtime_document(p) == {
        "pools": {
            "p1": {"balancer": "chash_bounded", "bound_factor": 1.25, "bound_load": "prefill_tokens",
                   "saturated_queue": 16,
                   "nodes": {"a": {"weight": 300, "state": "active", "home_weight": 300},
                             "b": {"weight": 100, "state": "active", "home_weight": 100}}},
            "p2": {"balancer": "round_robin", "bound_factor": 1.25, "bound_load": "prefill_tokens",
                   "saturated_queue": 16,
                   "nodes": {"c": {"weight": 100, "state": "active", "home_weight": 100}}},
        },
        "cache": {"namespace_version": 3},
    }
    rt = Runtime(weights={"a": 75, "b": 0, "x": 5}, balancers={"p2": "least_conn"}, namespace_version=9,
                 states={"a": "ramping", "b": "draining"})
    doc = runtime_document(p, rt)
    assert doc["pools"]["p1"]["nodes"] == {"a": {"weight": 75, "state": "ramping", "home_weight": 75},
                                           "b": {"weight": 0, "state": "draining", "home_weight": 100}}
    assert doc["pools"]["p2"] == {"balancer": "least_conn", "bound_factor": 1.25, "bound_load": "prefill_tokens",
                                  "saturated_queue": 16,
                                  "nodes": {"c": {"weight": 100, "state": "active", "home_weight": 100}}}
    # saturated_queue null: left out (the gateway then never skips a node for its queue)
    p3 = parse_policy({"version": 1, "pools": [{"name": "p1", "models": ["m1"], "bound_factor": 1.1,
                                                "saturated_queue": None,
                                                "nodes": [{"id": "a", "url": "http://127.0.0.1:9001"}]}]})
    assert "saturated_queue" not in runtime_document(p3)["pools"]["p1"]
    assert runtime_document(p3)["pools"]["p1"]["bound_factor"] == 1.1
    # home_weight: the runtime's serving weight when it has one (a drained node's target)
    rt2 = Runtime(weights={"a": 0, "b": 0}, home_weights={"a": 250})
    nodes = runtime_document(p, rt2)["pools"]["p1"]["nodes"]
    assert (nodes["a"]["home_weight"], nodes["b"]["home_weight"]) == (250, 100)
    assert doc["cache"] == {"namespace_version": 9}
    # the namespace never goes below the policy's
    assert runtime_document(p, Runtime(namespace_version=2))["cache"] == {"namespace_version": 3}
    # one text per document: sorted keys, compact
    assert runtime_json(doc) == runtime_json(json.loads(runtime_json(doc)))
    assert json.loads(runtime_json(doc)) == doc and " " not in runtime_json(doc)


def test_batch_secret_and_the_batch_api_routes(tmp_path: Path) -> None:
    """kvgate.json carries the batch principal's key ("" by default: refused); nginx.conf sends
    /v1/files* and /v1/batches* to control.listen (a wildcard host as loopback); Nginx writes
    kvgate.json readable by its owner only."""
    p = load_policy(DEMO)
    assert json.loads(render(p, default_lua_dir())["conf/kvgate.json"])["batch_secret"] == ""
    files = render(p, default_lua_dir(), batch_secret="ab" * 32)
    assert json.loads(files["conf/kvgate.json"])["batch_secret"] == "ab" * 32
    conf = files["conf/nginx.conf"]
    assert f"proxy_pass http://{p.control.listen};" in conf
    assert "location ~ ^/v1/files(/|$)" in conf and "location ~ ^/v1/batches(/|$)" in conf
    assert "location ~ ^/v1/((chat/)?completions|embeddings)$" in conf
    wild = p.model_copy(update={"control": p.control.model_copy(update={"listen": "0.0.0.0:9999"})})
    assert "proxy_pass http://127.0.0.1:9999;" in render(wild, default_lua_dir())["conf/nginx.conf"]
    nginx = Nginx(tmp_path / "prefix", batch_secret="cd" * 32)
    nginx.test(nginx.render(p))
    nginx._install(nginx.render(p))
    assert (nginx.prefix / "conf/kvgate.json").stat().st_mode & 0o777 == 0o600
