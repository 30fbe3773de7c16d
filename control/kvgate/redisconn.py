"""One factory for every Python Redis client of kvgate: a plain Redis or the master behind Sentinel.

The connection string is the policy's :attr:`kvgate.policy.model.RedisConfig.client_url`:

``redis://HOST:PORT/DB``                          a plain Redis (redis-py's own ``from_url``)
``redis+sentinel://H1:P1,H2:P2,.../MASTER/DB``    the current master of ``MASTER`` as the sentinels
                                                  at ``H1:P1``... name it (redis-py's
                                                  ``Sentinel.master_for``): a client that asks the
                                                  sentinels again after a connection error, so it
                                                  follows a failover (docs/sentinel.md)

``redis+sentinel://`` is kvgate's own form (redis-py has none); ``?sentinel_timeout_ms=N`` sets
the timeout of one question to one sentinel (default 250 ms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
import redis.sentinel

SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed ``redis+sentinel://`` string: ``sentinels`` as (host, port), the master's name, the DB."""

    sentinels: list[tuple[str, int]]
    master_name: str
    db: int
    sentinel_timeout_s: float = 0.25


def parse(url: str) -> SentinelTarget | None:
    """``redis+sentinel://H1:P1,H2:P2/MASTER/DB[?sentinel_timeout_ms=N]`` -> its parts; None for any
    other scheme. Raises ValueError for a malformed sentinel string."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        return None
    sentinels: list[tuple[str, int]] = []
    for item in parts.netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{url!r}: expected HOST:PORT for each sentinel, got {item!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{url!r}: expected {SCHEME}://HOST:PORT,.../MASTER/DB")
    query = parse_qs(parts.query)
    timeout_ms = float(query.get("sentinel_timeout_ms", ["250"])[0])
    return SentinelTarget(sentinels, path[0], int(path[1]) if len(path) == 2 else 0, timeout_ms / 1000)


def from_url(url: str, **redis_kwargs: Any) -> redis.Redis:
    """A client for ``url`` (either form above), with ``redis_kwargs`` as ``redis.Redis`` takes them
    (``socket_timeout``, ``decode_responses``...). The Sentinel form returns a client whose
    connection pool asks the sentinels for the master on every new connection (redis-py's
    ``SentinelConnectionPool``) and refuses a replica that was demoted under it (``READONLY``
    and a role check on connect), so commands after a failover reach the new master.

    Raises:
        ValueError: a malformed ``redis+sentinel://`` string.
    """
    target = parse(url)
    if target is None:
        return redis.Redis.from_url(url, **redis_kwargs)
    sentinel_kwargs = {"socket_timeout": target.sentinel_timeout_s,
                       "socket_connect_timeout": target.sentinel_timeout_s}
    sentinel = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs)
    redis_kwargs = {**redis_kwargs, "db": target.db}
    # health_check_interval is a plain-Redis option redis-py's sentinel pool also takes
    return sentinel.master_for(target.master_name, **redis_kwargs)


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a master through Sentinel."""
    return url.startswith(SCHEME + "://")


def wait_replicas(client: redis.Redis, replicas: int = 1, timeout_ms: int = 500) -> int:
    """``WAIT replicas timeout_ms`` on ``client``: how many replicas have acknowledged every write this
    connection made before (Redis's own count). Errors are the caller's (redis.RedisError)."""
    return int(client.execute_command("WAIT", replicas, timeout_ms))
