"""The node state machine (DESIGN.md, Operations).

::

    joining ─► warming ─► ramping ─► active ─► draining ─► drained
                  │          │          │          ▲  │         │
                  └──────────┴──────────┴─► ejected ┘  └─────────┴─► warming (undrain)

* ``joining``: in the policy, not yet taking traffic; waits for its first passing health
  check (an engine that is not up yet keeps it joining, it is not ejected).
* ``warming``: warm-up prompts are being sent to it directly; no traffic.
* ``ramping``: taking a growing share of its target weight (the policy's ``ramp.steps``).
* ``active``: taking its full (load-following) weight.
* ``draining``: no new keys (nginx ``down``); waits for its in-flight requests.
* ``drained``: no traffic, nothing in flight; safe to stop or upgrade.
* ``ejected``: failed ``health.eject_after`` checks in a row; no traffic until it passes
  ``health.recover_after``; it comes back through ``warming`` when its engine restarted
  (the prefix cache is gone), else straight to the state it had.

Only ``ramping`` and ``active`` nodes receive traffic. Any other move is refused
with :class:`InvalidTransition` (the API answers 409).
"""

from __future__ import annotations

JOINING = "joining"
WARMING = "warming"
RAMPING = "ramping"
ACTIVE = "active"
DRAINING = "draining"
DRAINED = "drained"
EJECTED = "ejected"

STATES = (JOINING, WARMING, RAMPING, ACTIVE, DRAINING, DRAINED, EJECTED)
SERVING = frozenset({RAMPING, ACTIVE})
"""States in which a node is in the ring with a non-zero weight."""

TRANSITIONS: dict[str, frozenset[str]] = {
    JOINING: frozenset({WARMING, DRAINING}),
    WARMING: frozenset({RAMPING, DRAINING, EJECTED}),
    RAMPING: frozenset({ACTIVE, DRAINING, EJECTED}),
    ACTIVE: frozenset({DRAINING, EJECTED}),
    DRAINING: frozenset({DRAINED, WARMING}),
    DRAINED: frozenset({WARMING}),
    EJECTED: frozenset({WARMING, RAMPING, ACTIVE, DRAINING}),
}


class InvalidTransition(ValueError):
    """A state change the machine does not allow (e.g. drain a drained node)."""

    def __init__(self, node_id: str, current: str, wanted: str, action: str | None = None):
        self.node_id, self.current, self.wanted = node_id, current, wanted
        allowed = sorted(s for s, targets in TRANSITIONS.items() if wanted in targets)
        what = action or f"move to {wanted}"
        super().__init__(f"cannot {what} node {node_id!r}: it is {current} "
                         f"({wanted} is reachable only from {', '.join(allowed)})")


def check(node_id: str, current: str, wanted: str, action: str | None = None) -> None:
    """Raise :class:`InvalidTransition` unless ``current → wanted`` is allowed."""
    if wanted not in TRANSITIONS.get(current, frozenset()):
        raise InvalidTransition(node_id, current, wanted, action)
