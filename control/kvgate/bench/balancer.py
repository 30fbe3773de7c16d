"""``python -m kvgate.bench.balancer``: what the Lua ``chash`` and ``chash_bounded`` balancers cost per request.

Two measurements, printed as one table:

* **nginx, side by side in one run.** One nginx (the system's, with the Lua module) holds
  four static upstream servers (``return 200``, in the same nginx) and two locations in
  front of them: ``/native`` through ``hash $kvgate_route_key consistent`` (what kvgate
  used before its ring moved to Lua) and ``/lua`` through ``kvgate.balancer.chash`` (a
  ``balancer_by_lua_block`` on the same four nodes), both with ``keepalive``, the same
  small ``access_by_lua_block`` that leaves the key where kvgate's route stage does, and the
  in-flight count where the gateway keeps it (``/native`` from the response headers, as kvgate
  counted before the balancer layer; ``/lua`` at the balancer's pick; both released in the
  log phase), and ``/bounded`` through ``kvgate.balancer.chash_bounded`` on the same ring
  (its load taken at the pick from ``kvgate_load``, released in the log phase; a GET has no
  body: every request is 1 estimated token). ``wrk`` sends
  a new session key with every request and alternates between the three for ``--rounds``
  rounds of ``--seconds`` each; the table gives the median requests/s of each and the
  nginx worker's CPU time per request (``/proc/PID/stat``; far steadier than requests/s on a
  shared machine), and the difference of the two: the Lua balancer's cost per request.
* **The ring alone** under plain ``luajit``: ``ring.find`` of random points on a 4-node
  ring at ``weight=100`` (64,000 points) and at the policy's cap ``weight=1000`` (640,000),
  and the time to build each.

Needs ``nginx`` (Debian's, with ``libnginx-mod-http-lua``), ``luajit`` and ``wrk`` (``apt-get
install wrk``; without it only the second part runs). Uses free loopback ports and a
temporary prefix; nothing else is touched. Figures: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

from ..render import default_lua_dir

WRK_SCRIPT = """
local n = 0
request = function()
    n = n + 1
    return wrk.format("GET", wrk.path, { ["X-Key"] = "s:bench-" .. n })
end
"""

MICRO = r"""
package.path = "%(lua)s/?.lua;" .. package.path
local ring = require "kvgate.balancer.ring"
local function bench(weight)
    local nodes = {}
    for i = 1, 4 do nodes[i] = { id = "n" .. i, weight = weight } end
    local t0 = os.clock()
    local r = assert(ring.new(nodes))
    local build = os.clock() - t0
    local points = {}
    local x = 12345
    for i = 1, 1000 do x = (x * 1103515245 + 12345) %% 4294967296; points[i] = x end
    local n, sink = 2000000, 0
    t0 = os.clock()
    for i = 1, n do
        local node = ring.find(r, points[i %% 1000 + 1])
        sink = sink + #node.id
    end
    local per = (os.clock() - t0) / n
    io.write(string.format("%%d %%d %%.6f %%.1f\n", weight, r.n, build, per * 1e9))
end
bench(100)
bench(1000)
"""


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bare_nginx_conf(lua_dir: Path | str, http_body: str, workers: int = 1, connections: int = 64) -> str:
    """A private nginx.conf that loads the Lua module and kvgate's modules from ``lua_dir`` and
    runs ``http_body`` (upstreams, servers, init_by_lua …) inside ``http { }``: the shared
    prologue (modules, pid and log under the prefix, temp paths, ``lua_package_path``, the
    ``kvgate_state`` dict the balancer marks failures in, ``kvgate_inflight`` it counts requests in) of the benchmark and of the tests
    that drive ``kvgate.balancer.chash`` without the rest of the gateway."""
    return f"""
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
worker_processes {workers};
pid logs/nginx.pid;
error_log logs/error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path tmp/client_body; proxy_temp_path tmp/proxy; fastcgi_temp_path tmp/fastcgi;
    uwsgi_temp_path tmp/uwsgi; scgi_temp_path tmp/scgi;
    lua_package_path "{lua_dir}/?.lua;;";
    lua_shared_dict kvgate_state 1m;
    # the balancer counts each request on its node here (kvgate.inflight), as in the gateway
    lua_shared_dict kvgate_inflight 1m;
    # chash_bounded's in-flight prefill tokens, the engines' reports, its spill counter
    lua_shared_dict kvgate_load 1m;
    lua_shared_dict kvgate_node_load 1m;
    lua_shared_dict kvgate_metrics 1m;
{http_body}
}}
"""


def _conf(lua_dir: Path, listen: int, backends: list[int], workers: int) -> str:
    nodes = ", ".join(f'{{ id = "n{i + 1}", peer = "127.0.0.1:{p}", weight = 100 }}'
                      for i, p in enumerate(backends))
    servers = "\n".join(f"        server 127.0.0.1:{p} weight=100 max_fails=1 fail_timeout=10s;" for p in backends)
    listens = "\n".join(f"        listen 127.0.0.1:{p};" for p in backends)
    return bare_nginx_conf(lua_dir, workers=workers, connections=4096, http_body=f"""
    init_by_lua_block {{
        local chash = require "kvgate.balancer.chash"
        BENCH_POOL = assert(chash.new({{ name = "bench", nodes = {{ {nodes} }} }}))
        BENCH_BOUNDED = assert(require("kvgate.balancer.chash_bounded").new({{ name = "bench", nodes = {{ {nodes} }} }}))
    }}
    upstream native {{
        hash $kvgate_route_key consistent;
{servers}
        keepalive 64;
    }}
    upstream lua {{
        server 0.0.0.1;
        balancer_by_lua_block {{
            require("kvgate.balancer.chash").balance(BENCH_POOL)
        }}
        keepalive 64;
    }}
    upstream bounded {{
        server 0.0.0.1;
        balancer_by_lua_block {{
            require("kvgate.balancer.chash_bounded").balance(BENCH_BOUNDED)
        }}
        keepalive 64;
    }}
    server {{
{listens}
        location / {{ return 200 '{{"ok":true}}'; }}
    }}
    server {{
        listen 127.0.0.1:{listen};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_next_upstream error timeout;
        proxy_next_upstream_tries 2;
        # the same access phase in front of both: the key in $kvgate_route_key (native hash)
        # and in the request context (kctx.route.key), where kvgate's route stage leaves it
        set $kvgate_route_key "";
        access_by_lua_block {{
            local key = ngx.var.http_x_key
            ngx.var.kvgate_route_key = key
            require("kvgate.ctx").get().route.key = key
        }}
        # the in-flight count, where the gateway keeps it: the native side counted from the
        # response headers (kvgate before issue 10), the Lua balancer counts at its pick; both
        # release it in the log phase
        log_by_lua_block {{ require("kvgate.inflight").finish() }}
        location = /native {{
            header_filter_by_lua_block {{
                require("kvgate.inflight").begin(nil, "bench", ngx.var.upstream_addr)
            }}
            proxy_pass http://native;
        }}
        location = /lua {{ proxy_pass http://lua; }}
        location = /bounded {{
            # the gateway's log phase: the in-flight count and the prefill tokens released
            log_by_lua_block {{
                local log = require("kvgate.ctx").get().log
                require("kvgate.inflight").finish(log)
                require("kvgate.balancer.load").finish(log)
            }}
            proxy_pass http://bounded;
        }}
    }}""")


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (``/proc/PID/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / tick


def _workers(prefix: Path) -> list[int]:
    master = int((prefix / "logs" / "nginx.pid").read_text())
    return [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]


def _wrk(url: str, seconds: float, connections: int, threads: int, script: Path,
         workers: list[int]) -> tuple[float, float]:
    """(requests/s, nginx worker CPU microseconds per request) of one wrk run."""
    cpu0 = _cpu_s(workers)
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
                          "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 30)
    cpu = _cpu_s(workers) - cpu0
    m = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    n = re.search(r"(\d+) requests in", out.stdout)
    if out.returncode != 0 or not m or not n or "Non-2xx" in out.stdout or "Socket errors" in out.stdout:
        raise RuntimeError(f"wrk against {url} failed:\n{out.stdout}\n{out.stderr}")
    return float(m.group(1)), cpu * 1e6 / max(1, int(n.group(1)))


def nginx_side_by_side(rounds: int, seconds: float, connections: int, threads: int,
                       workers: int) -> dict[str, list[tuple[float, float]]]:
    """(requests/s, worker CPU µs per request) per round of ``native`` and ``lua``,
    alternating in one nginx."""
    lua_dir = default_lua_dir()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-balancer-") as tmp:
        prefix = Path(tmp)
        for d in ("conf", "logs", "tmp"):
            (prefix / d).mkdir()
        listen = _free_port()
        (prefix / "conf" / "nginx.conf").write_text(
            _conf(lua_dir, listen, [_free_port() for _ in range(4)], workers))
        script = prefix / "keys.lua"
        script.write_text(WRK_SCRIPT)
        subprocess.run(["nginx", "-p", str(prefix), "-c", "conf/nginx.conf"], check=True)
        try:
            time.sleep(0.5)
            pids = _workers(prefix)
            out: dict[str, list[tuple[float, float]]] = {"native": [], "lua": [], "bounded": []}
            for name in out:  # warm both (connections, JIT)
                _wrk(f"http://127.0.0.1:{listen}/{name}", 1, connections, threads, script, pids)
            for _ in range(rounds):
                for name in out:
                    out[name].append(_wrk(f"http://127.0.0.1:{listen}/{name}", seconds, connections, threads,
                                          script, pids))
            return out
        finally:
            subprocess.run(["nginx", "-p", str(prefix), "-c", "conf/nginx.conf", "-s", "stop"], check=False)
            time.sleep(0.3)


def ring_micro() -> list[tuple[int, int, float, float]]:
    """(weight, points, build seconds, ns per ring.find) at weight=100 and 1000, 4 nodes."""
    out = subprocess.run(["luajit", "-e", MICRO % {"lua": default_lua_dir()}], capture_output=True, text=True,
                         timeout=300, check=True)
    rows = []
    for line in out.stdout.split("\n"):
        if line.strip():
            w, n, build, ns = line.split()
            rows.append((int(w), int(n), float(build), float(ns)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.bench.balancer", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--workers", type=int, default=1, help="nginx worker processes")
    args = ap.parse_args(argv)
    if shutil.which("wrk") and shutil.which("nginx"):
        res = nginx_side_by_side(args.rounds, args.seconds, args.connections, args.threads, args.workers)
        rps = {k: statistics.median(r for r, _ in v) for k, v in res.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in res.items()}
        print(f"nginx, {args.rounds} alternating rounds of {args.seconds:g} s, wrk -t{args.threads} "
              f"-c{args.connections}, {args.workers} worker(s), {os.cpu_count()} CPUs (medians):")
        for k, label in (("native", "native hash consistent"), ("lua", "Lua chash"),
                         ("bounded", "Lua chash_bounded")):
            print(f"  {label:<23} {rps[k]:8.0f} req/s  {cpu[k]:6.1f} us worker CPU/request   "
                  f"rounds {[round(r) for r, _ in res[k]]}")
        print(f"  Lua/native: {rps['lua'] / rps['native']:.3f} x the requests/s, "
              f"{cpu['lua'] - cpu['native']:+.1f} us worker CPU per request")
        print(f"  chash_bounded/native: {rps['bounded'] / rps['native']:.3f} x the requests/s, "
              f"{cpu['bounded'] - cpu['native']:+.1f} us worker CPU per request")
    else:
        print("wrk or nginx missing: skipping the nginx comparison (apt-get install wrk)", file=sys.stderr)
    print("ring.find under luajit (4 nodes):")
    for w, n, build, ns in ring_micro():
        print(f"  weight={w:<5} {n:7d} points   build {build * 1000:6.1f} ms   find {ns:6.1f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
