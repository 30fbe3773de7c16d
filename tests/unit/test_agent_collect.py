"""kvgate.agent.collect: parsing recorded vLLM/SGLang /metrics texts, the engine probe over real HTTP,
the GPU probe without a GPU (and with NVML failing part-way), the host probe."""

from __future__ import annotations

import json
import socket
import threading
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from kvgate.agent import collect

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def recorded(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ recorded texts
def test_recorded_files_say_where_they_come_from():
    for name in ("vllm_v1.txt", "vllm_v0.txt", "sglang.txt"):
        first = recorded(name).splitlines()[0]
        assert first.startswith("# Source: "), name


def test_vllm_v1_two_engines_are_summed():
    m = collect.parse_metrics(recorded("vllm_v1.txt"))
    assert m["kind"] == "vllm"
    assert m["running"] == 8  # engine 0: 5, engine 1: 3
    assert m["waiting"] == 2  # 2 + 0
    assert m["kv_cache_usage"] == pytest.approx((0.45 + 0.32) / 2)  # a fraction: mean, not sum
    # counters: the *_total samples, never the *_created timestamps beside them (~1.755e9)
    assert m["prefix_cache_queries"] == 154277 + 98304
    assert m["prefix_cache_hits"] == 136704 + 65536
    assert m["prefix_cache_hit_rate"] is None  # counters only: the control plane takes deltas
    assert m["num_gpu_blocks"] == 2 * 27312
    assert m["start_time"] == pytest.approx(1755123600.25)


def test_vllm_v0_names():
    m = collect.parse_metrics(recorded("vllm_v0.txt"))
    assert m == {"kind": "vllm-v0", "running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                 "prefix_cache_queries": None, "prefix_cache_hits": None,
                 "prefix_cache_hit_rate": None,  # -1.0 in the text: no data (prefix caching off)
                 "num_gpu_blocks": 81767, "start_time": None}


def test_sglang():
    m = collect.parse_metrics(recorded("sglang.txt"))
    assert m == {"kind": "sglang", "running": 162, "waiting": 2826, "kv_cache_usage": 0.28,
                 "prefix_cache_queries": None, "prefix_cache_hits": None,
                 "prefix_cache_hit_rate": pytest.approx(0.007507552643049313),
                 "num_gpu_blocks": None, "start_time": None}


def test_vllm_deprecated_counter_names_and_rate_gauge():
    text = "\n".join([
        "# TYPE vllm:gpu_cache_usage_perc gauge",
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5',
        "# TYPE vllm:gpu_prefix_cache_queries_total counter",
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
        "# TYPE vllm:gpu_prefix_cache_hits_total counter",
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
        "# TYPE vllm:gpu_prefix_cache_hit_rate gauge",
        'vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.4',
        'vllm:num_requests_waiting{model_name="m"} NaN',  # NaN is no value, not a number
        "",
    ])
    m = collect.parse_metrics(text)
    assert (m["kind"], m["kv_cache_usage"], m["prefix_cache_queries"], m["prefix_cache_hits"],
            m["prefix_cache_hit_rate"], m["waiting"]) == ("vllm-v0", 0.5, 100, 40, 0.4, None)


def test_untyped_counter_lines_still_match():
    # Without "# TYPE ... counter" the parser keeps "_total" in the family name: match samples, not families.
    text = 'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:prefix_cache_hits_total{engine="0"} 7\n' \
           'vllm:prefix_cache_hits{engine="0"} 999\n'
    m = collect.parse_metrics(text)
    assert (m["kind"], m["prefix_cache_hits"]) == ("vllm", 7)


def test_text_without_engine_metrics_has_no_kind():
    assert collect.parse_metrics("# HELP x y\n# TYPE x gauge\nx 1\n")["kind"] is None


def test_garbage_text_raises_for_parse_metrics():
    with pytest.raises(ValueError):
        collect.parse_metrics("hello world\n")


# ------------------------------------------------------------- engine over HTTP
class FakeEngine:
    """A real HTTP server with settable /health status and /metrics body."""

    def __init__(self) -> None:
        self.health_status = 200
        self.metrics_status = 200
        self.metrics_text = ""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path == "/health":
                    status, body = fake.health_status, b""
                elif self.path == "/metrics":
                    status, body = fake.metrics_status, fake.metrics_text.encode()
                else:
                    status, body = 404, b""
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_engine():
    f = FakeEngine()
    yield f
    f.close()


@pytest.mark.parametrize("name,kind,running", [("vllm_v1.txt", "vllm", 8), ("vllm_v0.txt", "vllm-v0", 0),
                                               ("sglang.txt", "sglang", 162)])
def test_engine_probe_reads_recorded_texts_over_http(fake_engine, name, kind, running):
    fake_engine.metrics_text = recorded(name)
    e = collect.engine(fake_engine.url, timeout=5)
    assert list(e) == list(collect.ENGINE_FIELDS)
    assert (e["url"], e["healthy"], e["error"], e["kind"], e["running"]) == (fake_engine.url, True, None, kind,
                                                                              running)
    assert e["scrape_ms"] >= 0
    json.dumps(e)


def test_engine_probe_garbage_metrics(fake_engine):
    fake_engine.metrics_text = "<html><body>Welcome to nginx!</body></html>\n"
    e = collect.engine(fake_engine.url, timeout=5)
    # the engine answers its /health: figures it does not export are unavailable, not a failure
    assert e["healthy"] is True and e["error"] is None
    assert e["figures_error"].startswith("GET /metrics: not Prometheus text") and "\n" not in e["figures_error"]
    assert all(e[k] is None for k in collect.ENGINE_FIELDS[3:12])


def test_engine_probe_metrics_without_engine_names(fake_engine):
    fake_engine.metrics_text = "# TYPE up gauge\nup 1\n"
    e = collect.engine(fake_engine.url, timeout=5)
    assert (e["healthy"], e["error"], e["figures_error"]) == (
        True, None, "GET /metrics: no vLLM or SGLang metrics in the answer")


def test_engine_probe_unhealthy_but_metrics_still_read(fake_engine):
    fake_engine.health_status = 503
    fake_engine.metrics_text = recorded("sglang.txt")
    e = collect.engine(fake_engine.url, timeout=5)
    assert (e["healthy"], e["error"], e["running"], e["figures_error"]) == (False, "GET /health: HTTP 503", 162, None)


def test_engine_probe_metrics_404(fake_engine):
    fake_engine.metrics_status = 404
    e = collect.engine(fake_engine.url, timeout=5)
    assert (e["healthy"], e["error"], e["figures_error"], e["kind"]) == (True, None, "GET /metrics: HTTP 404", None)


@pytest.mark.parametrize("status, healthy", [(501, True), (500, False), (503, False)])
def test_engine_probe_metrics_status(fake_engine, status, healthy):
    # 501: llama.cpp without --metrics (no figures); 500/503: a broken engine
    fake_engine.metrics_status = status
    e = collect.engine(fake_engine.url, timeout=5)
    assert e["healthy"] is healthy
    assert (e["error"] is None) is healthy and (e["figures_error"] is None) is not healthy


def test_engine_probe_connection_refused():
    url = f"http://127.0.0.1:{free_port()}"
    e = collect.engine(url, timeout=2)
    assert e["healthy"] is False and e["url"] == url
    assert e["error"] == "GET /health: connection failed (Connection refused)"
    assert all(e[k] is None for k in collect.ENGINE_FIELDS[3:12])


def test_engine_probe_timeout():
    with socket.socket() as s:  # listens, never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        e = collect.engine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.2)
    assert (e["healthy"], e["error"]) == (False, "GET /health: timed out after 0.2s")


# --------------------------------------------------------------------------- GPU
def test_gpu_without_a_gpu():
    """This machine has no NVIDIA driver: NVML's library is missing."""
    assert collect.gpu() == {"status": "unavailable", "reason": "NVML Shared Library Not Found"}


@pytest.fixture
def fake_nvml(monkeypatch):
    """NVML with two H200s; device 1 refuses utilisation (``Not Supported``)."""
    calls: list[str] = []

    def util(handle):
        if handle == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=37, memory=12)

    fakes = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlSystemGetDriverVersion": lambda: "570.124.06",
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: b"NVIDIA H200" if h else "NVIDIA H200",  # old bindings: bytes
        "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=1024 ** 3 * (h + 1), total=150_754_820_096,
                                                             free=0),
        "nvmlDeviceGetUtilizationRates": util,
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls


def test_gpu_with_a_field_nvml_refuses(fake_nvml):
    g = collect.gpu()
    assert g["status"] == "ok" and g["driver_version"] == "570.124.06"
    assert g["devices"] == [
        {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",
         "memory_used_bytes": 1024 ** 3, "memory_total_bytes": 150_754_820_096, "utilization_pct": 37},
        {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
         "memory_used_bytes": 2 * 1024 ** 3, "memory_total_bytes": 150_754_820_096, "utilization_pct": None},
    ]
    assert fake_nvml == ["init", "shutdown"]
    json.dumps(g)


def test_gpu_handle_lost_midway(fake_nvml, monkeypatch):
    def handle(i):
        if i == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return i

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    g = collect.gpu()
    assert g["status"] == "ok" and g["devices"][0]["utilization_pct"] == 37
    assert g["devices"][1] == {"index": 1, "name": None, "uuid": None, "memory_used_bytes": None,
                               "memory_total_bytes": None, "utilization_pct": None}


def test_gpu_count_fails_after_init(fake_nvml, monkeypatch):
    def count():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", count)
    assert collect.gpu() == {"status": "unavailable", "reason": "Driver Not Loaded"}
    assert fake_nvml == ["init", "shutdown"]  # shut down even so


def test_gpu_never_raises_on_unexpected_errors(fake_nvml, monkeypatch):
    def boom():
        raise OSError("weird")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", boom)
    assert collect.gpu() == {"status": "unavailable", "reason": "OSError: weird"}


# -------------------------------------------------------------------------- host
def test_host():
    h = collect.host()
    assert set(h) == {"hostname", "cpu_pct", "load1", "load5", "load15", "memory_used_bytes",
                      "memory_total_bytes"}
    assert h["hostname"] == socket.gethostname()
    assert 0 <= h["cpu_pct"] <= 100
    assert h["load1"] >= 0 and h["load15"] >= 0
    assert 0 < h["memory_used_bytes"] < h["memory_total_bytes"]
    json.dumps(h)
