"""Validation of a batch input file before any inference (issue 14, Build 2).

:func:`validate_input` reads the input file's JSONL bytes once and answers a
:class:`Validation`: the parsed request lines and, for a bad file, OpenAI-style errors
``{"code", "message", "param", "line"}`` (``line`` 1-based, as OpenAI's ``errors.data[]``;
the message names the line's ``custom_id`` when it has one). No engine is asked anything.

A file is **bad** (the batch goes to ``failed``, :attr:`Validation.ok` false) when:

* it is empty, larger than ``batch.max_file_bytes`` or has more than ``batch.max_lines``
  request lines (``empty_file``, ``file_too_large``, ``too_many_lines``);
* a line is not a JSON object (``invalid_json_line``);
* ``custom_id`` is missing, not a non-empty string, longer than 512 characters
  (``missing_required_parameter`` / ``invalid_custom_id``), or repeats one of an earlier line
  (``duplicate_custom_id``, on the later line);
* ``method`` is not ``POST`` (``invalid_method``); ``url`` is not one of :data:`ENDPOINTS`
  (``invalid_url``) or not the batch's ``endpoint`` (``mismatched_endpoint``);
* ``body`` is not an object or its ``model`` not a non-empty string (``invalid_body`` /
  ``missing_required_parameter``);
* no line at all has a model the tenant may use (``model_not_found`` on every line).

A line whose ``model`` no pool serves, or that the tenant may not use (``tenants[].models``),
does **not** fail the whole file when other lines are usable: that line is answered at once
as the gateway would answer it (404 ``model_not_found``, never sent) and goes to the error
file (:attr:`Validation.refused`). This keeps one mistyped model from discarding a
50,000-line file, and is what the issue's expiry acceptance asks for (2 lines of a model
that does not exist → 2 model errors in the error file, the batch still runs).

At most :data:`MAX_ERRORS` errors are listed (the first ones, in line order); blank lines
(only whitespace) are skipped and not counted, as OpenAI does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..policy.model import Policy
from .records import ENDPOINTS

MAX_ERRORS = 100
"""Most errors listed for one file (a 50,000-line file of bad lines would otherwise make a
megabyte of ``errors``)."""

MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    """One valid request line.

    Attributes:
        index: 0-based position among the file's request lines (the principal's ``line``).
        custom_id: the client's id, unique within the file.
        url: the endpoint (== the batch's).
        body: the request body (a dict; ``model`` a non-empty string).
        pool: name of the pool serving ``body["model"]``, None when none does (or the tenant
            may not use the model: the line is then in :attr:`Validation.refused`).
        lineno: 1-based line of the file (blank lines counted).
    """

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]
    pool: str | None
    lineno: int = 0


@dataclass
class Validation:
    """What :func:`validate_input` found.

    Attributes:
        lines: every request line in file order when the file is good (empty otherwise).
        errors: OpenAI batch errors ``{"code", "message", "param", "line"}`` (``line`` 1-based
            in the file, counting blank lines as the file's own line numbers do).
        refused: line index → the error body the gateway would answer for it
            (``{"error": {...model_not_found}}``, status 404): not sent, goes to the error file.
        total: number of request lines (non-blank).
    """

    lines: list[Line] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    refused: dict[int, dict[str, Any]] = field(default_factory=dict)
    total: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def _error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def model_error(model: str) -> dict[str, Any]:
    """The gateway's answer to an unknown (or not allowed) model, OpenAI's shape (status 404)."""
    return {"error": {"message": f"The model `{model}` does not exist", "type": "invalid_request_error",
                      "param": "model", "code": "model_not_found"}}


def usable_models(policy: Policy, tenant: str) -> dict[str, str]:
    """model → pool name for the models ``tenant`` may use (every pool model when the tenant
    is not in the policy's tenants, e.g. ``""`` under ``gateway.auth: off``, or lists no models)."""
    served = {m: p.name for p in policy.pools for m in p.models}
    for t in policy.tenants:
        if t.id == tenant and t.models is not None:
            return {m: pool for m, pool in served.items() if m in set(t.models)}
    return served


def validate_input(data: bytes, *, endpoint: str, policy: Policy, tenant: str) -> Validation:
    """Check a batch input file (JSONL bytes) against the batch's ``endpoint`` and the policy.

    Args:
        data: the file's bytes (UTF-8 JSONL).
        endpoint: the batch's endpoint (one of :data:`ENDPOINTS`).
        policy: for ``batch.max_lines`` / ``max_file_bytes``, the pools' models and the tenants'.
        tenant: the batch's tenant id (``""`` under ``gateway.auth: off``).

    Returns:
        A :class:`Validation`; ``ok`` false → the batch must go to ``failed`` with ``errors``.
    """
    cfg = policy.batch
    out = Validation()
    errors = out.errors

    def add(err: dict[str, Any]) -> bool:
        """Record an error; False once MAX_ERRORS are listed (stop looking)."""
        if len(errors) < MAX_ERRORS:
            errors.append(err)
        return len(errors) < MAX_ERRORS

    if len(data) > cfg.max_file_bytes:
        add(_error("file_too_large", f"The input file is {len(data)} bytes; the limit is "
                   f"{cfg.max_file_bytes} bytes.", None))
        return out
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors write one) is not content
    except UnicodeDecodeError as exc:
        add(_error("invalid_file_encoding", f"The input file is not UTF-8 (byte {exc.start}).", None))
        return out

    models = usable_models(policy, tenant)
    seen: dict[str, int] = {}
    lines: list[Line] = []
    index = 0
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        index += 1
        if index > cfg.max_lines:
            add(_error("too_many_lines", f"The input file has more than {cfg.max_lines} request lines.", lineno))
            break
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            if not add(_error("invalid_json_line", f"Line {lineno} is not valid JSON: {exc.msg}.", lineno)):
                break
            continue
        if not isinstance(obj, dict):
            if not add(_error("invalid_json_line", f"Line {lineno} is not a JSON object.", lineno)):
                break
            continue
        cid = obj.get("custom_id")
        where = f"Line {lineno}" + (f" (custom_id {cid!r})" if isinstance(cid, str) and cid else "")
        problem: dict[str, Any] | None = None
        if "custom_id" not in obj or cid is None:
            problem = _error("missing_required_parameter", f"Line {lineno} has no custom_id.", lineno, "custom_id")
        elif not isinstance(cid, str) or not cid:
            problem = _error("invalid_custom_id", f"Line {lineno}: custom_id must be a non-empty string.",
                             lineno, "custom_id")
        elif len(cid) > MAX_CUSTOM_ID:
            problem = _error("invalid_custom_id", f"{where}: custom_id is longer than {MAX_CUSTOM_ID} characters.",
                             lineno, "custom_id")
        elif cid in seen:
            problem = _error("duplicate_custom_id", f"{where}: custom_id {cid!r} is already used by line "
                             f"{seen[cid]}; custom_id must be unique within the file.", lineno, "custom_id")
        elif obj.get("method") != "POST":
            problem = _error("invalid_method", f"{where}: method must be POST.", lineno, "method")
        elif obj.get("url") not in ENDPOINTS:
            problem = _error("invalid_url", f"{where}: url must be one of {', '.join(ENDPOINTS)}.", lineno, "url")
        elif obj["url"] != endpoint:
            problem = _error("mismatched_endpoint", f"{where}: url {obj['url']} is not the batch's endpoint "
                             f"{endpoint}.", lineno, "url")
        elif not isinstance(obj.get("body"), dict):
            problem = _error("invalid_body", f"{where}: body must be a JSON object.", lineno, "body")
        elif not isinstance(obj["body"].get("model"), str) or not obj["body"]["model"]:
            problem = _error("missing_required_parameter", f"{where}: body.model must be a non-empty string.",
                             lineno, "body.model")
        if isinstance(cid, str) and cid and cid not in seen:
            seen[cid] = lineno
        if problem is not None:
            if not add(problem):
                break
            continue
        lines.append(Line(index - 1, cid, obj["url"], obj["body"], models.get(obj["body"]["model"]), lineno))

    out.total = index
    if errors:
        out.total = 0  # a file that fails has no request to count (OpenAI's failed batches say 0)
        return out
    if not lines:
        add(_error("empty_file", "The input file has no request lines.", None))
        return out
    if all(ln.pool is None for ln in lines):
        for ln in lines[:MAX_ERRORS]:
            add(_error("model_not_found", f"Line {ln.lineno} (custom_id {ln.custom_id!r}): the model "
                       f"`{ln.body['model']}` does not exist.", ln.lineno, "body.model"))
        return out
    out.lines = lines
    out.refused = {ln.index: model_error(ln.body["model"]) for ln in lines if ln.pool is None}
    return out

