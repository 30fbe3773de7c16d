"""The policy's ``batch:`` section: the Batch API's storage, limits and worker (docs/batch-api.md).

Limits default to OpenAI's (50,000 lines and 200 MB per input file, a ``24h`` window); the
worker's concurrency bounds are kvgate's: it runs batch lines on the capacity live traffic
leaves (``max_in_flight`` across the fleet, ``max_in_flight_per_node`` on one engine, backing
off while an engine reports more than ``queue_backoff`` waiting requests).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,4})([hms])$")
_UNIT_S = {"h": 3600, "m": 60, "s": 1}


def window_seconds(window: str) -> int:
    """Seconds of a completion window ``<n>h`` / ``<n>m`` / ``<n>s`` (OpenAI accepts ``24h``).

    Raises:
        ValueError: any other spelling.
    """
    m = _WINDOW_RE.match(window)
    if not m:
        raise ValueError(f"completion window {window!r}: expected <n>h, <n>m or <n>s (e.g. 24h)")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    """The Batch API (``/v1/files``, ``/v1/batches``) and its worker (``kvgate batch-worker``)."""

    enabled: bool = Field(True, description="Serve the Batch API and run batch workers.")
    data_dir: str | None = Field(
        None, description="Folder of the uploaded and produced files (JSONL bytes; metadata and batch state live "
        "in Redis). null: `<run dir>/data`. Several control planes or workers need the same folder (a shared "
        "volume).")
    max_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, le=1024 ** 3,
        description="The largest input file in bytes (OpenAI: 200 MB); a larger upload answers 413.")
    max_lines: int = Field(50_000, ge=1, le=1_000_000,
                           description="The most request lines per input file (OpenAI: 50,000).")
    completion_windows: list[str] = Field(
        ["24h"], min_length=1,
        description="Completion windows a batch may ask for (`<n>h`, `<n>m` or `<n>s`); OpenAI offers `24h`. "
        "At the window's end unfinished lines go to the error file as `batch_expired`.")
    max_in_flight: int = Field(16, ge=1, le=4096,
                               description="Most batch lines in flight at once, all workers of a fleet together.")
    max_in_flight_per_node: int = Field(4, ge=1, le=1024,
                                        description="Most batch lines in flight on one engine.")
    queue_backoff: float = Field(
        1.0, ge=0, description="An engine reporting more than this many waiting requests (its agent's last "
        "report) gets no new batch line, and the worker halves its concurrency: batch work yields to live traffic.")
    max_attempts: int = Field(3, ge=1, le=20,
                              description="Tries per line on transient failures (429, 5xx, timeouts) before the "
                              "line goes to the error file.")
    retry_backoff_s: float = Field(1.0, ge=0, le=600,
                                   description="Wait before the first retry of a line, doubled at each further try.")
    request_timeout_s: float = Field(300.0, gt=0, le=86400,
                                     description="Longest one line's request may take through the gateway.")
    lease_s: float = Field(30.0, ge=0.5, le=3600,
                           description="A claimed line's lease: a worker that dies holding lines gives them back "
                           "to the other workers (or to itself, restarted) after this long. Longer than a line's "
                           "usual time is not needed: a live worker renews its leases every third of it.")
    poll_interval_s: float = Field(0.5, gt=0, le=60,
                                   description="How often an idle worker looks for work.")
    file_retention_days: int = Field(30, ge=1, le=3660,
                                     description="Days uploaded and produced files are kept (`expires_at`).")
    metrics_listen: str | None = Field(
        None, description="HOST:PORT the batch worker `kvgate up` starts serves its `/metrics` on "
        "(`kvgate_batch_*`: lines by result, lines in flight, concurrency, group sizes); null: none.")

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, v: str | None) -> str | None:
        if v is not None:
            from ..addr import split_host_port
            split_host_port(v)
        return v

    @field_validator("completion_windows")
    @classmethod
    def _check_windows(cls, v: list[str]) -> list[str]:
        for w in v:
            window_seconds(w)
        if len(set(v)) != len(v):
            raise ValueError("completion_windows lists a window twice")
        return v
