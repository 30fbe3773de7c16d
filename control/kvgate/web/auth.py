"""Who may call what: the admin token as a Bearer header, the admin page's session, CSRF.

- The API (``/api/v1``, ``/metrics``): ``Authorization: Bearer <admin token>`` on every
  request (:func:`require_token`, the API blueprint's ``before_request``); reads too unless the
  policy sets ``control.public_reads``.
- The admin page: :func:`require_admin` on each view. A Bearer header with the token passes
  (``g.admin_via = "bearer"``; no cookie, no CSRF token; answers are JSON); a wrong one is
  401. Otherwise a signed session cookie (:func:`sign_in`: HttpOnly, SameSite=Strict, valid
  SESSION_HOURS, revocable in Redis by :func:`sign_out`) passes (``g.admin_via = "session"``),
  and every mutation must carry the session's CSRF token (Flask-WTF: form field ``csrf_token``
  or header ``X-CSRFToken``); a bad one answers 400 before the view runs. Without either, a
  JSON client gets 401 ``not_signed_in`` and a browser a redirect to the sign-in page.

- The Batch API (``/v1/files``, ``/v1/batches``): a tenant's API key, checked here as the
  gateway checks it (:func:`tenant_of_request`; the gateway passes the header through).

Tokens are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any

from flask import current_app, g, redirect, request, session, url_for
from flask_wtf.csrf import CSRFProtect

from .. import keys
from ..control.apikeys import digest
from ..control.store import StoreError
from .errors import json_error, wants_json
from .state import services, state

SESSION_HOURS = 12

csrf = CSRFProtect()


def defaults(token: str) -> dict[str, Any]:
    """The session and CSRF settings for ``token`` (the first layer of ``create_app``'s config)."""
    return {
        # The session key is derived from the admin token: sessions survive a control-plane
        # restart and end when the token is replaced.
        "SECRET_KEY": hmac.new(token.encode(), b"kvgate admin session key", hashlib.sha256).hexdigest(),
        "SESSION_COOKIE_NAME": "kvgate_admin",
        "SESSION_COOKIE_HTTPONLY": True,
        "SESSION_COOKIE_SAMESITE": "Strict",
        "PERMANENT_SESSION_LIFETIME": dt.timedelta(hours=SESSION_HOURS),
        "SESSION_REFRESH_EACH_REQUEST": False,  # the cookie expires 12 h after sign-in, however busy the page
        "WTF_CSRF_CHECK_DEFAULT": False,   # checked by require_admin: a Bearer request needs none
        "WTF_CSRF_TIME_LIMIT": None,       # valid as long as the session (an open page may sit for hours)
    }


def bearer() -> str | None:
    """The token of an ``Authorization: Bearer`` header (other schemes, e.g. a proxy's Basic
    auth, are not ours: the session decides then)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def is_token(given: str) -> bool:
    """Whether ``given`` is the admin token (constant time)."""
    return hmac.compare_digest(given.encode(), state().token.encode())


def require_token():
    """``before_request`` of the API: 401 ``invalid_token`` unless the Bearer token is the admin
    token (GET/HEAD pass without one when the running policy has ``control.public_reads``)."""
    policy = services().policy
    if request.method in ("GET", "HEAD") and policy is not None and policy.control.public_reads:
        return None
    given = bearer()
    if given is None or not is_token(given):
        return json_error(401, "missing or wrong admin token: send 'Authorization: Bearer <token>' "
                          "(`kvgate token` prints it)", "authentication_error", "invalid_token")
    return None


def _mark() -> str:
    """What a signed-in session holds: bound to the token, so a new token ends every session."""
    return hmac.new(state().token.encode(), b"kvgate admin signed in", hashlib.sha256).hexdigest()[:32]


def signed_in() -> bool:
    """A session cookie of this token, younger than SESSION_HOURS, not signed out."""
    if not hmac.compare_digest(str(session.get("admin", "")), _mark()):
        return False
    try:
        if time.time() - float(session.get("iat", 0)) > SESSION_HOURS * 3600:
            return False
    except (TypeError, ValueError):
        return False
    sid = str(session.get("sid", ""))
    try:
        return bool(sid) and not services().store.session_revoked(sid)
    except StoreError:
        return True  # Redis down: the page stays usable (it says Redis is down); see docs/admin.md


def sign_in() -> None:
    """Start a fresh session (and CSRF token) for the admin."""
    session.clear()
    session["admin"] = _mark()
    session["sid"] = secrets.token_urlsafe(16)
    session["iat"] = time.time()
    session.permanent = True


def sign_out() -> None:
    """End the session; its id is revoked in Redis, so a copy of the cookie stops working too
    (until Redis forgets it, when it would have expired). Raises nothing: a failure is logged."""
    sid = str(session.get("sid", ""))
    if sid:
        try:
            services().store.revoke_session(
                sid, int(SESSION_HOURS * 3600 - (time.time() - float(session.get("iat", 0)))))
        except (StoreError, TypeError, ValueError) as exc:
            current_app.logger.warning("sign-out not recorded: %s", exc)
    session.clear()


def require_admin(view: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of an admin-page view: Bearer token, or a session (+ CSRF on a mutation)."""

    @functools.wraps(view)
    def wrapped(*args: Any, **kwargs: Any):
        given = bearer()
        if given is not None:
            if is_token(given):
                g.admin_via = "bearer"
                return view(*args, **kwargs)
            return json_error(401, "wrong admin token in the Authorization header (`kvgate token` prints it)",
                              "authentication_error", "invalid_token")
        if signed_in():
            g.admin_via = "session"
            if request.method not in ("GET", "HEAD", "OPTIONS"):
                csrf.protect()  # raises CSRFError → 400, before the view runs: nothing changes
            return view(*args, **kwargs)
        if wants_json():  # the page's script (fetch) and other JSON clients: 401, never a redirect
            return json_error(401, "not signed in (or the session ended): sign in again", "authentication_error",
                              "not_signed_in", login=url_for("admin.login"))
        nxt = request.full_path.rstrip("?") if request.method == "GET" else None
        return redirect(url_for("admin.login", next=nxt), 303)

    wrapped.require_admin = True  # type: ignore[attr-defined]  (tests check every admin view has it)
    return wrapped


def actor() -> str:
    """Who acts, as events and node reasons say it."""
    return "admin page" if g.get("admin_via") == "session" else "admin page (token)"


# ------------------------------------------------------------------ tenants (the Batch API)
_MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
            "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
_INCORRECT = "Incorrect API key provided. Create keys with `kvgate keys create` or on the admin page."
_MALFORMED = "The Authorization header is malformed: expected `Authorization: Bearer YOUR_KEY`."
_REVOKED = "The API key provided has been revoked."
_IN_QUERY = ("API keys are not accepted in the query string (URLs end up in logs): send "
             "`Authorization: Bearer YOUR_KEY` instead, and revoke the key you sent.")
_QUERY_KEY_NAMES = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token", "auth"})
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")
MAX_KEY_CHARS = 256
"""The longest Bearer token looked up (the gateway's ``tenant.MAX_TOKEN``)."""


def key_in_query() -> bool:
    """Whether the query string carries an API key (a ``kvg-`` value, or a parameter named like
    a credential): refused, as the gateway refuses it (lua/kvgate/tenant.lua)."""
    if not request.query_string:
        return False
    if any(v.lower().find("kvg-") >= 0 or k.lower().find("kvg-") >= 0 for k, v in request.args.items(multi=True)):
        return True
    return any(k.lower() in _QUERY_KEY_NAMES for k in request.args)


def _refuse(message: str):
    resp = json_error(401, message, "invalid_request_error", "invalid_api_key", param=None)
    resp.headers["WWW-Authenticate"] = 'Bearer realm="kvgate"'
    return resp


def tenant_of_request() -> tuple[str | None, Any]:
    """The tenant of a Batch API request → ``(tenant id, None)``, or ``(None, the 401/503
    response)``, by the running policy's ``gateway.auth``:

    - ``off``: ``""`` (one anonymous tenant), whatever the headers say
    - ``optional``: no Authorization header = the tenant ``default``; a key must be valid
    - ``required``: a valid key, always

    A valid key is ``Authorization: Bearer kvg-...`` whose SHA-256 names a record in Redis
    (:mod:`kvgate.control.apikeys`) that is not revoked, of a tenant the policy has. A key in the
    query string is refused. Refusals: 401 ``invalid_api_key`` in OpenAI's format (the key is
    never echoed); 503 ``redis_unavailable`` (StoreError) when Redis cannot be asked.
    """
    policy = services().policy
    mode = policy.gateway.auth if policy is not None else "off"
    if mode == "off":
        return "", None
    if key_in_query():
        return None, _refuse(_IN_QUERY)
    header = request.headers.get("Authorization")
    if header is None:
        if mode == "optional":
            from ..policy.model import DEFAULT_TENANT

            return DEFAULT_TENANT, None
        return None, _refuse(_MISSING)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_KEY_CHARS or not set(token) <= _TOKEN_CHARS:
        return None, _refuse(_MALFORMED)
    store = services().store
    rec = store._call("read api key", store.r.hgetall, keys.apikey_key(digest(token)))
    if not rec:
        return None, _refuse(_INCORRECT)
    if rec.get("revoked") == "1":
        return None, _refuse(_REVOKED)
    tenant = rec.get("tenant", "")
    if tenant not in {t.id for t in policy.tenants}:
        return None, _refuse(_INCORRECT)  # a key of a tenant the policy no longer has
    g.api_key_id = rec.get("id")
    return tenant, None
