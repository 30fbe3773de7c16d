"""In-process tests of the web layer (flaskr's shape): :func:`kvgate.web.create_app` over fake
services (tests/web/webfixtures.py), driven by Flask's ``test_client`` — no waitress, no Redis,
no nginx. ``admin`` is a client signed in to the admin page, with the session's CSRF token.
"""

from __future__ import annotations

import pytest

from kvgate.web import create_app
from webfixtures import TOKEN, FakePlane, FakeTraffic, csrf_of


@pytest.fixture
def plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def app(plane: FakePlane):
    app = create_app(plane, TOKEN, {"TESTING": True})
    app.extensions["kvgate"].traffic = FakeTraffic()
    return app


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def admin(client):
    """A test client signed in to the admin page; ``admin.csrf`` is the session's CSRF token."""
    page = client.get("/admin/login")
    r = client.post("/admin/login", data={"token": TOKEN, "csrf_token": csrf_of(page.get_data(as_text=True))})
    assert r.status_code == 303, r.get_data(as_text=True)[:300]
    fleet = client.get("/admin/")
    assert fleet.status_code == 200
    client.csrf = csrf_of(fleet.get_data(as_text=True))
    return client
