"""The drain step: a draining node's in-flight counts → drained, leaked count, or timeout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from ..policy.model import Policy
from . import states as st
from .changes import Change, Inflight, Save, transition
from .records import Drain, NodeRecord

LEAKED_COUNT_S = 10.0
"""How long a draining node's engine must be idle, with the gateway's in-flight count for it
standing still above 0, before that count is taken for a leak (see :func:`drain_step`)."""


@dataclass(frozen=True)
class DrainInputs:
    """What a drain round sees.

    Attributes:
        gateway_inflight: node id → the gateway's ``kvgate_upstream_inflight``, None when the
            gateway's ``/metrics`` could not be read this round (unknown).
        engine_inflight: node id → ``(running + waiting, unavailable)`` from the engine's own
            ``/metrics`` (:meth:`kvgate.control.probes.engine_inflight`): ``(None, why)`` when
            its figures are unavailable, ``(None, None)`` when unknown now. Only the draining
            nodes whose engine was scraped this round are judged.
    """

    gateway_inflight: Mapping[str, float] | None
    engine_inflight: Mapping[str, tuple[float | None, str | None]] = field(default_factory=dict)


def new_drain(now: float, policy: Policy) -> Drain:
    """The drain record of a drain that starts now (it ends by ``drain.timeout_s``)."""
    return Drain(started=now, deadline=now + policy.drain.timeout_s)


def drain_step(records: Mapping[str, NodeRecord], inputs: DrainInputs, policy: Policy, now: float) -> list[Change]:
    """Finish drains: a draining node whose gateway in-flight count and engine running + waiting
    were both 0 on two checks in a row (the first at least 1 s into the drain) is drained. When
    the engine's figures are unavailable, the gateway's count alone decides, and the drain
    record and reason say so (``decided_on: "gateway"``). An engine idle for
    :data:`LEAKED_COUNT_S` while the gateway's count stands still above 0 means the count leaked
    (an nginx worker that crashed never ran its log phase): drained. ``drain.timeout_s`` ends
    any other drain (``timed_out``). Unknown (None) is never idle.

    Returns per judged node :class:`Inflight` and a :class:`Save` of its drain figures or a
    :class:`Transition` to ``drained``."""
    out: list[Change] = []
    for rec in records.values():
        if rec.state != st.DRAINING or rec.id not in inputs.engine_inflight or rec.drain is None:
            continue
        d = rec.drain
        g = (inputs.gateway_inflight or {}).get(rec.id, 0.0) if inputs.gateway_inflight is not None else None
        e, unavailable = inputs.engine_inflight[rec.id]
        out.append(Inflight(rec.id, max(g or 0.0, e or 0.0)))
        engine_idle = (e is not None and e <= 0) or bool(unavailable)
        idle = g is not None and g <= 0 and engine_idle and now - d.started >= 1.0
        # The engine has been idle while the gateway's count stood still: nothing can still be
        # streaming (the gateway relays as the engine produces), so the count leaked.
        stuck = d.gateway_stuck
        if g is not None and g > 0 and e == 0:
            if not stuck or stuck[0] != g:
                stuck = (g, now)
        else:
            stuck = None
        d = dataclasses.replace(d, inflight_gateway=g, inflight_engine=e,
                                engine_figures=f"unavailable: {unavailable}" if unavailable else None,
                                decided_on="gateway" if unavailable else "gateway and engine",
                                zero_checks=d.zero_checks + 1 if idle else 0, gateway_stuck=stuck)
        took = now - d.started
        if d.zero_checks >= 2:
            if unavailable:
                reason = (f"no request in flight at the gateway after {took:.1f}s; engine figures unavailable "
                          f"({unavailable}): decided on the gateway's in-flight count")
            else:
                reason = f"no request in flight after {took:.1f}s"
            out.append(transition(rec, st.DRAINED, reason, now, drain=d))
        elif stuck and now - stuck[1] >= LEAKED_COUNT_S:
            out.append(transition(rec, st.DRAINED, f"engine idle for {now - stuck[1]:.0f}s while the gateway still "
                                  f"counted {g:.0f} in flight (a count leaked by a crashed nginx worker); "
                                  f"drained after {took:.1f}s", now, drain=d))
        elif now >= d.deadline:
            d = dataclasses.replace(d, timed_out=True)
            out.append(transition(rec, st.DRAINED, f"drain timeout after {took:.0f}s with "
                                  f"{'?' if g is None else f'{g:.0f}'} request(s) in flight at the gateway, "
                                  f"{'?' if e is None else f'{e:.0f}'} at the engine"
                                  + (" (engine figures unavailable)" if unavailable else ""), now, drain=d))
        else:
            out.append(Save(rec.evolve(drain=d)))
    return out
