"""The admin page over plain HTTP (no JavaScript, no browser) against a real stack: sign-in,
session cookie flags, CSRF, Bearer access for scripts, every action as a plain form, the
policy editor's inline errors and diff, stale edits, cache invalidation, rollback, events.

The browser test (test_admin_browser.py) drives the same page in Chromium."""

from __future__ import annotations

import re
from typing import Callable, Iterator

import pytest
import requests

from ctlfixtures import MODEL, Fleet, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cf(control_fleet_module: Callable[..., Fleet]) -> Iterator[Fleet]:
    fleet = control_fleet_module(n=4)
    fleet.wait_reports(timeout=60)
    yield fleet


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html) or re.search(r'name="csrf-token" content="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def sign_in(f: Fleet) -> tuple[requests.Session, str]:
    """A browser-like session signed in through the form; returns it and its CSRF token."""
    s = requests.Session()
    page = s.get(f.control + "/admin/login", timeout=10)
    assert page.status_code == 200
    r = s.post(f.control + "/admin/login", data={"token": f.token, "csrf_token": csrf_of(page.text), "next": "/admin/"},
               allow_redirects=False, timeout=10)
    assert r.status_code == 303 and r.headers["Location"].endswith("/admin/"), (r.status_code, r.text[:300])
    fleet_page = s.get(f.control + "/admin/", timeout=30)
    assert fleet_page.status_code == 200
    return s, csrf_of(fleet_page.text)



def traffic(f: Fleet, n: int = 24) -> None:
    for i in range(n):
        r = requests.post(f.gateway + "/v1/chat/completions", timeout=30,
                          headers={"X-Session-Id": f"conv-{i % 8}", "Cache-Control": "no-store"},
                          json={"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": f"turn {i} of conversation {i % 8}"}]})
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------- sign-in
def test_unauthenticated_requests_go_to_sign_in(cf: Fleet):
    for path in ("/admin/", "/admin/pools", "/admin/cache", "/admin/policy", "/admin/events?node=n1"):
        r = requests.get(cf.control + path, allow_redirects=False, timeout=10)
        assert r.status_code == 303, path
        assert "/admin/login?next=" in r.headers["Location"], r.headers["Location"]
    # a POST without a session changes nothing and goes to sign-in too
    r = requests.post(cf.control + "/admin/nodes/n1/drain", allow_redirects=False, timeout=10)
    assert r.status_code == 303 and "/admin/login" in r.headers["Location"]
    assert cf.node("n1")["state"] == "active"
    # the live-refresh endpoint answers 401 JSON (the page's script then goes to sign-in)
    r = requests.get(cf.control + "/admin/fleet.json", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "not_signed_in"
    # "/" leads to the page; the JSON API still wants its token
    assert requests.get(cf.control + "/", allow_redirects=False, timeout=10).headers["Location"].endswith("/admin/")
    assert requests.get(cf.control + "/api/v1/nodes", timeout=10).status_code == 401


def test_sign_in_sets_a_strict_httponly_cookie_and_refuses_a_wrong_token(cf: Fleet):
    s = requests.Session()
    page = s.get(cf.control + "/admin/login", timeout=10)
    bad = s.post(cf.control + "/admin/login", data={"token": "wrong", "csrf_token": csrf_of(page.text)},
                 allow_redirects=False, timeout=10)
    assert bad.status_code == 401 and "not the admin token" in bad.text
    assert s.get(cf.control + "/admin/", allow_redirects=False, timeout=10).status_code == 303
    # the sign-in form itself carries a CSRF token: without it, 400
    no_csrf = requests.post(cf.control + "/admin/login", data={"token": cf.token}, allow_redirects=False, timeout=10)
    assert no_csrf.status_code == 400
    ok = s.post(cf.control + "/admin/login", data={"token": cf.token, "csrf_token": csrf_of(page.text),
                                                  "next": "https://evil.example/steal"},
                allow_redirects=False, timeout=10)
    assert ok.status_code == 303
    assert ok.headers["Location"].endswith("/admin/"), "next= must not lead off the admin page"
    cookie = ok.headers["Set-Cookie"]
    assert "kvgate_admin=" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
    page = s.get(cf.control + "/admin/", timeout=30)
    assert page.status_code == 200 and 'data-node="n4"' in page.text
    for header, value in (("X-Frame-Options", "DENY"), ("Cache-Control", "no-store")):
        assert page.headers[header] == value
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    # sign out ends the session
    out = s.post(cf.control + "/admin/logout", data={"csrf_token": csrf_of(page.text)}, allow_redirects=False,
                 timeout=10)
    assert out.status_code == 303
    assert s.get(cf.control + "/admin/", allow_redirects=False, timeout=10).status_code == 303


def test_post_without_valid_csrf_is_400_and_changes_nothing(cf: Fleet):
    s, token = sign_in(cf)
    def actions() -> list:
        return [e for e in cf.events() if e["kind"].startswith(("policy", "cache", "drain"))
                or (e["kind"] == "state" and "admin page" in e["message"])]

    events_before = actions()
    version_before = cf.api("GET", "/api/v1/policy").json()["version"]
    for data in ({}, {"csrf_token": "forged"}, {"csrf_token": token + "x"}):
        r = s.post(cf.control + "/admin/nodes/n1/drain", data=data, allow_redirects=False, timeout=10)
        assert r.status_code == 400, (data, r.status_code)
        assert "CSRF" in r.text and "Nothing was changed" in r.text
        r = s.post(cf.control + "/admin/cache/invalidate", data=data, allow_redirects=False, timeout=10)
        assert r.status_code == 400
        r = s.post(cf.control + "/admin/policy/apply", data={**data, "yaml": cf.render(extra="drain: {timeout_s: 5}")},
                   allow_redirects=False, timeout=10)
        assert r.status_code == 400
    # a token of another session does not work either
    _, other = sign_in(cf)
    assert s.post(cf.control + "/admin/nodes/n1/drain", data={"csrf_token": other}, allow_redirects=False,
                  timeout=10).status_code == 400
    assert cf.node("n1")["state"] == "active"
    assert cf.api("GET", "/api/v1/policy").json()["version"] == version_before
    assert actions() == events_before


def test_a_script_without_session_gets_401_json_never_a_sign_in_page(cf: Fleet):
    r = requests.post(cf.control + "/admin/nodes/n1/drain", headers={"Accept": "application/json"},
                      allow_redirects=False, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "not_signed_in"
    assert cf.node("n1")["state"] == "active"


def test_proxy_basic_auth_header_does_not_override_the_session(cf: Fleet):
    s, _ = sign_in(cf)
    r = s.get(cf.control + "/admin/", headers={"Authorization": "Basic b3BzOnNlY3JldA=="}, timeout=30)
    assert r.status_code == 200 and 'data-node="n1"' in r.text


def test_sign_out_ends_a_copied_cookie_too(cf: Fleet):
    s, token = sign_in(cf)
    copy = requests.Session()
    copy.cookies.update(s.cookies)
    assert copy.get(cf.control + "/admin/", allow_redirects=False, timeout=30).status_code == 200
    assert s.post(cf.control + "/admin/logout", data={"csrf_token": token}, allow_redirects=False,
                  timeout=10).status_code == 303
    assert copy.get(cf.control + "/admin/", allow_redirects=False, timeout=30).status_code == 303


def test_bearer_token_needs_no_cookie_or_csrf_and_gets_json(cf: Fleet):
    auth = {"Authorization": f"Bearer {cf.token}"}
    r = requests.get(cf.control + "/admin/fleet.json", headers=auth, timeout=30)
    assert r.status_code == 200
    rows = {row["id"]: row for row in r.json()["rows"]}
    assert sorted(rows) == ["n1", "n2", "n3", "n4"]
    assert rows["n1"]["cells"]["gpu_mem"] == "no GPU"  # no NVML on these machines
    r = requests.post(cf.control + "/admin/nodes/n9/warm", headers=auth, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.post(cf.control + "/admin/nodes/n1/drain", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert cf.node("n1")["state"] == "active"


# ---------------------------------------------------------------- actions
def test_drain_warm_undrain_as_plain_forms(cf: Fleet):
    s, token = sign_in(cf)
    confirm = s.get(cf.control + "/admin/nodes/n2/drain", timeout=10)
    assert confirm.status_code == 200 and "Only its keys move" in confirm.text
    r = s.post(cf.control + "/admin/nodes/n2/drain", data={"csrf_token": csrf_of(confirm.text)},
               allow_redirects=False, timeout=30)
    assert r.status_code == 303 and r.headers["Location"].endswith("/admin/")
    page = s.get(cf.control + "/admin/", timeout=30).text
    assert "n2: drain started" in page  # the flash message
    cf.wait_state("n2", "drained", timeout=60)
    assert "drain requested by admin page" in cf.node("n2")["reason"] or any(
        "admin page" in e["message"] for e in cf.events(node="n2", kind="state"))
    # undrain is refused from active with a clear message (a flash, no change)
    r = s.post(cf.control + "/admin/nodes/n1/undrain", data={"csrf_token": token}, timeout=30)
    assert "cannot undrain" in r.text and cf.node("n1")["state"] == "active"
    r = s.post(cf.control + "/admin/nodes/n2/warm", data={"csrf_token": token}, timeout=30)
    assert r.status_code == 200 and "n2: warm-up started" in r.text
    wait_until(lambda: (cf.node("n2").get("warmup") or {}).get("status") in ("ok", "partial"), "the warm-up")
    assert cf.node("n2")["state"] == "drained"
    r = s.post(cf.control + "/admin/nodes/n2/undrain", data={"csrf_token": token}, timeout=30)
    assert "n2: undrain started" in r.text
    cf.wait_state("n2", "active", timeout=60)
    # the same action through the page's JSON path (what admin.js does)
    r = s.post(cf.control + "/admin/nodes/n3/drain", data={"csrf_token": token},
               headers={"Accept": "application/json", "X-CSRFToken": token}, timeout=30)
    assert r.status_code == 202 and r.json()["target"] == "drained"
    cf.wait_state("n3", "drained", timeout=60)
    r = s.post(cf.control + "/admin/nodes/n3/undrain", headers={"Accept": "application/json", "X-CSRFToken": token},
               timeout=30)
    assert r.status_code == 202
    cf.wait_state("n3", "active", timeout=60)
    r = s.post(cf.control + "/admin/nodes/n3/explode", data={"csrf_token": token}, timeout=10)
    assert r.status_code == 404


# ---------------------------------------------------------------- pages
def test_pools_cache_and_fleet_show_the_request_log(cf: Fleet):
    traffic(cf)
    s, _ = sign_in(cf)

    def pools_page():
        text = s.get(cf.control + "/admin/pools", timeout=30).text
        return text if "24 of 24 routed requests" in text or "of 24 routed" in text else None

    text = wait_until(pools_page, "the request log to reach the Pools page", timeout=30)
    # chash with every node up: every key on its home node
    assert re.search(r"<b>100\.0%</b>\s*<small>(\d+) of \1 routed", text), text[text.find("Affinity"):][:400]
    assert text.count("<code>") >= 8  # 8 conversations = 8 hot route keys
    cache = s.get(cf.control + "/admin/cache", timeout=30).text
    assert 'data-field="BYPASS">100.0%' in cache  # Cache-Control: no-store
    rows = s.get(cf.control + "/admin/fleet.json", timeout=30).json()["rows"]
    assert all(r["cells"]["report_age"].endswith("s") for r in rows), [r["cells"]["report_age"] for r in rows]
    hist = s.get(cf.control + "/admin/history.json", timeout=30).json()
    assert set(hist["nodes"]) == {"n1", "n2", "n3", "n4"}
    assert all(len(v["t"]) >= 2 and len(v["waiting"]) == len(v["t"]) for v in hist["nodes"].values())


def test_cache_invalidate_bumps_the_namespace_version_and_keeps_comments(cf: Fleet):
    s, token = sign_in(cf)
    before = cf.api("GET", "/api/v1/policy").json()
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "cache me"}]}
    assert requests.post(cf.gateway + "/v1/chat/completions", json=body, timeout=30).headers["X-Kvgate-Cache"] == "MISS"
    wait_until(lambda: requests.post(cf.gateway + "/v1/chat/completions", json=body, timeout=30)
               .headers["X-Kvgate-Cache"] == "HIT", "a cache HIT")
    # the page reuses its reading of Redis for a few seconds
    wait_until(lambda: re.search(r'data-field="entries">\s*(≈ )?[1-9]', s.get(cf.control + "/admin/cache",
                                                                            timeout=30).text), "a cache entry")
    r = s.post(cf.control + "/admin/cache/invalidate", data={"csrf_token": token}, timeout=60)
    assert r.status_code == 200 and "namespace version 1 → 2" in r.text
    after = cf.api("GET", "/api/v1/policy").json()
    assert after["version"] == before["version"] + 1
    # the running text with one line changed: the fixture's policy has no cache section, so the
    # bump adds one (a policy with one keeps its comments: tests/unit/test_policy_edit.py)
    added = [ln for ln in after["yaml"].splitlines() if ln not in before["yaml"].splitlines()]
    assert [ln.strip() for ln in added] in (["cache:", "namespace_version: 2"], ["cache: {namespace_version: 2}"]), added
    assert all(ln in after["yaml"].splitlines() for ln in before["yaml"].splitlines())
    assert any(e["kind"] == "cache_invalidated" for e in cf.events(kind="cache"))
    # Put the pre-invalidation text back (the module's other tests diff against it). It says
    # namespace version 1, yet the version in force stays 2: the entry the invalidation retired
    # is never read again.
    assert cf.api("PUT", "/api/v1/policy", data=before["yaml"]).status_code == 200
    assert requests.post(cf.gateway + "/v1/chat/completions", json=body, timeout=30).headers["X-Kvgate-Cache"] == "MISS"
    page = s.get(cf.control + "/admin/cache", timeout=30).text
    assert re.search(r'data-field="namespace_version">2\s*<small>\(the policy says 1', page)
    # the next invalidation goes above the highest version ever in force, never back to 2
    r = s.post(cf.control + "/admin/cache/invalidate", data={"csrf_token": token}, timeout=60)
    assert r.status_code == 200 and "namespace version 2 → 3" in r.text
    assert cf.api("PUT", "/api/v1/policy", data=before["yaml"]).status_code == 200


def test_policy_editor_inline_error_diff_apply_stale_and_rollback(cf: Fleet):
    s, token = sign_in(cf)
    running = cf.api("GET", "/api/v1/policy").json()
    page = s.get(cf.control + "/admin/policy", timeout=30).text
    assert "Routing policy" in page and "balancer: chash" in page
    bad = running["yaml"].replace("balancer: chash", "balancer: ketama")
    r = s.post(cf.control + "/admin/policy/check", data={"csrf_token": token, "yaml": bad,
                                                        "base_version": running["version"]}, timeout=30)
    assert r.status_code == 422
    # the error sits in the line of the bad field
    m = re.search(r'<li value="(\d+)" id="line-\d+" class="bad" data-line="\d+"><code>([^<]*)</code>\s*<div class="field-error"[^>]*'
                  r'data-path="pools\[0\]\.balancer"', r.text)
    assert m and "balancer: ketama" in m.group(2), r.text[r.text.find("yaml-lines"):][:800]
    assert 'id="policy-apply"' not in r.text  # nothing to apply
    # a YAML syntax error points at its line too
    r = s.post(cf.control + "/admin/policy/check", data={"csrf_token": token, "yaml": running["yaml"] + "\n  : [\n"},
               timeout=30)
    assert r.status_code == 422 and "YAML syntax error" in r.text and 'class="bad"' in r.text
    good = running["yaml"].replace("drain: {timeout_s: 120}", "drain: {timeout_s: 90}")
    assert good != running["yaml"]
    r = s.post(cf.control + "/admin/policy/check", data={"csrf_token": token, "yaml": good,
                                                        "base_version": running["version"]}, timeout=30)
    assert r.status_code == 200 and 'id="policy-apply"' in r.text
    assert '<span class="diff-del">-drain: {timeout_s: 120}</span>' in r.text
    assert '<span class="diff-add">+drain: {timeout_s: 90}</span>' in r.text
    # an edit based on an older version is not applied blindly
    r = s.post(cf.control + "/admin/policy/apply", data={"csrf_token": token, "yaml": good,
                                                        "base_version": running["version"] - 1}, timeout=30)
    assert r.status_code == 409 and "changed to version" in r.text
    assert cf.api("GET", "/api/v1/policy").json()["version"] == running["version"]
    r = s.post(cf.control + "/admin/policy/apply", data={"csrf_token": token, "yaml": good,
                                                        "base_version": running["version"]}, timeout=60)
    assert r.status_code == 200 and f"Policy version {running['version'] + 1} applied" in r.text
    assert "policy_applied" in r.text  # the recent policy events on the page
    assert cf.api("GET", "/api/v1/policy").json()["yaml"] == good
    # an invalid policy sent straight to apply is refused with the inline error; nothing changes
    r = s.post(cf.control + "/admin/policy/apply", data={"csrf_token": token, "yaml": bad,
                                                        "base_version": running["version"] + 1}, timeout=30)
    assert r.status_code == 422 and 'data-path="pools[0].balancer"' in r.text
    assert cf.api("GET", "/api/v1/policy").json()["version"] == running["version"] + 1
    # roll back to the version before, as a plain form
    v = s.get(cf.control + f"/admin/policy/versions/{running['version']}", timeout=10)
    assert v.status_code == 200 and "+drain: {timeout_s: 120}" in v.text
    r = s.post(cf.control + f"/admin/policy/versions/{running['version']}/rollback", data={"csrf_token": token},
               timeout=60)
    assert r.status_code == 200 and f"Rolled back to version {running['version']}" in r.text
    assert cf.api("GET", "/api/v1/policy").json()["yaml"] == running["yaml"]


def test_events_page_filters_by_node(cf: Fleet):
    s, _ = sign_in(cf)
    page = s.get(cf.control + "/admin/events?node=n2", timeout=30).text
    nodes = re.findall(r'<tr class="kind-[a-z_]+" data-kind="[a-z_]+" data-node="([^"]*)"', page)
    assert nodes and set(nodes) == {"n2"}, nodes[:20]
    page = s.get(cf.control + "/admin/events?kind=policy_applied", timeout=30).text
    kinds = re.findall(r'data-kind="([a-z_]+)"', page)
    assert kinds and set(kinds) == {"policy_applied"}
    # newest first
    times = [float(t) for t in re.findall(r'<time datetime="([\d.]+)"', s.get(cf.control + "/admin/events",
                                                                               timeout=30).text)]
    assert times == sorted(times, reverse=True) and len(times) > 5
    assert s.get(cf.control + "/admin/events?before=not-an-id", timeout=30).status_code == 400
    assert s.get(cf.control + "/admin/nope", timeout=10).status_code == 404



def test_pool_without_a_serving_node_is_flagged(cf: Fleet):
    s, token = sign_in(cf)
    for n in ("n1", "n2", "n3"):
        assert s.post(cf.control + f"/admin/nodes/{n}/drain", data={"csrf_token": token}, timeout=30).status_code == 200
    # the last one only with the box ticked
    r = s.post(cf.control + "/admin/nodes/n4/drain", data={"csrf_token": token}, timeout=30)
    assert "Drain even if it is the last serving node" in r.text and cf.node("n4")["state"] == "active"
    r = s.post(cf.control + "/admin/nodes/n4/drain", data={"csrf_token": token, "force": "1"}, timeout=30)
    assert "n4: drain started" in r.text
    page = s.get(cf.control + "/admin/", timeout=30).text
    assert "no node serving: every request to this pool fails (502)" in page
    pools = s.get(cf.control + "/admin/fleet.json", timeout=30).json()["pools"]
    assert pools[0]["serving"] == 0
    r = s.post(cf.control + "/admin/nodes/n4/drain", data={"csrf_token": token}, timeout=30)
    assert "n4 is already draining" in r.text or "n4 is already drained" in r.text
    for n in ("n1", "n2", "n3", "n4"):
        cf.wait_state(n, "drained", timeout=60)
        assert s.post(cf.control + f"/admin/nodes/{n}/undrain", data={"csrf_token": token}, timeout=30).status_code == 200
    for n in ("n1", "n2", "n3", "n4"):
        cf.wait_state(n, "active", timeout=60)
    assert "4 of 4 nodes serving" in s.get(cf.control + "/admin/", timeout=30).text


def test_redis_down_policy_changes_are_refused_and_the_page_says_so(cf: Fleet):
    """Last in the module: it stops the fleet's Redis, then brings it back with `kvgate up`."""
    s, token = sign_in(cf)
    running = cf.api("GET", "/api/v1/policy").json()
    edited = running["yaml"].replace("drain: {timeout_s: 120}", "drain: {timeout_s: 60}")
    import redis as redis_lib

    try:
        redis_lib.Redis(port=cf.redis_port).shutdown(nosave=True)
    except redis_lib.ConnectionError:
        pass  # the server closed the connection: it is going down
    wait_until(lambda: not _pings(cf.redis_port), "Redis to stop", timeout=20)
    try:
        r = s.post(cf.control + "/admin/policy/apply", data={"csrf_token": token, "yaml": edited}, timeout=60)
        assert "Redis is unreachable: policy changes are refused" in r.text
        r = cf.api("PUT", "/api/v1/policy", data=edited)
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
        r = s.post(cf.control + "/admin/cache/invalidate", data={"csrf_token": token}, timeout=60)
        assert "Redis is unreachable" in r.text
        page = s.get(cf.control + "/admin/", timeout=30)
        assert page.status_code == 200 and "unknown (Redis down)" in page.text
        assert s.get(cf.control + "/admin/pools", timeout=30).status_code == 200
    finally:
        up = cf.kvgate("up", str(cf.policy_path))
        assert up.returncode == 0, up.stdout + up.stderr
    assert cf.api("GET", "/api/v1/policy").json()["yaml"] == running["yaml"]


def _pings(port: int) -> bool:
    import redis as redis_lib

    try:
        return bool(redis_lib.Redis(port=port, socket_timeout=1).ping())
    except redis_lib.RedisError:
        return False
