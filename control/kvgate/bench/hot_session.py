"""``kvgate bench hot-session``: what a per-session limit buys the other sessions of a node.

One private stack (``kvgate up`` of a generated policy: 2 simulated engines, chash, one
tenant with ``session_rpm``), then three runs of the same load, side by side:

* ``calm``: ``--others`` sessions whose home is the same node, each sending a streamed request
  every ``--interval`` seconds: their client TTFT (send → first content chunk) is the baseline;
* ``hot, limited``: the same, plus one hot session on that node at ``--hot-rps`` requests/s,
  under the tenant's ``session_rpm`` (``--session-rps`` × 60): it gets 429s;
* ``hot, unlimited``: the same hot session through a tenant without limits: what it costs the
  others without the limit.

It prints, per run, the others' TTFT p50/p99, the hot session's answers by status, and the
ratio of each run's others' p99 to the calm run's (issue 12's acceptance: ≤ 1.2 × with the
limit). Run by hand; figures in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import click
import yaml

MODEL = "bench-model"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _policy(ports: dict[str, int], node_ports: list[int], session_rpm: int, max_num_seqs: int,
            burst_s: float | None) -> dict:
    return {
        "version": 1,
        "gateway": {"listen": f"127.0.0.1:{ports['gateway']}", "internal_listen": f"127.0.0.1:{ports['internal']}",
                    "worker_processes": 2, "debug_headers": True, "auth": "required"},
        "redis": {"url": f"redis://127.0.0.1:{ports['redis']}/0"},
        "cache": {"enabled": False},
        "pools": [{"name": "bench", "models": [MODEL], "balancer": "chash", "affinity": ["session", "prefix"],
                   "nodes": [{"id": f"n{i + 1}", "url": f"http://127.0.0.1:{p}", "simulate": True}
                             for i, p in enumerate(node_ports)]}],
        "simulator": {"model": MODEL, "time_scale": 1.0, "prefill_s_per_token": 0.0002,
                      "decode_s_per_token": 0.01, "max_num_seqs": max_num_seqs},
        "control": {"listen": f"127.0.0.1:{ports['control']}"},
        "tenants": [{"id": "limited", "limits": {"session_rpm": session_rpm}}, {"id": "open"}],
        **({"limits": {"session_burst_s": burst_s}} if burst_s else {}),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _stream(s: aiohttp.ClientSession, url: str, key: str, session: str, text: str,
                  max_tokens: int) -> tuple[int, float | None, str | None]:
    """(status, TTFT s or None, the node that answered)"""
    t0 = time.monotonic()
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session, "Cache-Control": "no-store"}
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        ttft = None
        node = r.headers.get("X-Kvgate-Node")
        if r.status != 200:
            await r.read()
            return r.status, None, node
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"content":"' in line.replace(b" ", b"") \
                    and b'"content":""' not in line.replace(b" ", b""):
                ttft = time.monotonic() - t0
        return r.status, ttft, node


async def _sessions_on(url: str, key: str, node: str, n: int) -> list[str]:
    """n session ids whose home is ``node`` (asked of the gateway: X-Kvgate-Node)."""
    out: list[str] = []
    async with aiohttp.ClientSession() as s:
        i = 0
        while len(out) < n and i < 50 * n:
            sid = f"calm-{i}"
            status, _, got = await _stream(s, url, key, sid, "probe", 1)
            if status == 200 and got == node:
                out.append(sid)
            i += 1
    return out


async def _run(url: str, keys: dict[str, str], others: list[str], hot: str | None, hot_key: str | None,
               seconds: float, interval: float, hot_rps: float, max_tokens: int, hot_max_tokens: int) -> dict:
    ttfts: list[float] = []
    hot_codes: dict[int, int] = {}
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def calm(sid: str, offset: float) -> None:
            await asyncio.sleep(offset)
            n = 0
            while time.monotonic() < stop:
                t = time.monotonic()
                status, ttft, _ = await _stream(s, url, keys["open"], sid, f"{sid} turn {n}", max_tokens)
                if status == 200 and ttft is not None:
                    ttfts.append(ttft)
                n += 1
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - t)))

        async def hot_loop() -> None:
            tasks = []
            n = 0
            while time.monotonic() < stop:
                tasks.append(asyncio.create_task(_stream(s, url, hot_key, hot, f"hot turn {n}", hot_max_tokens)))
                n += 1
                await asyncio.sleep(1 / hot_rps)
            for status, _, _ in await asyncio.gather(*tasks):
                hot_codes[status] = hot_codes.get(status, 0) + 1

        jobs = [calm(sid, i * interval / max(1, len(others))) for i, sid in enumerate(others)]
        if hot:
            jobs.append(hot_loop())
        await asyncio.gather(*jobs)
    return {"others_ttft_p50_s": _pct(ttfts, 0.5), "others_ttft_p99_s": _pct(ttfts, 0.99),
            "others_requests": len(ttfts), "hot": hot_codes}


@click.command("hot-session")
@click.option("--seconds", default=20.0, show_default=True, help="Length of each run.")
@click.option("--others", default=4, show_default=True, help="Calm sessions on the hot session's node.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between two requests of a calm session.")
@click.option("--hot-rps", default=20.0, show_default=True, help="The hot session's requests per second.")
@click.option("--session-rps", default=2, show_default=True, help="The limited tenant's session limit (per second).")
@click.option("--max-tokens", default=20, show_default=True, help="Output tokens of a calm request (10 ms each).")
@click.option("--hot-max-tokens", default=100, show_default=True, help="Output tokens of a hot request.")
@click.option("--max-num-seqs", default=8, show_default=True, help="The simulated engines' --max-num-seqs.")
@click.option("--session-burst-s", type=float, default=None, help="limits.session_burst_s [default: the policy's].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def hot_session_command(seconds: float, others: int, interval: float, hot_rps: float, session_rps: int,
                        max_tokens: int, hot_max_tokens: int, max_num_seqs: int, session_burst_s: float | None,
                        json_path: Path | None) -> None:
    """The others' TTFT on a node with and without a hot session, with and without a session limit."""
    from ..control.apikeys import ApiKeys
    from ..control.store import Store
    from ..stack import Stack, StackError

    ports = {k: _free_port() for k in ("gateway", "internal", "redis", "control")}
    node_ports = [_free_port(), _free_port()]
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-hot-"))
    policy_path = work / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(_policy(ports, node_ports, session_rps * 60, max_num_seqs,
                                                  session_burst_s)))
    stack = Stack(work / "run")
    url = f"http://127.0.0.1:{ports['gateway']}"
    rows: dict[str, dict] = {}
    try:
        try:
            stack.up(policy_path, timeout=90, echo=lambda line: click.echo(f"  {line}"))
        except (StackError, OSError) as exc:
            click.echo(f"error: the bench stack did not start: {exc}", err=True)
            sys.exit(1)
        store = Store(f"redis://127.0.0.1:{ports['redis']}/0")
        keys = {t: ApiKeys(store).create(t, "bench hot-session")[1] for t in ("limited", "open")}
        calm = asyncio.run(_sessions_on(url, keys["open"], "n1", others))
        if len(calm) < others:
            click.echo(f"error: found only {len(calm)} sessions homed on n1", err=True)
            sys.exit(1)
        hot = asyncio.run(_sessions_on(url, keys["open"], "n1", others + 1))[-1]
        for label, hot_sid, hot_key in (("calm", None, None), ("hot, limited", hot, keys["limited"]),
                                        ("hot, unlimited", hot, keys["open"])):
            click.echo(f"run: {label} ({seconds:g} s)")
            rows[label] = asyncio.run(_run(url, keys, calm, hot_sid, hot_key, seconds, interval, hot_rps, max_tokens,
                                           hot_max_tokens))
            time.sleep(2)  # the engines' queues drain between runs
    finally:
        stack.down(echo=lambda *_: None)
        shutil.rmtree(work, ignore_errors=True)
    base = rows["calm"]["others_ttft_p99_s"]
    click.echo("")
    click.echo(f"{others} calm sessions on n1 (a request every {interval:g} s each), a hot session at {hot_rps:g} "
               f"requests/s on n1, session limit {session_rps}/s; engines max_num_seqs {max_num_seqs}, "
               f"{max_tokens} output tokens per calm request, {hot_max_tokens} per hot one")
    click.echo("")
    click.echo("| run | others' TTFT p50 ms | others' TTFT p99 ms | p99 vs calm | others' answers | hot session's answers |")
    click.echo("|---|---|---|---|---|---|")
    for label, r in rows.items():
        hot_txt = ", ".join(f"{k}: {v}" for k, v in sorted(r["hot"].items())) or "-"
        click.echo(f"| {label} | {r['others_ttft_p50_s'] * 1000:.0f} | {r['others_ttft_p99_s'] * 1000:.0f} | "
                   f"{r['others_ttft_p99_s'] / base:.2f} | {r['others_requests']} | {hot_txt} |")
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    hot_session_command()
