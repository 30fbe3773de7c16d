"""kvgate.batch.files on a real Redis and a temp data directory: atomic writes with their SHA-256,
the worker's output files, expiry, tenancy, and where the data directory is."""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis as redis_lib

from integration.gwfixtures import RedisServer, _start_redis
from kvgate.batch import records
from kvgate.batch.files import (FileNotFound, FileStore, FileTooLarge, InvalidRequest, clean_filename,
                                resolve_data_dir)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _start_redis(tmp_path_factory.mktemp("batchfiles"))
    yield server
    server.stop()


@pytest.fixture
def store(redis_server: RedisServer, tmp_path: Path) -> FileStore:
    r = redis_lib.Redis(port=redis_server.port, decode_responses=True)
    r.flushall()
    return FileStore(tmp_path / "data", r, retention_days=2)


def test_create_records_size_and_sha256_and_leaves_no_temp_file(store: FileStore) -> None:
    data = b'{"custom_id": "a"}\n' * 1000
    f = store.create("t", io.BytesIO(data), "in.jsonl", "batch", max_bytes=len(data))
    assert f["bytes"] == len(data) and f["expires_at"] == f["created_at"] + 2 * 86400
    h = store.record("t", f["id"])
    assert h["sha256"] == hashlib.sha256(data).hexdigest()
    assert store.path("t", f["id"]).read_bytes() == data
    assert store.path("t", f["id"]).stat().st_mode & 0o777 == 0o600  # tenants' prompts: kvgate's user only
    assert [p.name for p in store.dir.iterdir()] == [f["id"]]
    with pytest.raises(FileTooLarge):
        store.create("t", io.BytesIO(data + b"x"), "big.jsonl", "batch", max_bytes=len(data))
    with pytest.raises(InvalidRequest):
        store.create("t", io.BytesIO(data), "x", "assistants", max_bytes=len(data))
    assert [p.name for p in store.dir.iterdir()] == [f["id"]]
    assert store.r.zcard(records.tenant_files_key("t")) == 1


def test_write_output_lines_and_a_rewrite_under_the_same_id(store: FileStore) -> None:
    out = store.write_output("t", "batch_x_output.jsonl", [{"id": "1", "custom_id": "a"}, '{"id":"2"}', b'{"id":"3"}\n'])
    assert out["purpose"] == "batch_output" and out["filename"] == "batch_x_output.jsonl"
    with store.open("t", out["id"]) as fh:
        assert fh.read() == b'{"id":"1","custom_id":"a"}\n{"id":"2"}\n{"id":"3"}\n'
    again = store.write_output("t", "batch_x_output.jsonl", [{"id": "1"}], file_id=out["id"])
    assert again["id"] == out["id"] and again["bytes"] == len(b'{"id":"1"}\n')
    assert store.r.zcard(records.tenant_files_key("t")) == 1
    with pytest.raises(InvalidRequest):
        store.write_output("u", "x.jsonl", [], file_id=out["id"])  # another tenant's id
    with pytest.raises(InvalidRequest):
        store.write_output("t", "x.jsonl", [], file_id="../../etc/passwd")
    assert store.write_output("t", "empty.jsonl", [])["bytes"] == 0


def test_tenancy_and_malformed_ids(store: FileStore) -> None:
    f = store.create("t", io.BytesIO(b"{}\n"), "a", "batch", max_bytes=100)
    for tenant, fid in (("u", f["id"]), ("", f["id"]), ("t", "../" + f["id"]), ("t", f["id"].upper())):
        with pytest.raises(FileNotFound):
            store.get(tenant, fid)
    with pytest.raises(FileNotFound):
        store.delete("u", f["id"])
    assert store.get("t", f["id"])["id"] == f["id"]


def test_an_expired_file_is_gone(store: FileStore) -> None:
    old = store.create("t", io.BytesIO(b"{}\n"), "old", "batch", max_bytes=100, now=1_000)
    new = store.create("t", io.BytesIO(b"{}\n"), "new", "batch", max_bytes=100)
    assert [f["id"] for f in store.list("t")["data"]] == [new["id"]]
    with pytest.raises(FileNotFound):
        store.get("t", old["id"])
    assert not (store.dir / old["id"]).exists()  # removed when looked up
    store.create("t", io.BytesIO(b"{}\n"), "old2", "batch", max_bytes=100, now=1_000)
    assert store.purge_expired("t") == 1 and store.r.zcard(records.tenant_files_key("t")) == 1


def test_the_data_directory_and_file_names(tmp_path: Path) -> None:
    assert resolve_data_dir(None, tmp_path) == tmp_path / "data"
    assert resolve_data_dir("files-here", tmp_path) == tmp_path / "files-here"
    assert resolve_data_dir("/srv/kvgate", tmp_path) == Path("/srv/kvgate")
    assert clean_filename("C:\\Users\\me\\in.jsonl") == "in.jsonl"
    assert clean_filename("a\x00b\n.jsonl") == "ab.jsonl"
    assert clean_filename("") == clean_filename("../") == "upload.jsonl"
    assert len(clean_filename("x" * 1000)) == 255


def test_purge_orphans_removes_bytes_redis_no_longer_knows(store: FileStore) -> None:
    kept = store.create("t", io.BytesIO(b'{"a": 1}\n'), "in.jsonl", "batch", max_bytes=100)
    orphan = store.dir / "file-0123456789abcdef01234567"
    orphan.write_bytes(b"lost with its record")
    tmp = store.dir / ".tmp-file-x-1234"
    tmp.write_bytes(b"half")
    assert store.purge_orphans(min_age_s=3600) == 0  # young: a write may be in progress
    assert store.purge_orphans(min_age_s=0, now=time.time() + 1) == 2
    assert sorted(p.name for p in store.dir.iterdir()) == [kept["id"]]
