"""Who may call what (kvgate.web.auth): the API's Bearer token, the admin page's session and
CSRF token, and that every admin view is behind @require_admin."""

from __future__ import annotations

from webfixtures import BEARER, TOKEN, csrf_of


def test_api_needs_the_token(client, plane) -> None:
    r = client.get("/api/v1/nodes")
    assert r.status_code == 401
    assert r.get_json()["error"] == {"message": r.get_json()["error"]["message"], "type": "authentication_error",
                                     "code": "invalid_token"}
    assert client.get("/api/v1/nodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/v1/nodes", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert client.get("/api/v1/nodes", headers=BEARER).status_code == 200
    assert client.post("/api/v1/nodes/n1/drain", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert plane.mutations() == []
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=BEARER).status_code == 200


def test_unknown_urls_need_the_token_too(client) -> None:
    """No token: 401 whether or not the URL exists (the URL map is not disclosed)."""
    assert client.get("/api/v1/nope").status_code == 401
    assert client.delete("/api/v1/nodes").status_code == 401
    assert client.get("/api/v1/nope", headers=BEARER).status_code == 404


def test_public_paths(client) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.get_json() == {"status": "ok", "policy_version": 1, "redis": True}
    assert client.get("/favicon.ico").status_code == 204
    r = client.get("/")
    assert r.status_code == 302 and r.headers["Location"].endswith("/admin/")


def test_public_reads_open_gets_not_mutations(client, plane) -> None:
    plane.policy = plane.policy.model_copy(update={"control": plane.policy.control.model_copy(
        update={"public_reads": True})})
    assert client.get("/api/v1/nodes").status_code == 200
    assert client.post("/api/v1/nodes/n1/drain").status_code == 401
    assert plane.mutations() == []


def test_admin_without_a_session_redirects_browsers_and_refuses_scripts(client) -> None:
    r = client.get("/admin/pools")
    assert r.status_code == 303 and "/admin/login?next=/admin/pools" in r.headers["Location"]
    r = client.get("/admin/fleet.json")
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "not_signed_in"
    r = client.get("/admin/", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_token"
    r = client.get("/admin/fleet.json", headers=BEARER)
    assert r.status_code == 200 and [row["id"] for row in r.get_json()["rows"]] == ["n1", "n2"]


def test_sign_in_with_a_wrong_token_is_refused(client) -> None:
    page = client.get("/admin/login")
    r = client.post("/admin/login", data={"token": "nope", "csrf_token": csrf_of(page.text)})
    assert r.status_code == 401 and "not the admin token" in r.text
    assert client.get("/admin/").status_code == 303
    # the sign-in form needs its CSRF token as well
    assert client.post("/admin/login", data={"token": TOKEN}).status_code == 400


def test_admin_post_needs_the_csrf_token(admin, plane) -> None:
    r = admin.post("/admin/nodes/n1/drain")
    assert r.status_code == 400 and "Nothing was changed" in r.text
    r = admin.post("/admin/nodes/n1/drain", data={"csrf_token": "forged"}, headers={"Accept": "application/json"})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "csrf_failed"
    assert plane.mutations() == []
    r = admin.post("/admin/nodes/n1/drain", data={"csrf_token": admin.csrf})
    assert r.status_code == 303
    r = admin.post("/admin/nodes/n2/warm", headers={"X-CSRFToken": admin.csrf, "Accept": "application/json"})
    assert r.status_code == 202
    assert plane.mutations() == ["drain", "warm"]
    assert plane.last("warm")[2]["reason"] == "admin page"


def test_bearer_needs_no_csrf_and_acts_as_the_token(client, plane) -> None:
    r = client.post("/admin/nodes/n1/drain", headers=BEARER)
    assert r.status_code == 202 and r.get_json()["target"] == "drained"
    assert plane.last("drain")[2]["reason"] == "admin page (token)"


def test_sign_out_revokes_the_session(admin, plane) -> None:
    r = admin.post("/admin/logout", data={"csrf_token": admin.csrf})
    assert r.status_code == 303 and r.headers["Location"].endswith("/admin/login")
    assert plane.store.revoked
    assert admin.get("/admin/").status_code == 303


def test_every_admin_view_but_sign_in_requires_admin(app) -> None:
    open_endpoints = {"admin.login", "admin.static"}
    for rule in app.url_map.iter_rules():
        if not rule.endpoint.startswith("admin."):
            continue
        view = app.view_functions[rule.endpoint]
        assert getattr(view, "require_admin", False) or rule.endpoint in open_endpoints, rule.endpoint


def test_admin_pages_carry_the_security_headers(admin) -> None:
    r = admin.get("/admin/")
    assert r.headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
    assert r.headers["Cache-Control"] == "no-store"
    assert "X-Frame-Options" not in admin.get("/healthz").headers
