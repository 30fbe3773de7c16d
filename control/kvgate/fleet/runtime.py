"""Node records and pool states → the gateway's :class:`~kvgate.render.Runtime` (weights, 0 =
down; balancer switches; the cache namespace version)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..policy.model import Policy
from ..render import Runtime
from .records import NodeRecord, PoolState, node_records, pool_states
from . import states as st
from .weights import node_weight, serving_weights


def runtime_for(policy: Policy, records: Mapping[str, NodeRecord | Mapping[str, Any]],
                pools: Mapping[str, PoolState | Mapping[str, Any]], namespace_floor: int = 0,
                knowledge_floor: Mapping[str, int] | None = None) -> Runtime:
    """The gateway runtime for node ``records`` and pool states (typed, or as stored in Redis).

    ``active`` nodes get their target weight, ``ramping`` ones the ramp step's share of it,
    every other state 0 (nginx ``down``); a node without a record is ``joining`` (0) unless
    there are no records at all (a fresh fleet: every node at its base weight), see
    :func:`kvgate.fleet.weights.node_weight`. ``home_weights``: the serving weights of those
    (:func:`kvgate.fleet.weights.serving_weights`, the home ring's); ``states``: each record's
    state (``joining`` without one, ``active`` for every node of a fresh fleet). Pools in
    overload degrade get ``least_conn``.
    ``namespace_floor``: the highest cache namespace version ever in force; the runtime's is
    the policy's unless that is lower. ``knowledge_floor``: pool → the highest semantic
    ``knowledge_version`` ever in force (``kvgate cache bump-knowledge``), likewise.
    """
    recs = node_records(records)
    weights = {node.id: node_weight(recs.get(node.id), node.weight, policy.ramp.steps, fresh_fleet=not recs)
               for node in policy.nodes()}
    balancers = {name: "least_conn" for name, p in pool_states(pools).items() if p.degraded}
    states = {node.id: (recs[node.id].state if node.id in recs else (st.ACTIVE if not recs else st.JOINING))
              for node in policy.nodes()}
    runtime = Runtime(weights=weights, balancers=balancers, states=states,
                      home_weights=serving_weights(policy, weights, recs))
    if namespace_floor > policy.cache.namespace_version:
        runtime = dataclasses.replace(runtime, namespace_version=namespace_floor)
    if knowledge_floor:
        runtime = dataclasses.replace(runtime, knowledge={
            p.name: int(knowledge_floor[p.name]) for p in policy.pools
            if int(knowledge_floor.get(p.name) or 0) > p.semantic.knowledge_version})
    return runtime
