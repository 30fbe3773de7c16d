"""A few views of each blueprint over fake services: the JSON shapes of the API, the admin
pages' content and their calls into the services."""

from __future__ import annotations

from kvgate.control.plane import ApplyError

from webfixtures import BEARER, POLICY_YAML


def test_api_nodes_and_node(client) -> None:
    r = client.get("/api/v1/nodes", headers=BEARER)
    assert [n["id"] for n in r.get_json()["nodes"]] == ["n1", "n2"]
    r = client.get("/api/v1/nodes/n2", headers=BEARER)
    assert r.get_json()["id"] == "n2"
    r = client.get("/api/v1/nodes/n9", headers=BEARER)
    assert r.status_code == 404 and r.get_json()["error"]["message"] == "no node 'n9'"


def test_api_drain_passes_force_and_answers_202(client, plane) -> None:
    r = client.post("/api/v1/nodes/n1/drain?force=yes", headers=BEARER)
    assert r.status_code == 202 and r.get_json()["state"] == "draining"
    assert plane.last("drain") == ("drain", ("n1",), {"reason": "API", "force": True})


def test_api_policy_get_and_apply(client, plane) -> None:
    r = client.get("/api/v1/policy", headers=BEARER)
    assert r.get_json() == {"version": 1, "yaml": POLICY_YAML, "source": "test", "applied_at": 1_700_000_000.0,
                            "digest": "d1", "files_base": None}
    r = client.put("/api/v1/policy", data=POLICY_YAML, headers={**BEARER, "X-Kvgate-Source": "kvgate apply"})
    assert r.status_code == 200 and r.get_json()["version"] == 2
    assert plane.last("apply_policy") == ("apply_policy", (), {"source": "kvgate apply", "force": False})
    r = client.put("/api/v1/policy", json={"yaml": 3}, headers=BEARER)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "bad_request"
    r = client.put("/api/v1/policy", data="pools: 3\n", headers=BEARER)
    assert r.status_code == 422 and r.get_json()["error"]["issues"]


def test_api_validate_nginx_refusal_is_422_not_500(client, plane) -> None:
    plane.fail("validate", ApplyError("nginx: [emerg] bad\n  listen"))
    r = client.post("/api/v1/policy/validate", data=POLICY_YAML, headers=BEARER)
    assert r.status_code == 422
    assert r.get_json()["error"]["issues"] == [{"path": "", "reason": "nginx: [emerg] bad listen"}]
    r = client.post("/api/v1/policy/validate", data=POLICY_YAML, headers=BEARER)
    assert r.get_json() == {"valid": True, "pools": 1, "nodes": 2}


def test_api_events_checks_its_arguments(client) -> None:
    r = client.get("/api/v1/events?limit=2", headers=BEARER)
    assert len(r.get_json()["events"]) == 2
    assert client.get("/api/v1/events?limit=x", headers=BEARER).status_code == 400
    r = client.get("/api/v1/events?before=not-an-id", headers=BEARER)
    assert r.status_code == 400 and "event id" in r.get_json()["error"]["message"]


def test_api_report_is_checked_before_the_services_see_it(client, plane) -> None:
    r = client.post("/api/v1/nodes/n1/report", json={"engine": 3}, headers=BEARER)
    assert r.status_code == 422 and r.get_json()["error"]["code"] == "invalid_report"
    assert plane.mutations() == []


def test_admin_fleet_page_lists_the_nodes(admin) -> None:
    html = admin.get("/admin/").text
    assert 'data-node="n1"' in html and 'data-node="n2"' in html
    assert "/admin/static/admin.js" in html


def test_admin_static_files_are_served_without_sign_in(client) -> None:
    r = client.get("/admin/static/admin.css")
    assert r.status_code == 200 and r.mimetype == "text/css"


def test_admin_confirmation_then_action(admin, plane) -> None:
    page = admin.get("/admin/nodes/n2/drain")
    assert page.status_code == 200 and "Only its keys move" in page.text
    r = admin.post("/admin/nodes/n2/drain", data={"csrf_token": admin.csrf}, follow_redirects=True)
    assert r.status_code == 200 and "n2: drain started" in r.text
    assert admin.get("/admin/nodes/n2/explode").status_code == 404


def test_admin_policy_check_places_the_issue_on_its_line(admin) -> None:
    bad = POLICY_YAML.replace("name: p1", "name: p1\n    balancer: ketama")
    r = admin.post("/admin/policy/check", data={"csrf_token": admin.csrf, "yaml": bad})
    assert r.status_code == 422 and 'data-path="pools[0].balancer"' in r.text
    r = admin.post("/admin/policy/check", data={"csrf_token": admin.csrf, "yaml": POLICY_YAML},
                   headers={"Accept": "application/json"})
    assert r.status_code == 200 and r.get_json()["valid"] is True and r.get_json()["changed"] is False


def test_admin_policy_apply_refuses_a_stale_base(admin, plane) -> None:
    r = admin.post("/admin/policy/apply", data={"csrf_token": admin.csrf, "yaml": POLICY_YAML, "base_version": 0})
    assert r.status_code == 409 and "changed to version 1" in r.text
    assert plane.mutations() == []
    r = admin.post("/admin/policy/apply", data={"csrf_token": admin.csrf, "yaml": POLICY_YAML, "base_version": 1},
                   follow_redirects=True)
    assert "Policy version 2 applied (gateway reloaded)." in r.text


def test_admin_cache_invalidate(admin, plane) -> None:
    r = admin.post("/admin/cache/invalidate", data={"csrf_token": admin.csrf}, follow_redirects=True)
    assert "namespace version 1 → 2" in r.text
    assert plane.last("invalidate_cache") == ("invalidate_cache", ("admin page",), {})


def test_admin_events_page_and_json(admin) -> None:
    assert "event 2" in admin.get("/admin/events").text
    assert admin.get("/admin/events?before=not-an-id").status_code == 400
    r = admin.get("/admin/events", headers={"Accept": "application/json"})
    assert [e["message"] for e in r.get_json()["events"]] == ["event 2", "event 1", "event 0"]


def test_the_plane_and_the_fake_have_what_the_views_call() -> None:
    """kvgate.web.state.Services names what the views use; the real control plane and the
    fake services of these tests must both have it (the plane moves internals, not these)."""
    import inspect
    import re

    from kvgate.control.plane import ControlPlane
    from kvgate.web.state import Services

    from webfixtures import FakePlane

    names = set(Services.__annotations__) | {n for n, v in vars(Services).items()
                                               if callable(v) and not n.startswith("_")}
    assert {"nodes_view", "drain", "policy", "lock"} <= names
    plane_src = inspect.getsource(ControlPlane)
    fake = FakePlane()
    for name in sorted(names):
        assigned = re.search(rf"self\.{name}\b[^\n=]*=(?!=)", plane_src)  # self.a, self.b = ... too
        assert hasattr(ControlPlane, name) or assigned, name
        assert hasattr(fake, name), name


def test_config_layers_defaults_then_environment_then_config(plane, monkeypatch) -> None:
    from kvgate.web import create_app

    from webfixtures import TOKEN

    app = create_app(plane, TOKEN)
    assert app.config["SESSION_COOKIE_NAME"] == "kvgate_admin" and app.config["MAX_CONTENT_LENGTH"] == 4 << 20
    monkeypatch.setenv("KVGATE_WEB_SESSION_COOKIE_NAME", "from_env")
    monkeypatch.setenv("KVGATE_WEB_SESSION_COOKIE_SECURE", "true")
    app = create_app(plane, TOKEN)
    assert app.config["SESSION_COOKIE_NAME"] == "from_env" and app.config["SESSION_COOKIE_SECURE"] is True
    app = create_app(plane, TOKEN, {"SESSION_COOKIE_NAME": "from_config"})
    assert app.config["SESSION_COOKIE_NAME"] == "from_config"
    # the session key follows the token: a new token ends every session
    assert create_app(plane, "other").config["SECRET_KEY"] != app.config["SECRET_KEY"]
