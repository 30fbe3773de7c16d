"""``redis.persist``: the private redis-server of ``kvgate up`` keeps its data across a stop and
start in the run dir (append-only file) when asked, and nothing otherwise."""

from __future__ import annotations

import time

import pytest
import redis

from gwfixtures import free_port
from kvgate.policy.loader import parse_policy
from kvgate.stack import Stack

pytestmark = pytest.mark.integration


def policy(port: int, persist: bool):
    return parse_policy({"version": 1, "redis": {"url": f"redis://127.0.0.1:{port}/0", "persist": persist},
                         "pools": [{"name": "p", "models": ["m"], "nodes": [{"id": "n1", "url": "http://127.0.0.1:9"}]}]},
                        "test")


@pytest.mark.parametrize("persist", [True, False])
def test_the_private_redis_keeps_its_data_only_when_persist(tmp_path, persist):
    stack, port = Stack(tmp_path / "run"), free_port()
    for d in (stack.logs, stack.pids):  # what `kvgate up` makes first
        d.mkdir(parents=True, exist_ok=True)
    pol = policy(port, persist)
    try:
        assert stack.start_redis(pol) == "started"
        r = redis.Redis(port=port)
        r.hset("kvgate:batch:b:batch_x", mapping={"status": "in_progress"})
        time.sleep(1.2)  # appendfsync everysec
        assert stack._stop_pid("redis")
        assert stack.start_redis(pol) == "started"
        got = redis.Redis(port=port).hget("kvgate:batch:b:batch_x", "status")
        assert got == (b"in_progress" if persist else None)
    finally:
        stack._stop_pid("redis")
