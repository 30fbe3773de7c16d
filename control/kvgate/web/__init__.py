"""The control plane's web layer (Flask, in the shape of Flask's flaskr tutorial).

:func:`create_app` takes the services (the control plane) and the admin token and returns the
app ``kvgate control`` serves with waitress:

- blueprint ``root`` (:mod:`kvgate.web.api`): ``/`` → ``/admin/``, ``/healthz``, ``/metrics``
- blueprint ``api`` (:mod:`kvgate.web.api`): the JSON API under ``/api/v1``
- blueprint ``admin`` (:mod:`kvgate.web.admin.views`): the admin page under ``/admin``
- blueprint ``openai`` (:mod:`kvgate.web.batch_api`): OpenAI's Files and Batch API under ``/v1``,
  for tenants (their API keys, never the admin token)
- :mod:`kvgate.web.errors`: one table from domain exceptions to status, error type and code,
  rendered as JSON for the API and as the HTML error page for the admin page
- :mod:`kvgate.web.auth`: Bearer token, session, CSRF, ``@require_admin``

Views are thin: they parse the request, call the services and render; the services never
import Flask (this package imports it only inside :func:`create_app`, so the plane may use
:mod:`kvgate.web.admin.history` without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_CONTENT_BYTES = 4 * 1024 * 1024
"""The largest request body (a policy is at most 1 MiB; the admin form holds one). ``POST
/v1/files`` sets its own: policy ``batch.max_file_bytes`` (:mod:`kvgate.web.batch_api`)."""


def create_app(services: Any, token: str, config: Mapping[str, Any] | None = None):
    """The Flask app over ``services`` (a :class:`kvgate.control.plane.ControlPlane`, or a fake
    with the methods the views call) with admin token ``token``.

    Config layers, later wins: kvgate's defaults (JSON order kept, 4 MiB bodies, the admin
    session cookie and CSRF settings of :func:`kvgate.web.auth.defaults`) → environment
    variables ``KVGATE_WEB_<KEY>`` (values parsed as JSON where they are, e.g.
    ``KVGATE_WEB_SESSION_COOKIE_SECURE=true``) → ``config`` (tests: ``{"TESTING": True}``).
    """
    from flask import Flask, request

    from . import auth, errors
    from .admin.fleet import TrafficCache
    from .admin.views import bp as admin_bp
    from .admin import tenants as _tenants  # noqa: F401 - the Tenants page's views, on admin_bp
    from .admin import costs as _costs  # noqa: F401 - the Costs page's views, on admin_bp
    from .admin import batches as _batches  # noqa: F401 - the Batches page's views, on admin_bp
    from .api import bp as api_bp
    from .api import root as root_bp
    from .batch_api import bp as openai_bp
    from .state import WebState

    app = Flask("kvgate.web")
    app.config.update({"MAX_CONTENT_LENGTH": MAX_CONTENT_BYTES, **auth.defaults(token)})
    # objects keep their field order (OpenAI's objects are documented in order); Flask 2.3+
    # ignores the old JSON_SORT_KEYS setting, this is its replacement
    app.json.sort_keys = False
    app.config.from_prefixed_env("KVGATE_WEB")
    if config:
        app.config.update(config)
    app.extensions["kvgate"] = WebState(services=services, token=token, traffic=TrafficCache())
    auth.csrf.init_app(app)
    errors.register(app)

    @app.before_request
    def _auth_unrouted():
        # No route (404) or not this method (405): the blueprints' checks do not run, so the
        # API's holds here — an unauthenticated caller learns nothing about which URLs exist.
        # The admin page's prefix answers its HTML 404 (or /admin → /admin/) without sign-in, and
        # OpenAI's /v1/ its OpenAI-format 404/405 (that API's URLs are public; its keys are tenants').
        if request.url_rule is None and request.path not in ("/", "/healthz", "/favicon.ico") \
                and not (request.path == "/admin" or request.path.startswith("/admin/")) \
                and not errors.is_openai_path():
            return auth.require_token()
        return None

    app.register_blueprint(root_bp)
    app.register_blueprint(api_bp)
    app.register_blueprint(admin_bp)
    app.register_blueprint(openai_bp)
    return app
