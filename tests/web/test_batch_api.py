"""OpenAI's Files and Batch API on the control plane (kvgate.web.batch_api, kvgate.batch.files,
kvgate.batch.jobs): Flask's test client over the fake plane with a real Redis and a real data
directory, and the real ``openai`` SDK against the app served by waitress.

What the worker does with a batch (validation, execution) is tests/integration/test_batch_runner.py.
"""

from __future__ import annotations

import hashlib
import io
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis as redis_lib

from integration.gwfixtures import RedisServer, _start_redis, free_port
from kvgate.batch import records
from kvgate.batch.jobs import BatchApi
from kvgate.control.apikeys import ApiKeys
from kvgate.control.store import Store
from kvgate.policy import parse_policy_text
from kvgate.web import create_app
from webfixtures import POLICY_YAML, TOKEN, FakePlane

MAX_FILE = 4096
LINE = b'{"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
FILE_FIELDS = {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status", "status_details"}
BATCH_FIELDS = {"id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
                "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
                "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
                "metadata", "model", "usage"}


def policy(auth: str = "required", *, enabled: bool = True):
    """The web tests' policy with ``gateway.auth: auth``, tenants team-a and team-b (and default
    under optional), a small file limit and two completion windows."""
    base = POLICY_YAML.replace('gateway: {listen: "127.0.0.1:18080"}',
                               f'gateway: {{listen: "127.0.0.1:18080", auth: {auth}}}')
    assert base != POLICY_YAML
    tenants = "tenants:\n  - {id: team-a}\n  - {id: team-b}\n" + ("  - {id: default}\n" if auth == "optional" else "")
    return parse_policy_text(base + f"batch: {{enabled: {str(enabled).lower()}, max_file_bytes: {MAX_FILE}, "
                             "completion_windows: [24h, 1h]}\n" + (tenants if auth != "off" else ""))


class BatchPlane(FakePlane):
    """The fake plane with a real Store (API keys in Redis) and the real Batch API services."""

    def __init__(self, url: str, run_dir: Path):
        super().__init__()
        self.store = Store(url)
        self.policy = policy()
        self.batch_api = BatchApi(self.store.r, lambda: self.policy, run_dir)
        self.run_dir = run_dir

    def use(self, auth: str, enabled: bool = True) -> None:
        self.policy = policy(auth, enabled=enabled)

    @property
    def files(self):
        return self.batch_api.files

    @property
    def batches(self):
        return self.batch_api.batches


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _start_redis(tmp_path_factory.mktemp("batchapi"))
    yield server
    server.stop()


@pytest.fixture
def plane(redis_server: RedisServer, tmp_path: Path) -> BatchPlane:  # overrides tests/web/conftest.py's
    redis_server.client().flushall()
    return BatchPlane(redis_server.url, tmp_path / "run")


@pytest.fixture
def keys(plane: BatchPlane) -> dict[str, dict[str, str]]:
    """A Bearer header per tenant: ``keys["team-a"]``, ``keys["team-b"]``."""
    ak = ApiKeys(plane.store)
    return {t: {"Authorization": f"Bearer {ak.create(t)[1]}"} for t in ("team-a", "team-b")}


def upload(client, headers: dict[str, str], data: bytes = LINE * 3, name: str = "input.jsonl",
           purpose: str | None = "batch", **extra: Any):
    form: dict[str, Any] = {"file": (io.BytesIO(data), name), **extra}
    if purpose is not None:
        form["purpose"] = purpose
    return client.post("/v1/files", data=form, headers=headers, content_type="multipart/form-data")


def create_batch(client, headers: dict[str, str], file_id: str, **body: Any):
    return client.post("/v1/batches", headers=headers, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **body})


def assert_error(r, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["code"] == code and err["param"] == param, err
    assert err["type"] in ("invalid_request_error", "server_error") and err["message"]
    return err


# ------------------------------------------------------------------ files
def test_upload_answers_the_file_object_and_keeps_the_bytes(client, keys, plane) -> None:
    data = LINE * 3
    r = upload(client, keys["team-a"], data, name="../../etc/input.jsonl")
    assert r.status_code == 200, r.text
    f = r.get_json()
    assert set(f) == FILE_FIELDS
    assert f["object"] == "file" and f["id"].startswith("file-") and f["bytes"] == len(data)
    assert f["filename"] == "input.jsonl" and f["purpose"] == "batch" and f["status"] == "processed"
    assert f["status_details"] is None and f["expires_at"] == f["created_at"] + 30 * 86400
    assert client.get(f"/v1/files/{f['id']}", headers=keys["team-a"]).get_json() == f

    content = client.get(f"/v1/files/{f['id']}/content", headers=keys["team-a"])
    assert content.status_code == 200 and content.data == data
    assert content.headers["Content-Type"] == "application/octet-stream"
    files_dir = plane.run_dir / "data" / "files"
    assert sorted(p.name for p in files_dir.iterdir()) == [f["id"]]  # no temp file left behind
    meta = plane.store.r.hgetall(records.file_key(f["id"]))
    assert meta["sha256"] == hashlib.sha256(data).hexdigest() and meta["tenant"] == "team-a"

    listed = client.get("/v1/files", headers=keys["team-a"]).get_json()
    assert listed == {"object": "list", "data": [f], "first_id": f["id"], "last_id": f["id"], "has_more": False}

    gone = client.delete(f"/v1/files/{f['id']}", headers=keys["team-a"])
    assert gone.get_json() == {"id": f["id"], "object": "file", "deleted": True}
    assert_error(client.get(f"/v1/files/{f['id']}", headers=keys["team-a"]), 404, "file_not_found", "file_id")
    assert list(files_dir.iterdir()) == []


def test_expires_after_and_the_bad_uploads(client, keys) -> None:
    h = keys["team-a"]
    f = upload(client, h, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}).get_json()
    assert f["expires_at"] == f["created_at"] + 3600
    assert_error(upload(client, h, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}),
                 400, "invalid_request", "expires_after")
    assert_error(upload(client, h, purpose="fine-tune"), 400, "invalid_request", "purpose")
    assert_error(upload(client, h, purpose="batch_output"), 400, "invalid_request", "purpose")
    assert_error(upload(client, h, purpose=None), 400, "invalid_request", "purpose")
    assert_error(upload(client, h, data=b""), 400, "invalid_request", "file")
    assert_error(client.post("/v1/files", data={"purpose": "batch"}, headers=h), 400, "invalid_request", "file")


def test_a_file_over_the_limit_is_refused_and_not_kept(client, keys, plane) -> None:
    h = keys["team-a"]
    assert upload(client, h, data=b"x" * MAX_FILE).status_code == 200  # exactly the limit
    err = assert_error(upload(client, h, data=b"x" * (MAX_FILE + 1)), 413, "file_too_large", "file")
    assert f"{MAX_FILE:,} bytes" in err["message"]
    # a body over the route's whole limit (the file's + 1 MiB of framing) stops before it is parsed
    assert_error(upload(client, h, data=b"x" * (MAX_FILE + 1024 * 1024 + 1)), 413, "file_too_large", "file")
    assert len(list((plane.run_dir / "data" / "files").iterdir())) == 1
    assert len(client.get("/v1/files", headers=h).get_json()["data"]) == 1


def test_files_list_pages_and_orders(client, keys) -> None:
    h = keys["team-a"]
    ids = [upload(client, h, name=f"f{i}.jsonl").get_json()["id"] for i in range(5)]
    page = client.get("/v1/files?limit=2", headers=h).get_json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    assert page["first_id"] == ids[4] and page["last_id"] == ids[3]
    page = client.get(f"/v1/files?limit=2&after={page['last_id']}", headers=h).get_json()
    assert [f["id"] for f in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
    page = client.get(f"/v1/files?limit=2&after={page['last_id']}", headers=h).get_json()
    assert [f["id"] for f in page["data"]] == [ids[0]] and page["has_more"] is False
    asc = client.get("/v1/files?order=asc&limit=3", headers=h).get_json()
    assert [f["id"] for f in asc["data"]] == ids[:3]
    assert client.get("/v1/files?purpose=batch_output", headers=h).get_json()["data"] == []
    assert_error(client.get("/v1/files?limit=0", headers=h), 400, "invalid_request", "limit")
    assert_error(client.get("/v1/files?limit=x", headers=h), 400, "invalid_request", "limit")
    assert_error(client.get("/v1/files?order=up", headers=h), 400, "invalid_request", "order")


def test_another_tenants_file_and_batch_are_not_found(client, keys) -> None:
    a, b = keys["team-a"], keys["team-b"]
    fid = upload(client, a).get_json()["id"]
    bid = create_batch(client, a, fid).get_json()["id"]
    for r in (client.get(f"/v1/files/{fid}", headers=b), client.get(f"/v1/files/{fid}/content", headers=b),
              client.delete(f"/v1/files/{fid}", headers=b)):
        assert_error(r, 404, "file_not_found", "file_id")
    assert_error(client.get("/v1/files/file-000000000000000000000000", headers=a), 404, "file_not_found", "file_id")
    assert client.get("/v1/files/..%2F..%2Fetc%2Fpasswd/content", headers=a).status_code == 404
    assert_error(client.get("/v1/files/..%2E/content", headers=a), 404, "file_not_found", "file_id")
    assert_error(create_batch(client, b, fid), 400, "invalid_request", "input_file_id")
    for r in (client.get(f"/v1/batches/{bid}", headers=b), client.post(f"/v1/batches/{bid}/cancel", headers=b)):
        assert_error(r, 404, "batch_not_found", "batch_id")
    assert client.get("/v1/files", headers=b).get_json()["data"] == []
    assert client.get("/v1/batches", headers=b).get_json()["data"] == []
    assert client.get(f"/v1/batches/{bid}", headers=a).get_json()["status"] == "validating"


# ------------------------------------------------------------------ batches
def test_create_batch_answers_a_validating_batch_with_every_field(client, keys, plane) -> None:
    h = keys["team-a"]
    fid = upload(client, h).get_json()["id"]
    r = create_batch(client, h, fid, metadata={"job": "nightly"})
    assert r.status_code == 200, r.text
    b = r.get_json()
    assert set(b) == BATCH_FIELDS
    assert b["object"] == "batch" and b["id"].startswith("batch_") and b["status"] == "validating"
    assert b["endpoint"] == "/v1/chat/completions" and b["input_file_id"] == fid and b["completion_window"] == "24h"
    assert b["expires_at"] == b["created_at"] + 86400 and b["metadata"] == {"job": "nightly"}
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and b["errors"] is None
    assert all(b[k] is None for k in ("output_file_id", "error_file_id", "in_progress_at", "finalizing_at",
                                      "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"))
    assert client.get(f"/v1/batches/{b['id']}", headers=h).get_json() == b
    rec = plane.store.r.hgetall(records.batch_key(b["id"]))
    assert rec["tenant"] == "team-a" and plane.store.r.zscore(records.OPEN, b["id"]) == b["expires_at"]
    one_hour = create_batch(client, h, fid, completion_window="1h").get_json()
    assert one_hour["expires_at"] == one_hour["created_at"] + 3600


@pytest.mark.parametrize("body, param", [
    ({"endpoint": "/v1/responses"}, "endpoint"),
    ({"endpoint": None}, "endpoint"),
    ({"completion_window": "48h"}, "completion_window"),
    ({"input_file_id": "file-000000000000000000000000"}, "input_file_id"),
    ({"input_file_id": 7}, "input_file_id"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": ["k"]}, "metadata"),
])
def test_create_batch_refuses_bad_fields(client, keys, plane, body, param) -> None:
    h = keys["team-a"]
    fid = upload(client, h).get_json()["id"]
    assert_error(create_batch(client, h, fid, **body), 400, "invalid_request", param)
    assert plane.store.r.zcard(records.OPEN) == 0


def test_create_batch_needs_a_json_object_and_a_batch_input(client, keys, plane) -> None:
    h = keys["team-a"]
    assert_error(client.post("/v1/batches", headers=h, data="nope", content_type="application/json"),
                 400, "invalid_request", None)
    out = plane.files.write_output("team-a", "out.jsonl", [{"id": "x"}])
    assert out["purpose"] == "batch_output"
    assert_error(create_batch(client, h, out["id"]), 400, "invalid_request", "input_file_id")


def test_batches_list_pages_newest_first(client, keys) -> None:
    h = keys["team-a"]
    fid = upload(client, h).get_json()["id"]
    ids = [create_batch(client, h, fid).get_json()["id"] for _ in range(5)]
    page = client.get("/v1/batches?limit=2", headers=h).get_json()
    assert page["object"] == "list" and [b["id"] for b in page["data"]] == [ids[4], ids[3]]
    assert page["first_id"] == ids[4] and page["last_id"] == ids[3] and page["has_more"] is True
    page = client.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=h).get_json()
    assert [b["id"] for b in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
    page = client.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=h).get_json()
    assert [b["id"] for b in page["data"]] == [ids[0]] and page["has_more"] is False
    assert len(client.get("/v1/batches", headers=h).get_json()["data"]) == 5  # default 20
    assert_error(client.get("/v1/batches?limit=101", headers=h), 400, "invalid_request", "limit")


def test_cancel_and_the_input_file_of_a_running_batch(client, keys, plane) -> None:
    h = keys["team-a"]
    fid = upload(client, h).get_json()["id"]
    bid = create_batch(client, h, fid).get_json()["id"]
    assert_error(client.delete(f"/v1/files/{fid}", headers=h), 409, "file_in_use", "file_id")
    b = client.post(f"/v1/batches/{bid}/cancel", headers=h).get_json()
    assert b["status"] == "cancelling" and isinstance(b["cancelling_at"], int)
    assert client.post(f"/v1/batches/{bid}/cancel", headers=h).get_json() == b  # idempotent
    # the worker ends it; a finished batch cannot be cancelled
    assert records.transition(plane.store.r, bid, records.CANCELLED, allowed_from=[records.CANCELLING])
    assert client.post(f"/v1/batches/{bid}/cancel", headers=h).get_json()["status"] == "cancelled"
    other = create_batch(client, h, fid).get_json()["id"]
    assert records.transition(plane.store.r, other, records.COMPLETED, allowed_from=[records.VALIDATING])
    err = assert_error(client.post(f"/v1/batches/{other}/cancel", headers=h), 409, "batch_not_cancellable")
    assert "status 'completed'" in err["message"]
    assert client.delete(f"/v1/files/{fid}", headers=h).get_json()["deleted"] is True


# ------------------------------------------------------------------ auth
def test_keys_the_batch_api_accepts(client, keys, plane) -> None:
    ak = ApiKeys(plane.store)
    rec, secret = ak.create("team-a")
    ok = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/files", headers=ok).status_code == 200
    ak.revoke(rec.id)
    err = assert_error(client.get("/v1/files", headers=ok), 401, "invalid_api_key")
    assert "revoked" in err["message"] and secret not in err["message"]
    for headers in ({}, {"Authorization": "Bearer kvg-unknown"}, {"Authorization": f"Bearer {TOKEN}"},
                    {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}):
        r = client.get("/v1/batches", headers=headers)
        assert_error(r, 401, "invalid_api_key")
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="kvgate"'
    good = keys["team-a"]["Authorization"].split()[1]
    assert_error(client.get(f"/v1/files?api_key={good}", headers=keys["team-a"]), 401, "invalid_api_key")
    assert_error(client.get(f"/v1/files?after={good}", headers=keys["team-a"]), 401, "invalid_api_key")
    # a key of a tenant the policy no longer has
    plane.use("required")
    plane.policy = plane.policy.model_copy(update={"tenants": [t for t in plane.policy.tenants if t.id != "team-b"]})
    assert_error(client.get("/v1/files", headers=keys["team-b"]), 401, "invalid_api_key")
    # the Batch API never takes the admin token, and the admin API never takes a tenant's key
    assert client.get("/api/v1/nodes", headers=keys["team-a"]).status_code == 401


def test_auth_off_is_one_anonymous_tenant(client, plane) -> None:
    plane.use("off")
    f = upload(client, {}).get_json()
    assert client.get(f"/v1/files/{f['id']}", headers={"Authorization": "Bearer anything"}).status_code == 200
    assert plane.store.r.hget(records.file_key(f["id"]), "tenant") == ""
    assert create_batch(client, {}, f["id"]).get_json()["status"] == "validating"


def test_auth_optional_keyless_is_the_default_tenant(client, keys, plane) -> None:
    plane.use("optional")
    f = upload(client, {}).get_json()
    assert plane.store.r.hget(records.file_key(f["id"]), "tenant") == "default"
    default_key = {"Authorization": f"Bearer {ApiKeys(plane.store).create('default')[1]}"}
    assert client.get(f"/v1/files/{f['id']}", headers=default_key).status_code == 200
    assert_error(client.get(f"/v1/files/{f['id']}", headers=keys["team-a"]), 404, "file_not_found", "file_id")
    assert_error(client.get("/v1/files", headers={"Authorization": "Bearer kvg-nope"}), 401, "invalid_api_key")


def test_unknown_v1_paths_and_a_disabled_batch_api(client, keys, plane) -> None:
    assert_error(client.get("/v1/nope"), 404, "unknown_url")
    assert_error(client.put("/v1/files", headers=keys["team-a"]), 405, "method_not_allowed")
    assert client.get("/api/v1/nope").status_code == 401  # the admin API still hides its URL map
    plane.use("required", enabled=False)
    assert_error(client.get("/v1/files", headers=keys["team-a"]), 404, "unknown_url")


def test_redis_down_is_503_in_openai_format(client, keys, plane, tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    plane.store = Store(dead, timeout_s=0.2)  # the key lookup
    err = assert_error(client.get("/v1/files", headers=keys["team-a"]), 503, "redis_unavailable")
    assert err["type"] == "server_error"
    plane.use("off")  # no key lookup: the file store's own Redis calls
    plane.batch_api = BatchApi(redis_lib.Redis.from_url(dead, decode_responses=True, socket_connect_timeout=0.2),
                               lambda: plane.policy, tmp_path)
    assert_error(client.get("/v1/batches"), 503, "redis_unavailable")
    assert_error(upload(client, {}), 503, "redis_unavailable")
    assert not any((tmp_path / "data" / "files").glob("file-*"))  # no bytes without their metadata


# ------------------------------------------------------------------ the OpenAI SDK, unchanged
def test_the_openai_sdk_parses_every_object(plane, keys, tmp_path: Path) -> None:
    import openai
    import waitress
    from waitress import wasyncore

    port = free_port()
    server = waitress.create_server(create_app(plane, TOKEN), host="127.0.0.1", port=port, threads=2,
                                    asyncore_use_poll=True)  # poll: closing the sockets below ends its loop
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                           api_key=keys["team-a"]["Authorization"].split()[1], max_retries=0, timeout=10)
    try:
        path = tmp_path / "requests.jsonl"
        path.write_bytes(LINE * 2)
        with open(path, "rb") as fh:
            f = client.files.create(file=fh, purpose="batch")
        assert f.object == "file" and f.bytes == len(LINE) * 2 and f.filename == "requests.jsonl"
        assert f.purpose == "batch" and f.status == "processed"
        assert client.files.retrieve(f.id) == f
        assert [x.id for x in client.files.list()] == [f.id]
        assert client.files.content(f.id).content == LINE * 2

        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "sdk"})
        assert b.status == "validating" and b.request_counts.total == 0 and b.metadata == {"run": "sdk"}
        assert client.batches.retrieve(b.id) == b
        more = [client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id
                for _ in range(2)]
        page = client.batches.list(limit=2)
        assert [x.id for x in page.data] == more[::-1] and page.has_more
        assert [x.id for x in client.batches.list(limit=2)] == [*more[::-1], b.id]  # the SDK follows after=
        assert client.batches.cancel(b.id).status == "cancelling"

        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_000000000000000000000000")
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="7d")  # type: ignore[arg-type]
        assert bad.value.param == "completion_window"
        with pytest.raises(openai.AuthenticationError) as auth:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="kvg-nope", max_retries=0).files.list()
        assert auth.value.code == "invalid_api_key"
        with pytest.raises(openai.ConflictError):
            client.files.delete(f.id)  # the input of batches not yet finished
    finally:
        client.close()
        server.task_dispatcher.shutdown()
        wasyncore.close_all(server._map)
        thread.join(5)
        assert not thread.is_alive()
