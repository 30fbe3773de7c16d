"""The control plane: node states, live weights, health, drain, warm-up and ramp, the admin API.

``kvgate control`` serves :func:`kvgate.web.create_app` with waitress; the
:class:`kvgate.control.plane.ControlPlane` behind it owns the gateway's nginx config
while it runs. Its state (node records, agent reports, events, applied policy
versions) lives in Redis (:mod:`kvgate.control.store`), so a restart loses nothing.
See docs/control-plane.md.
"""
