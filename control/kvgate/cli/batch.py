"""``kvgate batch-worker``: run the Batch API's lines through the gateway (:mod:`kvgate.batch.runner`).

Exit codes: 0 after SIGTERM/SIGINT (or ``--until-idle`` with no batch open); 2 for bad input (an
invalid policy, no token, a bad address); 1 when Redis cannot be reached at start.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class _PolicyFile:
    """The policy file, re-read when its modification time changes (an applied policy takes
    effect without a restart); an invalid new version keeps the last good one (raises, the
    runner logs it)."""

    def __init__(self, path: Path):
        from kvgate.policy import load_policy

        self.path = path
        self._load = load_policy
        self.mtime = path.stat().st_mtime_ns
        self.policy = load_policy(path)

    def __call__(self):
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self.policy
        if mtime != self.mtime:
            self.mtime = mtime
            self.policy = self._load(self.path)
        return self.policy


@click.command("batch-worker")
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The policy file (re-read when it changes).")
@click.option("--token", envvar="KVGATE_TOKEN", default=None,
              help="The admin token (the gateway's batch-principal secret derives from it) [env: KVGATE_TOKEN].")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File whose first line is the admin token.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The Batch API's data folder [default: policy batch.data_dir, else <run dir>/data].")
@click.option("--redis-url", default=None, help="Redis to use [default: the policy's redis.url].")
@click.option("--gateway-url", default=None,
              help="The gateway's client address [default: http:// + the policy's gateway.listen].")
@click.option("--metrics-listen", default=None, help="HOST:PORT to serve this worker's /metrics on [default: none].")
@click.option("--worker-id", default=None, help="A name for this worker in logs and locks [default: host-pid-random].")
@click.option("--until-idle", is_flag=True, help="Exit once no batch is open (scripts, tests).")
@click.option("--lease-s", type=click.FloatRange(0.5, 3600), default=None,
              help="Lease of a claimed line: a worker that dies holding lines gives them back after this "
              "[default: the policy's batch.lease_s].")
@click.pass_context
def batch_worker_command(ctx: click.Context, policy_path: Path, token: str | None, token_file: Path | None,
                         data_dir: Path | None, redis_url: str | None, gateway_url: str | None,
                         metrics_listen: str | None, worker_id: str | None, until_idle: bool,
                         lease_s: float | None) -> None:
    """Run batch lines through the gateway, prefix-grouped, on the capacity live traffic leaves.

    Picks up the batches the Batch API creates (kvgate:batch:open in Redis), validates their
    input files, schedules their lines by route key, sends them through the gateway's client
    listener with the batch principal and batch priority, retries transient failures, and
    writes the output and error files. Several workers may run against one Redis.
    """
    import redis

    from kvgate import redisconn
    from kvgate.addr import split_host_port
    from kvgate.batch.files import FileStore
    from kvgate.batch.runner import Runner, WorkerMetrics, data_dir_of
    from kvgate.control.token import read_token
    from kvgate.policy import PolicyError
    from kvgate.rundir import RunDir

    if token_file is not None:
        try:
            token = read_token(token_file)
        except (OSError, ValueError) as exc:
            _fail(f"cannot read token file {token_file}: {exc}")
    token = (token or "").strip()
    if not token:
        _fail("the batch worker needs the admin token: give --token, set KVGATE_TOKEN or use --token-file")
    try:
        policy_file = _PolicyFile(policy_path)
    except PolicyError as exc:
        _fail(str(exc))
    policy = policy_file.policy
    run_dir = RunDir((ctx.obj or {}).get("run_dir")).root
    data = data_dir or data_dir_of(policy, run_dir)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    r = redisconn.from_url(redis_url or policy.redis.client_url, decode_responses=True, socket_timeout=10,
                           socket_connect_timeout=5, health_check_interval=30)
    try:
        r.ping()
    except redis.RedisError as exc:
        _fail(f"redis at {redis_url or policy.redis.client_url}: {exc}", 1)
    metrics = WorkerMetrics()
    if metrics_listen:
        from prometheus_client import start_http_server

        try:
            host, port = split_host_port(metrics_listen)
            start_http_server(port, addr=host, registry=metrics.registry)
        except (ValueError, OSError) as exc:
            _fail(f"--metrics-listen {metrics_listen}: {exc}")

    def weights():
        from kvgate.control.store import Store
        from kvgate.fleet.runtime import runtime_for

        p = policy_file.policy
        store = Store(p.redis.client_url if not redis_url else redis_url)
        return dict(runtime_for(p, store.nodes(), store.pools([pl.name for pl in p.pools])).home_weights)

    runner = Runner(policy_file, r, FileStore(data, r, retention_days=policy.batch.file_retention_days), token,
                    worker_id=worker_id, gateway_url=gateway_url, metrics=metrics, weights=weights,
                    lease_s=lease_s if lease_s is not None else policy.batch.lease_s)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.stop)
        logging.getLogger("kvgate.batch").info("batch worker %s: data %s, gateway %s", runner.worker_id, data,
                                               gateway_url or policy.gateway.listen)
        await runner.run(until_idle=until_idle)

    asyncio.run(main())
