"""The admin page's Batches page (issue 14 item 5): ``/admin/batches``.

Every tenant's Batch API batches, newest first (:mod:`kvgate.batch.overview`): per batch its
tenant, status, a progress bar (finished lines ÷ total), completed / failed counts, when it was
created and when its window ends, links to its output and error files, and Cancel for one that
is still running (a confirmation page, then ``cancelling``: no new lines, lines in flight
finish). ``?tenant=`` and ``?status=`` filter; the same figures as JSON for scripts.
"""

from __future__ import annotations

import time
from typing import Any

from flask import Response, jsonify, render_template, request, url_for

from ...batch import records as rec
from ...batch.overview import find, list_batches, summary
from ...fleet.events import EventKind
from ..auth import actor, require_admin
from ..errors import error_page, json_error, wants_json
from ..state import services
from .views import bp, done, failed

PAGE_LIMIT = 200
CANCELLABLE = (rec.VALIDATING, rec.IN_PROGRESS)


def _when(ts: int | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _refuse(status: int, title: str, message: str, code: str):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_error(status, message, kind, code) if wants_json() else error_page(title, message, status)


@bp.get("/batches")
@require_admin
def batches():
    import redis

    plane = services()
    tenant = request.args.get("tenant") or None
    status = request.args.get("status") or None
    if status is not None and status not in rec.STATUSES:
        return _refuse(400, "Bad request", f"unknown status {status!r}: one of {', '.join(rec.STATUSES)}",
                       "bad_request")
    error = None
    rows: list[dict[str, Any]] = []
    try:
        rows = list_batches(plane.store.r, tenant=tenant, status=status, limit=PAGE_LIMIT)
    except redis.RedisError as exc:
        error = f"Redis could not be read: {exc}"
    if wants_json():
        return jsonify({"batches": rows, "counts": summary(rows), "error": error})
    tenants = [t.id for t in plane.policy.tenants] if plane.policy else []
    return render_template("admin/batches.html", page="batches", rows=rows, counts=summary(rows), error=error,
                           tenant=tenant, status=status, tenants=tenants, statuses=rec.STATUSES,
                           cancellable=CANCELLABLE, when=_when)


@bp.route("/batches/<batch_id>/cancel", methods=["GET", "POST"])
@require_admin
def cancel_batch(batch_id: str):
    plane = services()
    back = url_for("admin.batches")
    b = find(plane.store.r, batch_id)
    if b is None:
        return _refuse(404, "Not found", f"No batch with id {batch_id!r}", "batch_not_found")
    if request.method == "GET":
        rc = b["request_counts"]
        return render_template("admin/confirm.html", action="cancel", spec={"label": "Cancel the batch"},
                               node=None, post_url=url_for("admin.cancel_batch", batch_id=batch_id),
                               cancel_url=back, page="batches",
                               message=f"Cancel batch {batch_id} of tenant {b['tenant'] or '(anonymous)'} "
                                       f"({rc['completed'] + rc['failed']} of {rc['total']} lines finished)? "
                                       "No new line starts; lines in flight finish; its output file keeps "
                                       "what is done. It cannot be resumed.")
    try:
        out = plane.batches.cancel(b["tenant"], batch_id)
    except Exception as exc:  # noqa: BLE001 - the error table decides (failed() re-raises the unknown)
        return failed(exc, back=back)
    plane.event(EventKind.BATCH_CANCELLED, f"batch {batch_id} of tenant {b['tenant'] or '(anonymous)'} "
                f"cancelled by {actor()}", batch=batch_id, tenant=b["tenant"])
    return done(f"Batch {batch_id} is {out['status']}: lines in flight finish, then it is cancelled.",
                json_extra={"batch": out}, back=back)


@bp.get("/batches/<batch_id>/files/<kind>")
@require_admin
def batch_file(batch_id: str, kind: str):
    """The batch's output (``kind`` = output) or error file (``error``), as JSONL."""
    plane = services()
    b = find(plane.store.r, batch_id)
    field = {"output": "output_file_id", "error": "error_file_id"}.get(kind)
    if b is None or field is None or not b.get(field):
        return _refuse(404, "Not found", f"batch {batch_id!r} has no {kind} file", "file_not_found")
    try:
        fh = plane.files.open(b["tenant"], b[field])
    except Exception as exc:  # noqa: BLE001
        return failed(exc, back=url_for("admin.batches"))

    def chunks():
        with fh:
            while chunk := fh.read(64 * 1024):
                yield chunk

    return Response(chunks(), mimetype="application/jsonl", headers={
        "Content-Disposition": f'attachment; filename="{batch_id}-{kind}.jsonl"', "Cache-Control": "no-store"})
