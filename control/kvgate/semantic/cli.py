"""``kvgate semantic``: run the semantic service of this host (docs/semantic-cache.md)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

# One BLAS thread: the index's matrix-vector product is small, and idle BLAS threads spinning
# after it slow the next embedding (measured with 10,000 entries: lookup p99 17 -> 7.5 ms). Set
# before numpy is first imported (this module is imported only to run `kvgate semantic`).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def default_listen(run_dir: Path | None) -> str:
    """``unix:<run dir>/semantic.sock`` (the policy's ``semantic_service.listen: null``)."""
    from kvgate.rundir import RunDir

    return f"unix:{RunDir(run_dir).root / 'semantic.sock'}"


def listen_of(policy, run_dir: Path | None) -> str:
    """Where the service of ``policy`` listens."""
    return policy.semantic_service.listen or default_listen(run_dir)


@click.command("semantic")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The policy: Redis, semantic_service (listen, index, max_entries), the pools' static answers. "
                   "Static answers follow the policy version the control plane applied (in Redis, with the folder "
                   "of the file applied) when there is one, else this file; reloaded when it or a static file "
                   "changes.")
@click.option("--listen", default=None, help="unix:/path.sock or 127.0.0.1:PORT [default: the policy's "
                                             "semantic_service.listen].")
@click.option("--redis-url", default=None, help="Override the policy's redis.url.")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Threads that embed and search.")
@click.pass_context
def semantic_command(ctx: click.Context, policy_path: Path, listen: str | None, redis_url: str | None,
                     workers: int) -> None:
    """Run the semantic service: /lookup, /insert, /invalidate, /health, /metrics over a local socket."""
    import redis

    from kvgate.policy import PolicyError, load_policy

    from .. import redisconn
    from .embed import EmbeddingError
    from .service import SemanticCache, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None
    run_dir = (ctx.obj or {}).get("run_dir")
    listen = listen or listen_of(policy, run_dir)
    client = redisconn.from_url(redis_url or policy.redis.client_url, socket_timeout=2, socket_connect_timeout=2,
                                health_check_interval=30)
    models = {p.semantic.model for p in policy.pools} or {"all-MiniLM-L6-v2-int8"}
    try:
        cache = SemanticCache(client, index=policy.semantic_service.index,
                              max_entries=policy.semantic_service.max_entries, model=sorted(models)[0],
                              default_ttl_s=getattr(policy.cache, "ttl_s", None) or 3600)
    except (EmbeddingError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"kvgate semantic: {cache.index.kind} index, model {cache.model}, listening on {listen}", err=True)
    try:
        serve(cache, listen, policy_path.resolve(), workers=workers)
    except (OSError, ValueError, redis.RedisError) as exc:
        raise click.ClickException(f"semantic service: {exc}") from None
