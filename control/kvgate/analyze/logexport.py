"""The gateway's request log (the ``kvgate:log`` stream) as JSON lines: ``kvgate log export``,
and the reader ``kvgate analyze redis://HOST:PORT/DB`` uses.

One JSON object per entry: the entry's fields (keys.LOG_FIELDS, all strings as the gateway
wrote them) plus ``id`` (the stream id), oldest first.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Iterator

import click

from ..keys import LOG_STREAM

PAGE = 1000


def parse_since(since: str | None) -> float | None:
    """``"1h"``, ``"30m"``, ``"2d"``, ``"90s"`` → seconds; None → None. Raises ValueError."""
    if not since:
        return None
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(since[-1])
    if unit is None or not since[:-1].isdigit():
        raise ValueError(f"--since {since!r}: want a number and s|m|h|d, e.g. 1h")
    return int(since[:-1]) * unit


def read_log(url: str, since_s: float | None = None, limit: int | None = None) -> Iterator[dict]:
    """The stream's entries from ``since_s`` seconds ago (all: None), oldest first, in pages of
    :data:`PAGE` (XRANGE); at most ``limit``. Raises redis.RedisError."""
    from .. import redisconn

    r = redisconn.from_url(url, decode_responses=True, socket_timeout=10)
    start = "-" if since_s is None else f"{int((time.time() - since_s) * 1000)}-0"
    n = 0
    while True:
        page = r.xrange(LOG_STREAM, min=start, max="+", count=PAGE)
        for eid, fields in page:
            if limit is not None and n >= limit:
                return
            n += 1
            yield {"id": eid, **fields}
        if len(page) < PAGE:
            return
        ms, sq = page[-1][0].split("-")
        start = f"{ms}-{int(sq) + 1}"


@click.group("log")
def log_group() -> None:
    """The gateway's request log (the kvgate:log stream)."""


@log_group.command("export")
@click.option("--redis", "url", default=None, envvar="KVGATE_REDIS_URL",
              help="The gateway's Redis [default: the running stack's redis.url].")
@click.option("--since", default=None, help="Only entries this recent (e.g. 1h, 30m, 2d) [default: all].")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write here [default: stdout].")
@click.pass_context
def export_command(ctx: click.Context, url: str | None, since: str | None, out: str | None) -> None:
    """Write the log's entries as JSON lines (the input `kvgate analyze` reads): docs/analyze.md."""
    import redis

    if url is None:
        # the running stack's Redis, as `kvgate costs` and `kvgate keys` find it: never a guess
        from ..stack import Stack

        running = Stack((ctx.find_root().obj or {}).get("run_dir")).load_running_policy()
        if running is None:
            raise click.UsageError("no running stack here (kvgate up): give the gateway's Redis with --redis URL")
        url = running.redis.client_url

    try:
        since_s = parse_since(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        fh = open(out, "w", encoding="utf-8") if out else sys.stdout
    except OSError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    n = 0
    try:
        for entry in read_log(url, since_s):
            fh.write(json.dumps(entry) + "\n")
            n += 1
    except redis.RedisError as exc:
        click.echo(f"error: {url}: {exc}", err=True)
        sys.exit(2)
    finally:
        if out:
            fh.close()
    if out:
        click.echo(f"{n} entries -> {out}", err=True)
