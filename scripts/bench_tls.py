#!/usr/bin/env python3
"""What TLS on the client listener costs (docs/tls.md): two gateways from one policy on this
machine, one plain and one with ``gateway.tls`` (a fresh openssl RSA-2048 certificate), and the
same requests against each:

* keep-alive: THREADS clients, each on one persistent connection, ``GET /kvgate/health`` (answered
  by the gateway's Lua, no engine: the gateway's own cost) for SECONDS → requests/s;
* new connection per request, one client: plain TCP, a full TLS handshake, and a TLS handshake
  resuming the previous session → connections/s and the time of one.

usage: .venv/bin/python scripts/bench_tls.py [--seconds 3] [--threads 4] [--port 28600]
(ports PORT..PORT+3; it starts and stops its own nginx instances under a temp folder)
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))

from kvgate.nginxctl import Nginx  # noqa: E402
from kvgate.policy.loader import parse_policy  # noqa: E402


def policy(port: int, internal: int, tls: dict | None):
    gw = {"listen": f"127.0.0.1:{port}", "internal_listen": f"127.0.0.1:{internal}", "worker_processes": 1}
    if tls:
        gw["tls"] = tls
    return parse_policy({"version": 1, "gateway": gw, "redis": {"url": "redis://127.0.0.1:28999/0", "managed": False},
                         "pools": [{"name": "p", "models": ["m"], "nodes": [{"id": "a", "url": "http://127.0.0.1:28998"}]}]},
                        "bench")


def keepalive(port: int, ctx: ssl.SSLContext | None, threads: int, seconds: float) -> float:
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx) if ctx
                else http.client.HTTPConnection("127.0.0.1", port))
        while time.monotonic() < stop:
            conn.request("GET", "/kvgate/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            counts[i] += 1
        conn.close()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / seconds


def connections(port: int, ctx: ssl.SSLContext | None, seconds: float, resume: bool = False) -> tuple[float, bool]:
    n, session, resumed = 0, None, True
    request = b"GET /kvgate/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        raw = socket.create_connection(("127.0.0.1", port))
        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session if resume else None) if ctx else raw
        s.sendall(request)
        while s.recv(65536):
            pass
        if ctx is not None:
            if resume and session is not None:
                resumed = resumed and s.session_reused
            session = s.session
        s.close()
        n += 1
    return n / seconds, resumed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--port", type=int, default=28600)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-tls-") as tmp:
        d = Path(tmp)
        cert, key = d / "gw.pem", d / "gw.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        plain = Nginx(d / "plain")
        tls = Nginx(d / "tls")
        try:
            plain.apply(policy(args.port, args.port + 1, None))
            tls.apply(policy(args.port + 2, args.port + 3, {"certificate": str(cert), "key": str(key)}))
            plain.wait_ready(f"127.0.0.1:{args.port}")
            tls.wait_ready(f"127.0.0.1:{args.port + 2}")
            ctx = ssl.create_default_context(cafile=str(cert))
            out = {"seconds": args.seconds, "threads": args.threads, "worker_processes": 1}
            out["keepalive_rps"] = {"plain": round(keepalive(args.port, None, args.threads, args.seconds)),
                                    "tls": round(keepalive(args.port + 2, ctx, args.threads, args.seconds))}
            p, _ = connections(args.port, None, args.seconds)
            f, _ = connections(args.port + 2, ctx, args.seconds)
            r, resumed = connections(args.port + 2, ctx, args.seconds, resume=True)
            out["new_connection_per_s"] = {"plain": round(p), "tls_full_handshake": round(f),
                                           "tls_resumed": round(r), "resumed_every_time": resumed}
            out["ms_per_connection"] = {k: round(1000 / v, 3) for k, v in
                                        (("plain", p), ("tls_full_handshake", f), ("tls_resumed", r))}
            out["tls_version"] = ssl.create_default_context(cafile=str(cert)).wrap_socket(
                socket.create_connection(("127.0.0.1", args.port + 2)), server_hostname="127.0.0.1").version()
            print(json.dumps(out, indent=2))
        finally:
            plain.stop(timeout=5)
            tls.stop(timeout=5)


if __name__ == "__main__":
    main()
