"""The online round-robin baseline (kvgate.costs.baseline) on tiny workloads with known answers."""

from __future__ import annotations

from kvgate.costs.baseline import PoolModel, RoundRobinBaseline, parse_blocks, pool_capacity
from kvgate.policy.loader import parse_policy_text

A, B, C, D = "a" * 16, "b" * 16, "c" * 16, "d" * 16


def policy(simulate: str = "true", nodes: int = 2, extra: str = ""):
    lines = "\n".join(f'      - {{id: n{i}, url: "http://127.0.0.1:{9000 + i}", simulate: {simulate}}}'
                      for i in range(nodes))
    return parse_policy_text(f"""
version: 1
pools:
  - name: p
    models: [m]
    prefix_index: {{chunk_chars: 2048, chars_per_token: 4, kv_capacity_tokens: 2048}}
    nodes:
{lines}
simulator: {{block_size: 16, num_gpu_blocks: 64}}
{extra}
""")


def test_parse_blocks_cuts_16_hex_digits() -> None:
    assert parse_blocks(A + B + "cc") == [A.encode(), B.encode()]
    assert parse_blocks("") == []


def test_capacity_from_the_simulator_or_the_prefix_index() -> None:
    sim = policy("true")
    assert pool_capacity(sim, sim.pools[0]) == (2, 512.0)  # 64 × 16 = 1024 tokens = 2 blocks of 512
    real = policy("false")
    assert pool_capacity(real, real.pools[0]) == (4, 512.0)  # kv_capacity_tokens 2048


def test_round_robin_on_two_nodes() -> None:
    base = RoundRobinBaseline()
    base.configure(policy(), {"p": 2})
    # the same two-block prompt four times: node 0, node 1 (both cold), then each again (warm)
    got = [base.serve("p", A + B, 2000) for _ in range(4)]
    assert got == [0, 0, 1024, 1024]
    # the prompt - 1 cap: a prompt of exactly two blocks' tokens can hit at most prompt - 1
    assert base.serve("p", A + B, 1024) == 1023
    assert base.serve("p", "", 10) is None and base.serve("nosuch", A, 10) is None


def test_one_node_and_lru_eviction() -> None:
    base = RoundRobinBaseline()
    base.configure(policy(), {"p": 1})  # capacity 2 blocks
    assert base.serve("p", A + B, None) == 0
    assert base.serve("p", A, None) == 512
    assert base.serve("p", C + D, None) == 0  # evicts B (least recently used), then A
    assert base.serve("p", A, None) == 0
    # C+D was freed tail first (D older than C), so A took D's place and C is still cached
    assert base.serve("p", C, None) == 512
    assert base.serve("p", D, None) == 0


def test_the_serving_node_count_follows_the_fleet() -> None:
    base = RoundRobinBaseline()
    p = policy(nodes=3)
    base.configure(p, {"p": 1})
    assert base.serve("p", A, 1000) == 0 and base.serve("p", A, 1000) == 512  # one node: the second is a hit
    base.configure(p, {"p": 2})  # a node back: a cold cache joins the rotation
    assert [base.serve("p", A, 1000) for _ in range(4)] == [512, 0, 512, 512]
    base.configure(p, None)  # no state: every node the policy lists
    assert len(base.pools["p"].caches) == 3
    base.configure(policy(extra="usage: {retention_days: 3}"), {"p": 3})  # same capacity: kept warm
    assert len(base.pools["p"].caches) == 3 and base.pools["p"].caches[0].lookup([A.encode()]) == 1


def test_cached_tokens_past_the_logged_blocks_go_to_round_robin() -> None:
    base = RoundRobinBaseline()
    base.configure(policy(), {"p": 2})
    # one logged block (512 tokens) of a 900-token prompt, cold caches: the model finds 0, but
    # the engine had 800 cached; the 288 past the logged block are not the log's to judge
    assert base.serve("p", A, 900, cached=800) == 288
    assert base.serve("p", A, 900, cached=400) == 0  # within what the log shows: the model's answer
