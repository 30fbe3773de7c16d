"""The shape of an agent report (``POST /api/v1/nodes/<id>/report``), checked before it is stored.

The reconciler computes weights, health and overload from these figures, so a report
with a string where a number belongs is refused (422 with the field paths) instead of
reaching it. Unknown fields are kept (newer agents may send more). Units and sources:
:mod:`kvgate.agent.collect`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

NonNeg = Field(None, ge=0)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class EngineFigures(_Open):
    url: str | None = None
    healthy: bool | None = None
    error: str | None = None
    kind: str | None = None
    running: float | None = NonNeg
    waiting: float | None = NonNeg
    kv_cache_usage: float | None = Field(None, ge=0, le=1)
    prefix_cache_queries: float | None = NonNeg
    prefix_cache_hits: float | None = NonNeg
    prefix_cache_hit_rate: float | None = Field(None, ge=0, le=1)
    num_gpu_blocks: float | None = NonNeg
    start_time: float | None = None
    scrape_ms: float | None = NonNeg
    figures_error: str | None = None


class GpuDevice(_Open):
    index: int | None = None
    name: str | None = None
    uuid: str | None = None
    memory_used_bytes: float | None = NonNeg
    memory_total_bytes: float | None = NonNeg
    utilization_pct: float | None = Field(None, ge=0, le=100)


class GpuFigures(_Open):
    status: Literal["ok", "unavailable"]
    reason: str | None = None
    driver_version: str | None = None
    devices: list[GpuDevice] = Field(default_factory=list)


class HostFigures(_Open):
    hostname: str | None = None
    cpu_pct: float | None = NonNeg
    load1: float | None = NonNeg
    load5: float | None = NonNeg
    load15: float | None = NonNeg
    memory_used_bytes: float | None = NonNeg
    memory_total_bytes: float | None = NonNeg


class AgentReport(_Open):
    """One report: ``{"node_id", "ts", "agent", "gpu", "host", "engine"}`` (every part optional)."""

    node_id: str | None = None
    ts: float | None = None
    agent: dict[str, Any] | None = None
    gpu: GpuFigures | None = None
    host: HostFigures | None = None
    engine: EngineFigures | None = None


class ReportError(ValueError):
    """A report of the wrong shape; ``issues`` is ``[{"path", "reason"}]``."""

    def __init__(self, issues: list[dict[str, str]]):
        self.issues = issues
        super().__init__("invalid agent report: " + "; ".join(f"{i['path']}: {i['reason']}" for i in issues))


def check_report(body: Any) -> dict[str, Any]:
    """The report as a plain dict. Raises ValueError when the body is not a JSON object,
    ReportError (with the path of every bad field) when a part has the wrong shape."""
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object (the agent's report)")  # the API answers 400
    try:
        return AgentReport.model_validate(body).model_dump()
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err.get("loc", ()))
            issues.append({"path": path.replace(".[", "["), "reason": str(err.get("msg", "invalid"))})
        raise ReportError(issues) from None
