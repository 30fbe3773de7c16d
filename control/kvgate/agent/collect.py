"""The node agent's probes: GPU (NVML), host (psutil) and the inference engine (HTTP).

Each probe returns a JSON-able dict and never raises: a failure is reported in the dict
(``status``/``reason`` for the GPU, ``healthy``/``error`` for the engine, ``null`` fields for
the host), so one broken probe never costs the control plane the other two.

Engine metric names (what :func:`parse_metrics` reads), normalized field ← vLLM V1 (kind ``vllm``) /
vLLM older names (kind ``vllm-v0``) / SGLang (kind ``sglang``):

* ``running`` ← ``vllm:num_requests_running`` / same / ``sglang:num_running_reqs``
* ``waiting`` ← ``vllm:num_requests_waiting`` / same / ``sglang:num_queue_reqs``
* ``kv_cache_usage`` (0–1) ← ``vllm:kv_cache_usage_perc`` / ``vllm:gpu_cache_usage_perc`` /
  ``sglang:token_usage``
* ``prefix_cache_queries``, ``prefix_cache_hits`` (tokens, cumulative counters) ←
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` /
  ``vllm:gpu_prefix_cache_queries_total``, ``vllm:gpu_prefix_cache_hits_total`` / — (SGLang has none)
* ``prefix_cache_hit_rate`` (0–1) ← — (V1 has counters only: the control plane computes the rate
  from their deltas) / ``vllm:gpu_prefix_cache_hit_rate`` gauge if present / ``sglang:cache_hit_rate``
* ``num_gpu_blocks`` ← the ``num_gpu_blocks`` label of ``vllm:cache_config_info`` / same / —
* ``start_time`` (unix s) ← ``process_start_time_seconds``, any engine: a new value means the
  engine restarted (and its counters went back to zero)

Sources: vLLM V1 names and labels (``model_name``, ``engine``) from ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger``); the older names from ``vllm/engine/metrics.py`` (V0 engine; vLLM 0.8–0.10
V1 still exported them, marked deprecated); SGLang's from its ``docs/references/production_metrics.md``;
``process_start_time_seconds`` from prometheus_client's process collector (absent when vLLM runs its
API server in multiprocess mode). Recorded examples live in ``tests/data/metrics/``.
"""

from __future__ import annotations

import math
import re
import socket
import time
from collections import defaultdict
from typing import Any, Callable

import psutil
import pynvml
import requests
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["gpu", "host", "engine", "parse_metrics", "ENGINE_FIELDS"]

#: Keys of the dict :func:`engine` returns, in order.
ENGINE_FIELDS = ("url", "healthy", "error", "kind", "running", "waiting", "kv_cache_usage",
                 "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "num_gpu_blocks",
                 "start_time", "scrape_ms", "figures_error")
_FIGURES = ENGINE_FIELDS[3:12]  # kind … start_time: what parse_metrics fills in

_ERROR_MAX = 240  # characters of one error line


# ----------------------------------------------------------------------------- GPU
def _text(value: Any) -> str:
    """NVML strings: ``str`` in nvidia-ml-py ≥ 11.515, ``bytes`` before."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _nvml_field(call: Callable[[], Any]) -> Any:
    """One per-device NVML query; ``None`` when NVML says no (e.g. ``Not Supported`` on some boards)."""
    try:
        return call()
    except pynvml.NVMLError:
        return None


def _device(index: int) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index, "name": None, "uuid": None, "memory_used_bytes": None,
                           "memory_total_bytes": None, "utilization_pct": None}
    handle = _nvml_field(lambda: pynvml.nvmlDeviceGetHandleByIndex(index))
    if handle is None:
        return row
    name = _nvml_field(lambda: pynvml.nvmlDeviceGetName(handle))
    uuid = _nvml_field(lambda: pynvml.nvmlDeviceGetUUID(handle))
    mem = _nvml_field(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    util = _nvml_field(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    row["name"] = None if name is None else _text(name)
    row["uuid"] = None if uuid is None else _text(uuid)
    if mem is not None:
        row["memory_used_bytes"], row["memory_total_bytes"] = int(mem.used), int(mem.total)
    if util is not None:
        row["utilization_pct"] = int(util.gpu)
    return row


def gpu() -> dict[str, Any]:
    """The node's NVIDIA GPUs, via NVML (``pynvml`` from nvidia-ml-py).

    NVML calls: ``nvmlInit``, ``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetCount``, then per device
    ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetName``, ``nvmlDeviceGetUUID``,
    ``nvmlDeviceGetMemoryInfo`` (``used``/``total``, bytes) and ``nvmlDeviceGetUtilizationRates``
    (``gpu``: percent of the last sample period the GPU was busy), and ``nvmlShutdown`` at the end.

    Returns:
        ``{"status": "ok", "driver_version": str | None, "devices": [{"index": int, "name": str,
        "uuid": str, "memory_used_bytes": int, "memory_total_bytes": int, "utilization_pct": int}]}``;
        a per-device query NVML refuses (``Not Supported``…) leaves that field ``None``.
        No NVML (no driver, no GPU) or a failing init/count:
        ``{"status": "unavailable", "reason": str}``, e.g. ``"NVML Shared Library Not Found"``.
    """
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"status": "unavailable", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a probe never raises
        return {"status": "unavailable", "reason": _one_line(f"{type(e).__name__}: {e}")}
    try:
        driver = _nvml_field(pynvml.nvmlSystemGetDriverVersion)
        count = pynvml.nvmlDeviceGetCount()
        return {"status": "ok", "driver_version": None if driver is None else _text(driver),
                "devices": [_device(i) for i in range(count)]}
    except pynvml.NVMLError as e:
        return {"status": "unavailable", "reason": str(e)}
    except Exception as e:  # noqa: BLE001
        return {"status": "unavailable", "reason": _one_line(f"{type(e).__name__}: {e}")}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------- host
def _safe(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # noqa: BLE001 - a probe never raises
        return None


def host() -> dict[str, Any]:
    """This machine, via psutil.

    Returns:
        ``{"hostname": str, "cpu_pct": float, "load1": float, "load5": float, "load15": float,
        "memory_used_bytes": int, "memory_total_bytes": int}``. ``cpu_pct`` is
        ``psutil.cpu_percent(interval=None)``: all CPUs, percent busy since the previous call in this
        process (non-blocking; the first call of a process reports 0.0). ``load*`` are the 1/5/15-minute
        load averages (runnable processes, not normalised by CPU count). ``memory_used_bytes`` is
        psutil's ``virtual_memory().used`` (excludes buffers/page cache on Linux). A field that
        cannot be read is ``None``.
    """
    load = _safe(psutil.getloadavg) or (None, None, None)
    mem = _safe(psutil.virtual_memory)
    return {
        "hostname": _safe(socket.gethostname),
        "cpu_pct": _safe(lambda: psutil.cpu_percent(interval=None)),
        "load1": load[0], "load5": load[1], "load15": load[2],
        "memory_used_bytes": None if mem is None else int(mem.used),
        "memory_total_bytes": None if mem is None else int(mem.total),
    }


# -------------------------------------------------------------------------- engine
def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _ERROR_MAX else text[: _ERROR_MAX - 1] + "…"


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def _describe(exc: Exception, timeout: float) -> str:
    """A short cause for a failed request (requests' own messages nest three exceptions deep)."""
    if isinstance(exc, requests.Timeout):
        return f"timed out after {timeout:g}s"
    if isinstance(exc, requests.ConnectionError):
        m = _ERRNO.search(str(exc))
        return f"connection failed ({m.group(1).strip()})" if m else "connection failed"
    return f"{type(exc).__name__}: {exc}"


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def parse_metrics(text: str) -> dict[str, Any]:
    """Normalize one Prometheus text exposition (``/metrics``) of vLLM or SGLang.

    Parsing is prometheus_client's ``text_string_to_metric_families``. Samples are matched by
    *sample* name, which keeps the counter suffix (``vllm:prefix_cache_queries_total``) whatever the
    parser does to the family name (it strips ``_total`` from a typed counter's family, not from an
    untyped one), and never picks up the ``*_created`` timestamps prometheus_client exports beside
    each counter. NaN samples are skipped.

    Aggregation over label sets (vLLM: one per ``model_name``/``engine``, several engines with data
    parallelism): counts (``running``, ``waiting``, counters, ``num_gpu_blocks``) are summed;
    fractions (``kv_cache_usage``, ``prefix_cache_hit_rate``) are the mean over label sets; a negative
    hit rate (vLLM V0's "no data": -1) is ``None``.

    Returns:
        ``{"kind": "vllm" | "vllm-v0" | "sglang" | None, "running": int, "waiting": int,
        "kv_cache_usage": float (0–1), "prefix_cache_queries": int (tokens, cumulative),
        "prefix_cache_hits": int (tokens, cumulative), "prefix_cache_hit_rate": float (0–1),
        "num_gpu_blocks": int, "start_time": float (unix s)}``; a figure the engine does not
        export is ``None``; ``kind`` is ``None`` when the text has no vLLM/SGLang metric at all.
        ``kind`` names the *naming scheme*: ``vllm`` when ``vllm:kv_cache_usage_perc`` or
        ``vllm:prefix_cache_queries_total`` is present, ``vllm-v0`` for other ``vllm:`` texts.

    Raises:
        ValueError (or another parser error): ``text`` is not Prometheus text format.
    """
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not math.isnan(s.value):
                samples[s.name].append((s.labels, s.value))

    def values(*names: str) -> list[float]:
        """Values of the first of ``names`` that is present (newer name first)."""
        for name in names:
            if samples.get(name):
                return [v for _, v in samples[name]]
        return []

    out: dict[str, Any] = dict.fromkeys(_FIGURES)
    start = values("process_start_time_seconds")
    out["start_time"] = max(start) if start else None
    if any(name.startswith("sglang:") for name in samples):
        out.update(
            kind="sglang",
            running=_int(_sum(values("sglang:num_running_reqs"))),
            waiting=_int(_sum(values("sglang:num_queue_reqs"))),
            kv_cache_usage=_mean(values("sglang:token_usage")),
            prefix_cache_hit_rate=_mean(values("sglang:cache_hit_rate")),
        )
        return out
    if not any(name.startswith("vllm:") for name in samples):
        return out
    v1 = bool(samples.get("vllm:kv_cache_usage_perc") or samples.get("vllm:prefix_cache_queries_total"))
    rates = [v for v in values("vllm:gpu_prefix_cache_hit_rate") if v >= 0]
    blocks = [float(labels["num_gpu_blocks"]) for labels, _ in samples.get("vllm:cache_config_info", [])
              if labels.get("num_gpu_blocks", "").isdigit()]
    out.update(
        kind="vllm" if v1 else "vllm-v0",
        running=_int(_sum(values("vllm:num_requests_running"))),
        waiting=_int(_sum(values("vllm:num_requests_waiting"))),
        kv_cache_usage=_mean(values("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
        prefix_cache_queries=_int(_sum(values("vllm:prefix_cache_queries_total",
                                              "vllm:gpu_prefix_cache_queries_total"))),
        prefix_cache_hits=_int(_sum(values("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"))),
        prefix_cache_hit_rate=_mean(rates),
        num_gpu_blocks=_int(_sum(blocks)),
    )
    return out


def engine(url: str, timeout: float = 2.0, session: requests.Session | None = None) -> dict[str, Any]:
    """Probe one engine: ``GET {url}/health`` then ``GET {url}/metrics``.

    Args:
        url: the engine's base URL (``http://host:port``, no path).
        timeout: seconds for each of the two requests (connect and read).
        session: a ``requests.Session`` to reuse connections (the agent keeps one); default: none.

    Returns:
        ``{"url": str, "healthy": bool, "error": str | None, "kind", "running", "waiting",
        "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
        "num_gpu_blocks", "start_time", "scrape_ms": float, "figures_error": str | None}`` — the
        figures as in :func:`parse_metrics`, ``scrape_ms`` the wall time of both requests in
        milliseconds. ``healthy`` is true iff ``/health`` answered 200 and ``/metrics`` did not fail
        as a broken engine would (a timeout, a connection error, a 5xx other than 501); otherwise
        ``error`` is one line saying what failed (the first failure). An engine that simply has no
        vLLM/SGLang figures — ``/metrics`` answering 4xx or 501 (llama.cpp without ``--metrics``),
        text that is not Prometheus, or Prometheus text without vLLM/SGLang names (TGI, any plain
        OpenAI server) — is healthy, with ``figures_error`` saying why its figures are unavailable;
        the control plane then decides drains on the gateway's count and leaves weights alone.
        The figures are ``None`` unless ``/metrics`` parsed (it may while ``/health`` answers 503
        as the engine loads).
    """
    base = url.rstrip("/")
    get = (session or requests).get
    out: dict[str, Any] = dict.fromkeys(ENGINE_FIELDS)
    out["url"] = url
    t0 = time.perf_counter()
    error: str | None = None
    figures_error: str | None = None
    try:
        try:
            r = get(base + "/health", timeout=timeout)
            if r.status_code != 200:
                error = f"GET /health: HTTP {r.status_code}"
        except requests.RequestException as e:
            error = f"GET /health: {_describe(e, timeout)}"
            return out  # not answering: /metrics would fail the same way, after another timeout
        try:
            r = get(base + "/metrics", timeout=timeout)
        except requests.RequestException as e:
            error = error or f"GET /metrics: {_describe(e, timeout)}"
            return out
        if r.status_code != 200:
            if 400 <= r.status_code < 500 or r.status_code == 501:
                # the engine answers but exports no figures: not a failure of the engine
                figures_error = f"GET /metrics: HTTP {r.status_code}"
            else:
                error = error or f"GET /metrics: HTTP {r.status_code}"
            return out
        try:
            figures = parse_metrics(r.text)
        except Exception as e:  # noqa: BLE001 - whatever the parser throws at bad text
            figures_error = f"GET /metrics: not Prometheus text ({type(e).__name__}: {e})"
            return out
        out.update(figures)
        if figures["kind"] is None:
            figures_error = "GET /metrics: no vLLM or SGLang metrics in the answer"
    except Exception as e:  # noqa: BLE001 - a probe never raises
        error = error or f"{type(e).__name__}: {e}"
    finally:
        out["healthy"] = error is None
        out["error"] = None if error is None else _one_line(error)
        out["figures_error"] = None if figures_error is None else _one_line(figures_error)
        out["scrape_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    return out


def hostname() -> str:
    """This machine's host name (``socket.gethostname``), or ``""``."""
    return _safe(socket.gethostname) or ""

