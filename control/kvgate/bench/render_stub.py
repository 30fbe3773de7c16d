"""Stand-ins for ``kvgate bench render``'s reconcile round (``python -m kvgate.bench.render_stub N``),
in a process of their own so that their CPU is not the control plane's:

* N engines: one listening port each, answering ``GET /health`` with 200 (what
  :func:`kvgate.control.probes.probe` reads);
* the gateway's internal listener: ``GET /metrics`` (the series the control plane scrapes:
  ``kvgate_upstream_inflight``, ``kvgate_requests_total`` by node/status/tenant, the failover and
  breaker series, for every node id ``n0000``…), ``GET``/``POST /kvgate/config`` (stores the
  pushed runtime and answers ``{"version", "digest"}`` as ``lua/kvgate/config_api.lua`` does).

Prints one JSON line ``{"engines": [port, ...], "gateway": port}`` once every port listens, then
serves until killed. All on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys


def metrics_text(ids: list[str], pools: dict[str, str]) -> bytes:
    lines = ["# TYPE kvgate_upstream_inflight gauge"]
    lines += [f'kvgate_upstream_inflight{{pool="{pools[i]}",node="{i}"}} 1' for i in ids]
    lines.append("# TYPE kvgate_requests_total counter")
    for k, i in enumerate(ids):
        lines.append(f'kvgate_requests_total{{pool="{pools[i]}",node="{i}",status="200",tenant="default"}} {1000 + k}')
        lines.append(f'kvgate_requests_total{{pool="{pools[i]}",node="{i}",status="502",tenant="default"}} 0')
    lines.append("# TYPE kvgate_upstream_failover_total counter")
    lines += [f'kvgate_upstream_failover_total{{pool="{pools[i]}",node="{i}"}} 0' for i in ids]
    lines.append("# TYPE kvgate_upstream_breaker_state gauge")
    lines += [f'kvgate_upstream_breaker_state{{pool="{pools[i]}",node="{i}"}} 0' for i in ids]
    lines.append("# TYPE kvgate_failovers_total counter")
    lines += [f'kvgate_failovers_total{{pool="{p}"}} 0' for p in sorted(set(pools.values()))]
    return ("\n".join(lines) + "\n").encode()


async def _read(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    first, *rest = head.decode("latin-1").split("\r\n")
    method, path = first.split(" ")[:2]
    length = 0
    for line in rest:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _answer(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json") -> None:
    writer.write(f"HTTP/1.1 {status} OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)


async def main(n: int, pools_of: int) -> None:
    ids = [f"n{i:04d}" for i in range(n)]
    per = max(1, -(-n // pools_of))
    pools = {i: f"pool{k // per:02d}" for k, i in enumerate(ids)}
    metrics = metrics_text(ids, pools)
    state = {"version": 0, "digest": "", "runtime": {"pools": {}, "cache": {"namespace_version": 1}}, "loads": 1}

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await _read(reader)
                if req is None:
                    break
                _answer(writer, 200 if req[1] == "/health" else 404, b"{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, body = await _read(reader)
                if path == "/metrics":
                    _answer(writer, 200, metrics, "text/plain; version=0.0.4")
                elif path == "/kvgate/config" and method == "POST":
                    state["version"] += 1
                    state["digest"] = hashlib.sha256(body).hexdigest()
                    state["runtime"] = json.loads(body)
                    _answer(writer, 200, json.dumps({"version": state["version"], "digest": state["digest"]}).encode())
                elif path == "/kvgate/config":
                    _answer(writer, 200, json.dumps({**state, "worker": {"pid": 0, "version": state["version"]}}).encode())
                else:
                    _answer(writer, 404, b"{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(engine, "127.0.0.1", 0) for _ in range(n)]
    gw = await asyncio.start_server(gateway, "127.0.0.1", 0)
    print(json.dumps({"engines": [s.sockets[0].getsockname()[1] for s in servers],
                      "gateway": gw.sockets[0].getsockname()[1]}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
