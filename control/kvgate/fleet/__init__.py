"""The control plane's decisions, with no Flask, no threads, no Redis and no nginx.

:mod:`.records` holds the typed node and pool records (and their JSON, as the store keeps
it); each step (:mod:`.health`, :mod:`.drain`, :mod:`.ramp`, :mod:`.overload`,
:mod:`.weights`) is a pure function ``(records, inputs, cfg, now) -> list[Change]``
(:mod:`.changes`); :class:`kvgate.control.plane.ControlPlane` gathers the inputs, runs the
steps and applies their changes (store, events, metrics, the gateway's runtime).
"""
