"""OpenAI's Files and Batch API for tenants: blueprint ``openai`` under ``/v1``.

The gateway's client listener passes ``/v1/files`` and ``/v1/batches`` (with the client's
Authorization header) to the control plane, which serves them here; the OpenAI SDKs work
unchanged against the gateway's base URL. Authentication is the tenant's API key, as the
gateway checks it (:func:`kvgate.web.auth.tenant_of_request`: ``gateway.auth`` off → one
anonymous tenant, optional → no key = tenant ``default``); never the admin token. A tenant
sees only its own files and batches: another tenant's id answers 404 as an unknown one.

=======  ===========================  ============================================================
method   path                         what
=======  ===========================  ============================================================
POST     /v1/files                    multipart ``file`` + ``purpose=batch`` (+ optional
                                      ``expires_after[anchor]=created_at``,
                                      ``expires_after[seconds]``) → the File object; 413 over
                                      ``batch.max_file_bytes``
GET      /v1/files                    ``?after=&limit=&order=asc|desc&purpose=`` → list object
GET      /v1/files/<id>               the File object
GET      /v1/files/<id>/content       the bytes (``application/octet-stream``)
DELETE   /v1/files/<id>               ``{id, object: "file", deleted: true}``; 409 ``file_in_use``
                                      while a batch not yet finished reads it
POST     /v1/batches                  ``{input_file_id, endpoint, completion_window, metadata}``
                                      → the Batch object, status ``validating``
GET      /v1/batches                  ``?after=&limit=`` (1..100, default 20), newest first
GET      /v1/batches/<id>             the Batch object
POST     /v1/batches/<id>/cancel      → ``cancelling`` (idempotent); 409 once finishing/finished
=======  ===========================  ============================================================

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (the table in
:mod:`kvgate.web.errors`). ``batch.enabled: false`` answers 404 on every path here.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, jsonify, request, send_file
from werkzeug.exceptions import RequestEntityTooLarge

from ..batch.files import MAX_LIST as MAX_FILES_LIST
from ..batch.files import FileInUse, FileTooLarge, InvalidRequest
from ..batch.jobs import DEFAULT_LIST
from .auth import tenant_of_request
from .errors import json_error
from .state import services

MULTIPART_SLACK = 1024 * 1024
"""Body bytes allowed on top of ``batch.max_file_bytes`` for the multipart framing and the
other form fields (the gateway's ``client_max_body_size`` for /v1/files is the same sum)."""

bp = Blueprint("openai", __name__, url_prefix="/v1")


@bp.before_request
def _tenant():
    policy = services().policy
    if policy is None:
        return json_error(503, "The control plane has no policy in force yet; retry in a few seconds.",
                          "server_error", "not_ready", param=None)
    if not policy.batch.enabled:
        return json_error(404, f"Invalid URL ({request.method} {request.path}): the Batch API is turned off "
                          "(policy batch.enabled)", "invalid_request_error", "unknown_url", param=None)
    tenant, refusal = tenant_of_request()
    if refusal is not None:
        return refusal
    g.tenant = tenant
    return None


def _int_arg(name: str, default: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"Invalid value for '{name}': expected an integer.", name) from None


# ------------------------------------------------------------------ files
@bp.post("/files")
def create_file():
    cfg = services().policy.batch
    request.max_content_length = cfg.max_file_bytes + MULTIPART_SLACK
    try:
        upload = request.files.get("file")
        form = request.form
    except RequestEntityTooLarge:
        raise FileTooLarge(f"The file is larger than the {cfg.max_file_bytes:,} bytes this gateway accepts "
                           "(policy batch.max_file_bytes); split it into several batches.", "file") from None
    if upload is None:
        raise InvalidRequest("Missing required parameter: 'file' (a multipart/form-data upload).", "file")
    purpose = form.get("purpose")
    if not purpose:
        raise InvalidRequest("Missing required parameter: 'purpose'.", "purpose")
    expires_after_s = None
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is not None or seconds is not None:
        if anchor != "created_at":
            raise InvalidRequest("expires_after[anchor] must be 'created_at'.", "expires_after")
        try:
            expires_after_s = int(seconds or "")
        except ValueError:
            raise InvalidRequest("expires_after[seconds] must be an integer.", "expires_after") from None
    obj = services().files.create(g.tenant, upload.stream, upload.filename, purpose,
                                  max_bytes=cfg.max_file_bytes, expires_after_s=expires_after_s)
    return jsonify(obj)


@bp.get("/files")
def list_files():
    return jsonify(services().files.list(g.tenant, after=request.args.get("after") or None,
                                         limit=_int_arg("limit", MAX_FILES_LIST),
                                         order=request.args.get("order") or "desc",
                                         purpose=request.args.get("purpose") or None))


@bp.get("/files/<file_id>")
def get_file(file_id: str):
    return jsonify(services().files.get(g.tenant, file_id))


@bp.get("/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    fh = services().files.open(g.tenant, file_id)
    return send_file(fh, mimetype="application/octet-stream", conditional=False, etag=False, max_age=0)


@bp.delete("/files/<file_id>")
def delete_file(file_id: str):
    plane: Any = services()
    plane.files.record(g.tenant, file_id)  # 404 first: an unknown id is not "in use"
    running = plane.batches.input_in_use(g.tenant, file_id)
    if running:
        raise FileInUse(f"The file {file_id} is the input of batch {running}, which has not finished: cancel it "
                        "first, or wait for it to end.", "file_id")
    return jsonify(plane.files.delete(g.tenant, file_id))


# ------------------------------------------------------------------ batches
@bp.post("/batches")
def create_batch():
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise InvalidRequest("We could not parse the JSON body of your request: expected an object with "
                             "input_file_id, endpoint and completion_window.", None)
    return jsonify(services().batches.create(g.tenant, input_file_id=body.get("input_file_id"),
                                             endpoint=body.get("endpoint"),
                                             completion_window=body.get("completion_window"),
                                             metadata=body.get("metadata")))


@bp.get("/batches")
def list_batches():
    return jsonify(services().batches.list(g.tenant, after=request.args.get("after") or None,
                                           limit=_int_arg("limit", DEFAULT_LIST)))


@bp.get("/batches/<batch_id>")
def get_batch(batch_id: str):
    return jsonify(services().batches.get(g.tenant, batch_id))


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return jsonify(services().batches.cancel(g.tenant, batch_id))
