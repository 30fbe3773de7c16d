"""``kvgate bench gateway``: what kvgate's data path costs per request, side by side in one run.

Against one static upstream (an nginx, one worker, ``return 200`` with an OpenAI-shaped chat
completion on four ports, so every router sees the same free engine), at a 2 KB and a 40 KB
chat body (``wrk -t2 -c32``, a wrk Lua script POSTing the body):

* ``bare``: a bare nginx ``proxy_pass`` (2 workers, the same in-memory body buffering as the
  gateway, upstream keepalive): the floor;
* ``floor: lua read`` / ``floor: lua decode+sha256``: that nginx with an ``access_by_lua`` that
  only reads the body into Lua, or reads it, ``cjson.safe.decode``s it and takes one sha256 of
  it (PLATFORM.md §13): what any data path that parses the JSON in Lua pays at least;
* ``miss``: kvgate, every request a cache **miss** with the whole miss path: the body is
  cacheable (``temperature: 0``) and its ``seed`` changes with every request (one counter in
  the wrk script), so each request computes its cache key, misses in Redis, is proxied, has
  its answer captured and stored;
* ``bypass``: kvgate, a non-cacheable request (``temperature: 0.7``): no cache key, no Redis;
* ``hit``: kvgate, the same cacheable body every time, answered from Redis (the share of
  answers that were hits is read from kvgate's own ``kvgate_requests_total`` and printed);
* ``sglang-router`` / ``vllm-router`` (round robin) when ``--peers-venv`` holds them.

Then one connection (``wrk -t1 -c1``) per path and size for the latency kvgate adds to a bare
nginx (p50/p99 difference). kvgate runs as rendered from a policy (2 workers, chash, cache on,
Redis on a free port, debug headers off), exactly as ``kvgate up`` renders it. Every path
shares the machine with the load generator, so compare within one run; the table prints
ratios to bare nginx and to the best peer. Figures: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import click

from ..render import default_lua_dir
from .balancer import bare_nginx_conf

MODEL = "bench-model"
SIZES = {"2KB": 2048, "40KB": 40960}
NODES = 4

# the answer every path gets: cacheable (finish_reason, usage) and small
ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
}, separators=(",", ":"))

# The body is built once per run as HEAD .. <number> .. TAIL: the seed varies per request for a
# miss and stays 1 for a hit (the same concatenation either way, so wrk works alike)
WRK_SCRIPT = """
local head = %(head)s
local tail = %(tail)s
local vary = %(vary)s
local n = 0
local hdrs = { ["Content-Type"] = "application/json" }
local key = %(key)s
if key then hdrs["Authorization"] = "Bearer " .. key end
request = function()
    n = n + 1
    return wrk.format("POST", "/v1/chat/completions", hdrs, head .. (vary and n or 1) .. tail)
end
"""


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_body(size: int, temperature: float, vary: str = "seed") -> tuple[str, str]:
    """(head, tail) of a chat request of about ``size`` bytes whose ``vary`` field's number goes
    between them: a system prompt and a user message of English-like ASCII words. ``seed``
    makes a request cacheable (a new seed: a new cache key); ``max_tokens`` does not."""
    words = ("the quick brown fox jumps over a lazy dog while seven engines share their prefix "
             "cache blocks across every turn of the conversation ").split()
    text, i = [], 0
    budget = max(64, size - 220)
    total = 0
    while total < budget:
        w = words[i % len(words)]
        text.append(w)
        total += len(w) + 1
        i += 1
    user = " ".join(text)
    sys_prompt = "You are a helpful assistant. Answer briefly."
    doc: dict = {"model": MODEL, "temperature": temperature, "max_tokens": 16,
                 "messages": [{"role": "system", "content": sys_prompt}, {"role": "user", "content": user}]}
    doc.pop(vary, None)
    head = json.dumps(doc, separators=(",", ":"))
    head = head[:-1] + f',"{vary}":'
    return head, "}"


def _lua_str(s: str) -> str:
    return "[==[" + s + "]==]"


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    cpu_us: float = float("nan")
    """CPU time of the path's own processes (nginx workers, or the router) per request, µs:
    far steadier than requests/s on a shared machine."""


def _ms(v: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", v)
    if not m:
        return float("nan")
    x = float(m.group(1))
    return x / 1000 if m.group(2) == "us" else x * 1000 if m.group(2) == "s" else x


def run_wrk(url: str, script: Path, seconds: float, connections: int, threads: int) -> Result:
    """One wrk run with ``--latency``; raises RuntimeError on errors or non-2xx answers."""
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
                          "--latency", "-s", str(script), url], capture_output=True, text=True,
                         timeout=seconds + 60)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    n = re.search(r"(\d+) requests in", out.stdout)
    p50 = re.search(r"\s50%\s+(\S+)", out.stdout)
    p99 = re.search(r"\s99%\s+(\S+)", out.stdout)
    if out.returncode != 0 or not (m and n and p50 and p99) or "Non-2xx" in out.stdout \
            or "Socket errors" in out.stdout:
        raise RuntimeError(f"wrk against {url} failed:\n{out.stdout}\n{out.stderr}")
    return Result(float(m.group(1)), _ms(p50.group(1)), _ms(p99.group(1)), int(n.group(1)))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (``/proc/PID/stat``, all threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def nginx_workers(prefix: Path) -> list[int]:
    """The worker pids of the nginx whose pid file is under ``prefix``."""
    master = int((prefix / "logs" / "nginx.pid").read_text())
    return [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]


def _wait_http(url: str, timeout: float, what: str, data: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception as exc:  # noqa: BLE001 - any failure means not ready yet
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout} s: {last}")


def _metric(url: str, name: str, **labels: str) -> float:
    """Sum of ``name`` over samples whose labels include ``labels`` on a Prometheus page."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Fleet:
    """The processes of one benchmark run, stopped in reverse order on close."""

    def __init__(self, base: Path):
        self.base = base
        self.stack = ExitStack()
        self.upstream_ports = [_free_port() for _ in range(NODES)]
        self.pids: dict[str, Callable[[], list[int]]] = {}
        self.api_key = ""
        """the tenant gateway's API key (start_kvgate(tenants=True))"""
        """url key -> the pids whose CPU a path's requests cost"""

    def close(self) -> None:
        self.stack.close()

    def _nginx(self, name: str, conf: str) -> Path:
        prefix = self.base / name
        for d in ("conf", "logs", "tmp"):
            (prefix / d).mkdir(parents=True, exist_ok=True)
        (prefix / "conf" / "nginx.conf").write_text(conf)
        subprocess.run(["nginx", "-p", str(prefix), "-c", "conf/nginx.conf"], check=True)
        self.stack.callback(subprocess.run, ["nginx", "-p", str(prefix), "-c", "conf/nginx.conf", "-s", "stop"],
                            check=False)
        return prefix

    def start_upstream(self) -> None:
        """One nginx worker answering every path of a fake engine on NODES ports."""
        listens = "\n".join(f"        listen 127.0.0.1:{p};" for p in self.upstream_ports)
        info = json.dumps({"model_path": MODEL, "dp_size": 1, "tp_size": 1})
        models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})
        self._nginx("upstream", bare_nginx_conf(default_lua_dir(), workers=1, connections=4096, http_body=f"""
    server {{
{listens}
        default_type application/json;
        client_max_body_size 1m;
        location = /v1/models {{ return 200 '{models}'; }}
        location ~ ^/(health|health_generate)$ {{ return 200 'OK'; }}
        location ~ ^/(get_)?(model|server)_info$ {{ return 200 '{info}'; }}
        location / {{ return 200 '{ANSWER}'; }}
    }}"""))
        for p in self.upstream_ports:
            _wait_http(f"http://127.0.0.1:{p}/health", 10, "the static upstream")

    def start_bare(self) -> dict[str, str]:
        """A bare nginx proxy_pass (2 workers), buffering bodies in memory as kvgate does, and
        on two more ports of the same nginx the floors of any Lua data path that reads JSON
        (PLATFORM.md §13): ``lua read`` (the body read into a Lua string, then proxied) and
        ``lua decode+sha256`` (that, plus one ``cjson.safe.decode`` and one sha256 of the
        body). -> {url key: url} for ``bare``, ``floor read``, ``floor decode``."""
        ports = {"bare": _free_port(), "floor read": _free_port(), "floor decode": _free_port()}
        servers = "\n".join(f"        server 127.0.0.1:{p};" for p in self.upstream_ports)
        proxy = """
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;"""
        lua = {
            "bare": "",
            "floor read": """
            access_by_lua_block {
                ngx.req.read_body()
                local body = ngx.req.get_body_data()
            }""",
            "floor decode": """
            access_by_lua_block {
                ngx.req.read_body()
                local body = ngx.req.get_body_data()
                if body then
                    if not cjson.decode(body) then return ngx.exit(400) end
                    sha:reset()
                    sha:update(body)
                    sha:final()
                end
            }""",
        }
        blocks = "".join(f"""
    server {{
        listen 127.0.0.1:{ports[key]};
        client_max_body_size 1m;
        client_body_buffer_size 1m;
        client_body_in_single_buffer on;
        location / {{{lua[key]}{proxy}
        }}
    }}""" for key in ports)
        self._nginx("bare", bare_nginx_conf(default_lua_dir(), workers=2, connections=4096, http_body=f"""
    init_by_lua_block {{
        cjson = require("cjson.safe")
        sha = require("nginx.sha256"):new()
    }}
    upstream engines {{
{servers}
        keepalive 64;
    }}{blocks}"""))
        prefix = self.base / "bare"
        urls = {}
        for key, port in ports.items():
            urls[key] = f"http://127.0.0.1:{port}"
            _wait_http(urls[key] + "/health", 10, "bare nginx")
            self.pids[key] = lambda: nginx_workers(prefix)
        return urls

    def start_redis(self) -> str:
        port = _free_port()
        d = self.base / "redis"
        d.mkdir()
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(d), "--logfile", str(d / "redis.log")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.stack.callback(_stop, proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def start_kvgate(self, redis_url: str, lua_dir: Path | None, tenants: bool = False) -> str:
        """kvgate rendered from a policy exactly as ``kvgate up`` does (2 workers, cache on).
        ``tenants``: with ``gateway.auth: required`` and one tenant with three limits (rpm, tpm,
        concurrency; too high to refuse anything), its API key in :attr:`api_key`."""
        from ..nginxctl import Nginx
        from ..policy.loader import parse_policy

        port = _free_port()
        # a free internal listener too: the default 127.0.0.1:9080 may be a running stack's
        gateway: dict = {"listen": f"127.0.0.1:{port}", "worker_processes": 2, "max_body_bytes": 1048576,
                         "internal_listen": f"127.0.0.1:{_free_port()}"}
        doc: dict = {
            "version": 1, "gateway": gateway, "redis": {"url": redis_url, "managed": False},
            "cache": {"enabled": True},
            "pools": [{"name": "bench", "models": [MODEL], "balancer": "chash",
                       "nodes": [{"id": f"n{i + 1}", "url": f"http://127.0.0.1:{p}"}
                                 for i, p in enumerate(self.upstream_ports)]}],
        }
        if tenants:
            gateway["auth"] = "required"
            doc["tenants"] = [{"id": "bench", "limits": {"rpm": 10**9, "tpm": 10**12, "concurrency": 10**6}}]
        policy = parse_policy(doc, "bench-policy")
        name = "kvgate-t" if tenants else "kvgate"
        if tenants:
            from ..control.apikeys import ApiKeys
            from ..control.store import Store

            _, self.api_key = ApiKeys(Store(redis_url)).create("bench", "bench gateway")
        nginx = Nginx(self.base / name, lua_dir=lua_dir or default_lua_dir())
        self.stack.callback(nginx.stop, timeout=5)
        nginx.apply(policy)
        nginx.wait_ready(policy.gateway.listen)
        prefix = self.base / name
        self.pids[name] = lambda: nginx_workers(prefix)
        return f"http://127.0.0.1:{port}"

    def start_peer(self, venv: Path, name: str) -> str | None:
        """sglang-router or vllm-router (round robin) over the upstream, or None when the venv
        lacks it."""
        exe = venv / "bin" / name
        if not exe.exists():
            return None
        port = _free_port()
        workers = [f"http://127.0.0.1:{p}" for p in self.upstream_ports]
        if name == "sglang-router":
            cmd = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                   "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(_free_port()), "--log-level", "warn"]
        else:
            cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                   "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(_free_port()), "--log-level", "warning"]
        log = open(self.base / f"{name}.log", "wb")
        self.stack.callback(log.close)
        env = dict(os.environ, HF_HUB_OFFLINE="1", RUST_LOG="warn")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.stack.callback(_stop, proc)
        url = f"http://127.0.0.1:{port}"
        head, tail = chat_body(256, 0.7)
        _wait_http(url + "/v1/chat/completions", 60, name, data=(head + "1" + tail).encode())
        self.pids[name] = lambda: [proc.pid]
        return url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM) if os.getpgid(proc.pid) == proc.pid else proc.terminate()
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass
class Report:
    rows: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    one: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    hit_share: dict[str, float] = field(default_factory=dict)

    def median(self, table: dict[tuple[str, str], list[Result]], key: tuple[str, str]) -> Result | None:
        rs = table.get(key)
        if not rs:
            return None
        return Result(statistics.median(r.rps for r in rs), statistics.median(r.p50_ms for r in rs),
                      statistics.median(r.p99_ms for r in rs), sum(r.requests for r in rs),
                      statistics.median(r.cpu_us for r in rs))


def benchmark(seconds: float, rounds: int, connections: int, threads: int, peers_venv: Path | None,
              sizes: list[str], one_seconds: float, lua_dir: Path | None = None,
              echo=print, only: tuple[str, ...] = ()) -> Report:
    """Run every path at every size; return the medians' raw material."""
    report = Report()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-gateway-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            fleet.start_upstream()
            redis_url = fleet.start_redis()
            urls = fleet.start_bare()
            urls["kvgate"] = fleet.start_kvgate(redis_url, lua_dir)
            urls["kvgate-t"] = fleet.start_kvgate(redis_url, lua_dir, tenants=True)
            peers = []
            if peers_venv:
                for name in ("sglang-router", "vllm-router"):
                    u = fleet.start_peer(peers_venv, name)
                    if u:
                        urls[name] = u
                        peers.append(name)
                    else:
                        echo(f"({name} not in {peers_venv}: skipped)")
            scripts: dict[tuple[str, str], Path] = {}
            for size in sizes:
                for kind, temp, vary in (("miss", 0, True), ("bypass", 0.7, True), ("hit", 0, False),
                                         ("miss-t", 0, True)):
                    head, tail = chat_body(SIZES[size], temp, "max_tokens" if kind == "bypass" else "seed")
                    p = Path(tmp) / f"wrk-{kind}-{size}.lua"
                    p.write_text(WRK_SCRIPT % {"head": _lua_str(head), "tail": _lua_str(tail),
                                               "vary": "true" if vary else "false",
                                               "key": _lua_str(fleet.api_key) if kind == "miss-t" else "nil"})
                    scripts[(kind, size)] = p
                # the hit path's entry, stored before any hit is measured
                head, tail = chat_body(SIZES[size], 0)
                body = (head + "1" + tail).encode()
                _wait_http(urls["kvgate"] + "/v1/chat/completions", 5, "kvgate", data=body)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    req = urllib.request.Request(urls["kvgate"] + "/v1/chat/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=5) as r:
                        if r.headers.get("X-Kvgate-Cache") == "HIT":
                            break
                    time.sleep(0.05)
                else:
                    raise RuntimeError("the hit path's entry was never stored")
            # (path label, url key, script kind)
            paths = [("bare", "bare", "bypass"), ("floor: lua read", "floor read", "bypass"),
                     ("floor: lua decode+sha256", "floor decode", "bypass"), ("kvgate miss", "kvgate", "miss"),
                     ("kvgate bypass", "kvgate", "bypass"), ("kvgate hit", "kvgate", "hit"),
                     ("kvgate miss +auth+limits", "kvgate-t", "miss-t")]
            paths += [(p, p, "bypass") for p in peers]
            if only:
                paths = [p for p in paths if p[0] in only or p[0] == "bare"]
            for size in sizes:  # warm every path (connections, JIT)
                for label, key, kind in paths:
                    run_wrk(urls[key], scripts[(kind, size)], 1, connections, threads)
            for r in range(rounds):
                for size in sizes:
                    for label, key, kind in paths:
                        metrics_url = urls["kvgate"] + "/metrics"
                        hits0 = _metric(metrics_url, "kvgate_requests_total", cache="HIT") if kind == "hit" \
                            and key == "kvgate" else 0
                        pids = fleet.pids[key]()
                        cpu0 = cpu_seconds(pids)
                        res = run_wrk(urls[key], scripts[(kind, size)], seconds, connections, threads)
                        res.cpu_us = (cpu_seconds(pids) - cpu0) * 1e6 / max(1, res.requests)
                        report.rows.setdefault((label, size), []).append(res)
                        if kind == "hit" and key == "kvgate":
                            time.sleep(0.3)
                            hits = _metric(metrics_url, "kvgate_requests_total", cache="HIT") - hits0
                            # kvgate also counts what wrk left in flight at its end: cap at 1
                            report.hit_share[size] = min(1.0, hits / max(1, res.requests))
                        echo(f"  round {r + 1} {size:>4} {label:<14} {res.rps:9.0f} req/s  "
                             f"p50 {res.p50_ms:6.2f} ms  p99 {res.p99_ms:6.2f} ms  {res.cpu_us:6.1f} us CPU/req")
                    for label, key, kind in paths:
                        if label in ("kvgate bypass", "kvgate miss +auth+limits") or label.startswith("floor"):
                            continue
                        res = run_wrk(urls[key], scripts[(kind, size)], one_seconds, 1, 1)
                        report.one.setdefault((label, size), []).append(res)
        finally:
            fleet.close()
    return report


def render(report: Report, sizes: list[str], header: str) -> str:
    """The result table (markdown), ratios to bare nginx and to the best peer."""
    lines = [header, "",
             "| size | path | req/s | vs bare nginx | vs best peer | p50 ms | p99 ms | CPU µs/req "
             "| 1-conn p50 ms | 1-conn p99 ms | 1-conn p99 added ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    labels = []
    for (label, _size) in report.rows:
        if label not in labels:
            labels.append(label)
    for size in sizes:
        bare = report.median(report.rows, ("bare", size))
        bare1 = report.median(report.one, ("bare", size))
        peer_rps = [report.median(report.rows, (lb, size)).rps for lb in labels
                    if lb.endswith("-router") and (lb, size) in report.rows]
        best = max(peer_rps) if peer_rps else None
        for label in labels:
            m = report.median(report.rows, (label, size))
            if not m:
                continue
            one = report.median(report.one, (label, size))
            vs_bare = f"{m.rps / bare.rps:.3f}" if bare else "-"
            vs_peer = f"{m.rps / best:.2f}" if best else "-"
            c50 = f"{one.p50_ms:.2f}" if one else "-"
            c99 = f"{one.p99_ms:.2f}" if one else "-"
            add = f"{one.p99_ms - bare1.p99_ms:+.2f}" if one and bare1 and label != "bare" else "-"
            lines.append(f"| {size} | {label} | {m.rps:,.0f} | {vs_bare} | {vs_peer} | {m.p50_ms:.2f} | "
                         f"{m.p99_ms:.2f} | {m.cpu_us:.0f} | {c50} | {c99} | {add} |")
    for size in sizes:
        miss = report.median(report.rows, ("kvgate miss", size))
        hit = report.median(report.rows, ("kvgate hit", size))
        if miss and hit:
            lines.append("")
            lines.append(f"{size}: hit/miss {hit.rps / miss.rps:.2f}; "
                         f"hits among the hit path's answers {report.hit_share.get(size, 0):.1%}")
        tenants = report.median(report.rows, ("kvgate miss +auth+limits", size))
        if miss and tenants:
            lines.append(f"{size}: miss with an API key and three limits (rpm, tpm, concurrency) / without "
                         f"{tenants.rps / miss.rps:.2f} req/s, {tenants.cpu_us - miss.cpu_us:+.0f} µs CPU/req")
    return "\n".join(lines)


@click.command("gateway")
@click.option("--seconds", default=5.0, show_default=True, help="Seconds per wrk run.")
@click.option("--rounds", default=1, show_default=True, help="Rounds over every path (the table gives medians).")
@click.option("--connections", default=32, show_default=True, help="wrk connections.")
@click.option("--threads", default=2, show_default=True, help="wrk threads.")
@click.option("--one-seconds", default=5.0, show_default=True, help="Seconds of the one-connection runs.")
@click.option("--size", "sizes", multiple=True, type=click.Choice(sorted(SIZES)), help="Body sizes [default: both].")
@click.option("--peers-venv", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A venv with sglang-router and/or vllm-router (pip install sglang-router vllm-router).")
@click.option("--lua-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="kvgate's Lua modules [default: the installed ones].")
@click.option("--only", multiple=True, help="Measure only these paths (e.g. 'kvgate miss'; bare always runs).")
def gateway_command(seconds: float, rounds: int, connections: int, threads: int, one_seconds: float,
                    sizes: tuple[str, ...], peers_venv: Path | None, lua_dir: Path | None,
                    only: tuple[str, ...]) -> None:
    """kvgate's data path against bare nginx and the Rust peer routers, on a static upstream."""
    for b in ("wrk", "nginx", "redis-server"):
        if not shutil.which(b):
            click.echo(f"error: {b} is not installed (apt-get install wrk nginx redis-server)", err=True)
            sys.exit(1)
    chosen = sorted(sizes or SIZES, key=lambda s: SIZES[s])
    click.echo(f"kvgate bench gateway: wrk -t{threads} -c{connections}, {seconds:g} s x {rounds} round(s), "
               f"{os.cpu_count()} CPUs; miss = cacheable body (temperature 0) with a new seed per request; "
               f"bypass = temperature 0.7, no seed (not cacheable; max_tokens varies)")
    try:
        report = benchmark(seconds, rounds, connections, threads, peers_venv, chosen, one_seconds, lua_dir,
                           echo=click.echo, only=only)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo("")
    click.echo(render(report, chosen, f"medians of {rounds} round(s); 1-conn = wrk -t1 -c1 for {one_seconds:g} s; "
                                      "added = kvgate's p99 minus bare nginx's"))


@click.group("bench")
def bench_command() -> None:
    """Benchmarks that print numbers (the trace replay is `kvgate replay`)."""


from .hot_session import hot_session_command  # noqa: E402  (kvgate bench hot-session)
from .peers import peers_command  # noqa: E402  (kvgate bench peers: the peer routers side by side)
from .costs import costs_command  # noqa: E402  (kvgate bench costs: the bill's sums against the engines')
from .batch import batch_command  # noqa: E402  (kvgate bench batch: the prefix-grouped Batch API against file order)
from .bill import bill_command  # noqa: E402  (kvgate bench bill: the mixed workload, baseline against kvgate)
from .scaleout import scaleout_command  # noqa: E402  (kvgate bench scaleout: hit ratio on 1, 2, 4 engines)
from .render import render_command  # noqa: E402  (kvgate bench render: apply steps and reconcile CPU at 1,000 nodes)
from kvgate.semantic.bench import semantic_bench_command  # noqa: E402  (kvgate bench semantic: labelled set, latency)

bench_command.add_command(gateway_command)
bench_command.add_command(hot_session_command)
bench_command.add_command(peers_command)
bench_command.add_command(costs_command)
bench_command.add_command(batch_command)
bench_command.add_command(bill_command)
bench_command.add_command(scaleout_command)
bench_command.add_command(render_command)

bench_command.add_command(semantic_bench_command)
