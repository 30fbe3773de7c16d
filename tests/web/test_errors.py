"""The one error table (kvgate.web.errors): each domain exception answers with its status, type
and code as JSON from the API and the admin page's script, and as the HTML error page (with
its status) from the admin page."""

from __future__ import annotations

import pytest

import redis

from kvgate.batch.files import BatchApiError, FileInUse, FileNotFound, FileTooLarge, InvalidRequest
from kvgate.batch.jobs import BatchNotCancellable, BatchNotFound
from kvgate.control.plane import ApplyError, Conflict, NodeHasWork, NotFound
from kvgate.control.report import ReportError
from kvgate.control.states import InvalidTransition
from kvgate.control.apikeys import ApiKeyError, UnknownKey
from kvgate.control.store import StoreError
from kvgate.policy import PolicyError
from kvgate.policy.loader import PolicyIssue
from kvgate.web.errors import ERRORS, lookup

from webfixtures import BEARER

WORK = [{"id": "n2", "state": "draining", "inflight": 3, "inflight_gateway": 3.0, "inflight_engine": 2.0}]

CASES = [
    # exception, status, type, code, fields of the error object beyond message/type/code
    (NotFound("no node 'n9'"), 404, "not_found_error", "not_found", {}),
    (InvalidTransition("n1", "active", "warming", "undrain"), 409, "conflict_error", "invalid_transition",
     {"state": "active", "wanted": "warming"}),
    (Conflict("a warm-up of n1 is already running"), 409, "conflict_error", "conflict", {}),
    (NodeHasWork("removing n2 would cut requests in flight", WORK), 409, "conflict_error", "node_has_work",
     {"nodes": WORK, "inflight": 3}),
    (ReportError([{"path": "engine", "reason": "not an object"}]), 422, "invalid_request_error", "invalid_report",
     {"issues": [{"path": "engine", "reason": "not an object"}]}),
    (PolicyError("<policy>", [PolicyIssue("pools[0].balancer", "unknown balancer")]), 422,
     "invalid_request_error", "invalid_policy", {"issues": [{"path": "pools[0].balancer", "reason": "unknown balancer"}]}),
    (ApplyError("nginx -t: bad listen"), 500, "server_error", "apply_failed", {}),
    (StoreError("Redis is unreachable: policy changes are refused"), 503, "server_error", "redis_unavailable", {}),
    (ValueError("limit must be an integer"), 400, "invalid_request_error", "bad_request", {}),
    (UnknownKey("no API key 'key_0123456789ab'"), 404, "not_found_error", "api_key_not_found", {}),
    (ApiKeyError("unknown tenant 'x'"), 400, "invalid_request_error", "invalid_api_key_request", {}),
    (redis.RedisError("connection refused"), 503, "server_error", "redis_unavailable", {}),
    # the Batch API's (tests/web/test_batch_api.py has them under /v1/, as tenants get them)
    (FileNotFound("No such File object: file-x", "file_id"), 404, "invalid_request_error", "file_not_found",
     {"param": "file_id"}),
    (BatchNotFound("No batch found with id 'batch_x'.", "batch_id"), 404, "invalid_request_error",
     "batch_not_found", {"param": "batch_id"}),
    (FileTooLarge("The file is larger than 1,024 bytes", "file"), 413, "invalid_request_error", "file_too_large",
     {"param": "file"}),
    (FileInUse("the input of batch_x", "file_id"), 409, "invalid_request_error", "file_in_use", {"param": "file_id"}),
    (BatchNotCancellable("Cannot cancel a batch with status 'completed'.", "completed"), 409,
     "invalid_request_error", "batch_not_cancellable", {"param": None}),
    (InvalidRequest("limit must be between 1 and 100", "limit"), 400, "invalid_request_error", "invalid_request",
     {"param": "limit"}),
    (BatchApiError("bad"), 400, "invalid_request_error", "invalid_request", {"param": None}),
]
IDS = [type(c[0]).__name__ for c in CASES]


def test_every_entry_of_the_table_is_tested() -> None:
    from flask_wtf.csrf import CSRFError

    assert set(ERRORS) == {type(c[0]) for c in CASES} | {CSRFError}


def test_the_most_specific_entry_wins() -> None:
    assert lookup(NodeHasWork("x", [])).code == "node_has_work"      # not Conflict's
    assert lookup(InvalidTransition("n", "a", "b")).code == "invalid_transition"  # not ValueError's
    assert lookup(KeyError("x")) is None


@pytest.mark.parametrize("exc,status,type_,code,extra", CASES, ids=IDS)
def test_api_answers_the_table_as_json(client, plane, exc, status, type_, code, extra) -> None:
    plane.fail("drain", exc)
    r = client.post("/api/v1/nodes/n1/drain", headers=BEARER)
    assert r.status_code == status
    err = r.get_json()["error"]
    assert (err["type"], err["code"]) == (type_, code)
    assert err["message"]
    for k, v in extra.items():
        assert err[k] == v, k


@pytest.mark.parametrize("exc,status,type_,code,extra", CASES, ids=IDS)
def test_admin_page_renders_the_table_as_its_html_error_page(admin, plane, exc, status, type_, code, extra) -> None:
    plane.fail("node_view", exc)  # the confirmation page reads the node first
    r = admin.get("/admin/nodes/n1/drain")
    assert r.status_code == status
    assert r.mimetype == "text/html"
    html = r.get_data(as_text=True)
    assert lookup(exc).title in html
    assert 'class="error"' in html or "<h1" in html


@pytest.mark.parametrize("exc,status,type_,code,extra", CASES, ids=IDS)
def test_admin_action_refused_answers_the_tables_status_and_code(client, plane, exc, status, type_, code,
                                                                  extra) -> None:
    """The page's script and Bearer clients get the same status and code as the API."""
    plane.fail("warm", exc)
    r = client.post("/admin/nodes/n1/warm", headers=BEARER)
    assert r.status_code == status
    assert r.get_json()["error"]["code"] == code


def test_admin_action_refused_in_a_browser_is_a_flash_and_a_redirect(admin, plane) -> None:
    plane.fail("undrain", InvalidTransition("n1", "active", "warming", "undrain"))
    r = admin.post("/admin/nodes/n1/undrain", data={"csrf_token": admin.csrf})
    assert r.status_code == 303 and r.headers["Location"].endswith("/admin/")
    page = admin.get("/admin/").get_data(as_text=True)
    assert "cannot undrain node &#39;n1&#39;" in page or "cannot undrain node 'n1'" in page


def test_http_errors_json_for_the_api_html_for_the_admin_page(admin) -> None:
    r = admin.get("/api/v1/nope", headers=BEARER)
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "not_found"
    r = admin.delete("/api/v1/nodes", headers=BEARER)
    assert r.status_code == 405 and r.get_json()["error"]["code"] == "method_not_allowed"
    r = admin.get("/admin/nope")
    assert r.status_code == 404 and r.mimetype == "text/html" and "There is no page at /admin/nope." in r.text
    r = admin.put("/admin/policy")
    assert r.status_code == 405 and r.mimetype == "text/html"
    big = b"x" * (4 * 1024 * 1024 + 1)
    r = admin.post("/api/v1/nodes/n1/report", data=big, headers={**BEARER, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "too_large"
    r = admin.put("/api/v1/policy", data=big, headers=BEARER)  # the policy's own limit speaks first
    assert r.status_code == 400 and "policy larger than 1048576 bytes" in r.get_json()["error"]["message"]
    r = admin.post("/admin/policy/check", data={"csrf_token": admin.csrf, "yaml": "x" * (4 * 1024 * 1024 + 1)},
                   headers={"Accept": "text/html"})
    assert r.status_code == 413 and "larger than the control plane accepts" in r.text
