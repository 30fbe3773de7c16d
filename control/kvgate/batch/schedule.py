"""The prefix-grouped schedule of a batch (issue 14, Build 4): which lines go together, to
which node, in what order. PURE: no Redis, no clock; :mod:`kvgate.batch.runner` stores the
result in its own keys and works through it.

**Groups.** Lines are grouped by the route key the gateway computes for them
(:func:`line_route_key`): the pool's ``affinity`` sources in order, with no session header
(a batch line has none) and ``user`` from the body; ``prefix`` is the fingerprint of the first
``prefix_chars`` bytes of the canonical prompt (:func:`kvgate.analyze.routing.route_key` for
chat; for ``/v1/completions`` and ``/v1/embeddings`` the same window over ``RS "P" US`` + the
prompt / input text, as ``lua/kvgate/prompt.lua`` lays out a completion prompt). Lines whose
key is the gateway's fallback (no prompt, no user) share nothing: each is a group of one.
Lines of one key are one document's questions (or one system prompt's): the gateway sends
them to one node, whose engine keeps the prefix in its cache.

**Nodes.** A group's node is its key's home on the pool's ketama ring
(:class:`kvgate.analyze.routing.Ring`, weights in nginx units: the running home weights when
the runner can read them, else the policy's). A pool whose balancer does not route by key
(``round_robin``, ``least_conn``) has one queue for the pool, ``*<pool>``. The node is the
schedule's *accounting* (per-node concurrency, back-off on the node's queue), not routing:
the gateway still routes each line itself (bounded load, failover), so the worker never
sends a line around the gateway's choice.

**Order.** Each node's queue is a list of :class:`Group` s, largest first (ties: first line
first): a node works through one document's lines back to back, so the prefix is prefilled
once and then hit, and the documents it has cached are not thrashed by interleaving many of
them. The runner sends a group's first line alone (the *leader*: it prefills the prefix) and
releases the rest (the *followers*) once it is answered, ahead of the node's next group —
the followers then run concurrently, every one a prefix-cache hit. Groups of one are mixed
in evenly between the larger groups' leaders: while a leader prefills, the node's other
slots take single lines instead of opening the next document.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..analyze.routing import RS, US, Ring, _esc, _sentinel, key_point, route_key
from ..fleet.weights import WEIGHT_SCALE
from ..policy.model import Policy, PoolConfig

AFFINITY_BALANCERS = frozenset({"chash", "chash_bounded", "prefix"})
"""Balancers that send a route key to its home node (the others spread lines over the pool)."""


@dataclass(frozen=True)
class Group:
    """Lines sharing one route key, in file order.

    Attributes:
        key: the route key (``p:<sha256>``, ``u:<user>``; ``""`` for a line with none).
        node: the node (or ``*<pool>`` queue) the group is accounted to.
        pool: the pool serving the lines' model.
        lines: 0-based line indices, file order; ``lines[0]`` is the leader.
    """

    key: str
    node: str
    pool: str
    lines: tuple[int, ...]


@dataclass
class Schedule:
    """Per-node queues of groups, in the order they are to be worked.

    Attributes:
        queues: node → its groups in order.
        sizes: every group's size (for the group-size histogram), in creation order.
    """

    queues: dict[str, list[Group]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)

    def node_of(self) -> dict[int, str]:
        """Line index → its node."""
        return {i: node for node, groups in self.queues.items() for g in groups for i in g.lines}


def _prompt_window(text: str, prefix_chars: int) -> bytes:
    return (RS + "P" + US + _esc(text)).encode("utf-8")[:prefix_chars]


def line_route_key(url: str, body: Mapping[str, Any], pool: PoolConfig, fallback: str = "") -> str:
    """The route key the gateway computes for a batch line (no session header), ``fallback``
    when the line has neither a usable ``user`` nor a prompt."""
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        msgs = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        key, _kind, _shared = route_key(msgs, affinity=pool.affinity, prefix_chars=pool.prefix_chars,
                                        session=None, user=body.get("user"), fallback=fallback)
        return key
    text = body.get("prompt") if url == "/v1/completions" else body.get("input")
    if isinstance(text, list):
        text = text[0] if text and isinstance(text[0], str) else None
    for src in pool.affinity:
        user = body.get("user")
        if src == "user" and isinstance(user, str) and not _sentinel(user):
            return "u:" + user
        if src == "prefix" and isinstance(text, str) and text:
            return "p:" + hashlib.sha256(_prompt_window(text, pool.prefix_chars)).hexdigest()
    return fallback


def default_weights(policy: Policy) -> dict[str, int]:
    """Node id → nginx weight from the policy (``weight × WEIGHT_SCALE``)."""
    return {n.id: int(n.weight * WEIGHT_SCALE) for n in policy.nodes()}


def _interleave(big: list[Group], singles: list[Group]) -> list[Group]:
    """``big`` in order with ``singles`` spread evenly after each (the rest at the end)."""
    if not big:
        return singles
    per = math.ceil(len(singles) / len(big))
    out: list[Group] = []
    k = 0
    for g in big:
        out.append(g)
        out.extend(singles[k:k + per])
        k += per
    out.extend(singles[k:])
    return out


def plan(lines: Sequence[tuple[int, str, Mapping[str, Any], str]], policy: Policy,
         weights: Mapping[str, int] | None = None) -> Schedule:
    """The schedule of a batch's lines.

    Args:
        lines: ``(index, url, body, pool name)`` per line to run (lines refused at validation
            left out).
        policy: the pools (affinity, prefix window, balancer, nodes) and the fallback key.
        weights: node id → nginx weight of the home ring (missing nodes: the policy's weight;
            0 or less counts as 1, as the home ring does).

    Returns:
        A :class:`Schedule`; every line index appears in exactly one group.

    Raises:
        KeyError: a line names a pool the policy does not have.
    """
    pools = {p.name: p for p in policy.pools}
    w = {**default_weights(policy), **(weights or {})}
    rings: dict[str, Ring] = {}
    fallback = policy.gateway.fallback_route_key
    grouped: dict[tuple[str, str], list[int]] = {}
    singles: list[tuple[str, int]] = []
    for index, url, body, pool_name in lines:
        pool = pools[pool_name]
        key = line_route_key(url, body, pool, fallback)
        if key == fallback:
            singles.append((pool_name, index))
        else:
            grouped.setdefault((pool_name, key), []).append(index)

    def node_for(pool_name: str, key: str) -> str:
        pool = pools[pool_name]
        if pool.balancer not in AFFINITY_BALANCERS:
            return "*" + pool_name
        ring = rings.get(pool_name)
        if ring is None:
            ring = rings[pool_name] = Ring([(n.id, max(1, int(w.get(n.id, 1)))) for n in pool.nodes])
        return ring.home(key_point(key))

    big: dict[str, list[Group]] = {}
    small: dict[str, list[Group]] = {}
    sched = Schedule()
    for (pool_name, key), idx in grouped.items():
        g = Group(key, node_for(pool_name, key), pool_name, tuple(idx))
        (big if len(idx) > 1 else small).setdefault(g.node, []).append(g)
        sched.sizes.append(len(idx))
    for n, (pool_name, index) in enumerate(singles):
        pool = pools[pool_name]
        if pool.balancer in AFFINITY_BALANCERS:
            # keyless lines: the gateway spreads them (failover.keyless); account them round robin
            node = pool.nodes[n % len(pool.nodes)].id
        else:
            node = "*" + pool_name
        small.setdefault(node, []).append(Group("", node, pool_name, (index,)))
        sched.sizes.append(1)
    for node in sorted(set(big) | set(small)):
        b = sorted(big.get(node, []), key=lambda g: (-len(g.lines), g.lines[0]))
        s = sorted(small.get(node, []), key=lambda g: g.lines[0])
        sched.queues[node] = _interleave(b, s)
    return sched
