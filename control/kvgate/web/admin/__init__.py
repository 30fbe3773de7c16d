"""The admin page (blueprint in :mod:`kvgate.web.admin.views`) and its figures.

Nothing here imports Flask at package level: :mod:`kvgate.web.admin.history` is fed by the
control plane, and services never import Flask.
"""
