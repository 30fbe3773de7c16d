"""The node state machine moved to :mod:`kvgate.fleet.states`; re-exported here for existing imports."""

from ..fleet.states import (  # noqa: F401
    ACTIVE,
    DRAINED,
    DRAINING,
    EJECTED,
    JOINING,
    RAMPING,
    SERVING,
    STATES,
    TRANSITIONS,
    WARMING,
    InvalidTransition,
    check,
)
