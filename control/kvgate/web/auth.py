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
