"""kvgate.agent.agent.Agent and the ``kvgate agent`` command line, against real local HTTP servers
(an engine serving a recorded vLLM text, a control-plane receiver)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from kvgate.agent import agent as agent_mod
from kvgate.agent.agent import Agent
from kvgate.agent.cli import agent_command

from test_agent_collect import FakeEngine, free_port, recorded


class Receiver:
    """A control-plane stand-in: records POSTed reports and answers ``status`` with ``body``."""

    def __init__(self) -> None:
        self.status = 200
        self.body: dict = {"interval_s": 0.5}
        self.posts: list[tuple[str, dict[str, str], dict]] = []  # (path, headers, json)
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                rec.posts.append((self.path, dict(self.headers), json.loads(self.rfile.read(n))))
                body = json.dumps(rec.body).encode()
                self.send_response(rec.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    f = FakeEngine()
    f.metrics_text = recorded("vllm_v1.txt")
    yield f
    f.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_report_shape(engine):
    a = Agent("n1", engine.url, "http://127.0.0.1:9", "tok", interval_s=1.5)
    r = a.collect()
    assert list(r) == ["node_id", "ts", "agent", "gpu", "host", "engine"]
    assert r["node_id"] == "n1" and isinstance(r["ts"], float)
    assert set(r["agent"]) == {"version", "hostname", "pid", "interval_s"} and r["agent"]["interval_s"] == 1.5
    assert r["gpu"] == {"status": "unavailable", "reason": "NVML Shared Library Not Found"}
    assert r["engine"]["kind"] == "vllm" and r["engine"]["running"] == 8
    json.dumps(r)


def test_post_adopts_interval_and_sends_token(engine, receiver):
    a = Agent("node-7", engine.url, receiver.url + "/", "s3cret")
    assert a.post(a.collect()) is True
    path, headers, body = receiver.posts[0]
    assert path == "/api/v1/nodes/node-7/report"
    assert headers["Authorization"] == "Bearer s3cret"
    assert body["node_id"] == "node-7" and body["engine"]["healthy"] is True
    assert a.interval_s == 0.5
    receiver.body = {"interval_s": "fast"}  # nonsense is ignored
    a.post(a.collect())
    assert a.interval_s == 0.5


def test_fixed_interval_ignores_control_plane(engine, receiver):
    a = Agent("n1", engine.url, receiver.url, "t", interval_s=3.0, follow_control=False)
    a.post(a.collect())
    assert a.interval_s == 3.0


def test_rejected_token_is_logged_once_and_cleared(engine, receiver, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.agent")
    receiver.status = 401
    a = Agent("n1", engine.url, receiver.url, "wrong")
    a.run_once()
    assert a.failures == 1
    a.run_once()
    assert a.failures == 2
    rejected = [r for r in caplog.records if "admin token rejected" in r.getMessage()]
    assert len(rejected) == 1 and rejected[0].levelno == logging.WARNING and "401" in rejected[0].getMessage()
    receiver.status = 200
    a.run_once()
    assert a.failures == 0 and any("reporting to" in r.getMessage() for r in caplog.records)


def test_unreachable_control_plane_backs_off(engine, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.agent")
    a = Agent("n1", engine.url, f"http://127.0.0.1:{free_port()}", "t", interval_s=2.0)
    for _ in range(5):
        a.run_once()
    assert a.failures == 5
    lines = [r.getMessage() for r in caplog.records if "cannot reach the control plane" in r.getMessage()]
    assert len(lines) == 1 and "Connection refused" in lines[0]
    assert [Agent.delay(type("A", (), {"failures": n, "interval_s": 2.0})()) for n in range(7)] == \
        [2.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert a.delay() == 10.0


def test_a_control_plane_without_its_store_is_reported_to_every_interval(engine, receiver, caplog):
    # issue 9 item 10: a 503 (Redis down behind the control plane) must not back the agent off, or
    # its reports are missing for up to 10 s after Redis is back
    caplog.set_level(logging.INFO, logger="kvgate.agent")
    receiver.status, receiver.body = 503, {"error": {"code": "redis_unavailable"}}
    a = Agent("n1", engine.url, receiver.url, "t", interval_s=2.0)
    for _ in range(4):
        a.run_once()
    assert a.last_status == 503 and a.delay() == 2.0
    assert len([r for r in caplog.records if "cannot store reports" in r.getMessage()]) == 1
    receiver.status, receiver.body = 500, {}
    a.run_once()
    a.run_once()
    assert a.delay() == 4.0  # other errors still back off
    receiver.status, receiver.body = 200, {"interval_s": 2.0}
    a.run_once()
    assert a.failures == 0 and a.delay() == 2.0


def test_dead_engine_logged_once_per_problem(receiver, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.agent")
    a = Agent("n1", f"http://127.0.0.1:{free_port()}", receiver.url, "t")
    a.run_once()
    a.run_once()
    assert len([r for r in caplog.records if "unhealthy" in r.getMessage()]) == 1
    assert [p[2]["engine"]["healthy"] for p in receiver.posts] == [False, False]


def test_run_stops_on_event(engine, receiver):
    receiver.body = {"interval_s": 0.05}
    stop = threading.Event()
    a = Agent("n1", engine.url, receiver.url, "t")
    t = threading.Thread(target=a.run, args=(stop,))
    t.start()
    for _ in range(400):  # up to ~20 s on a loaded box; usually a few hundred ms
        if len(receiver.posts) >= 3:
            break
        time.sleep(0.05)
    stop.set()
    t.join(10)
    assert not t.is_alive() and len(receiver.posts) >= 3
    assert receiver.posts[-1][2]["agent"]["interval_s"] == 0.05


def test_problems_one_line_per_kind(caplog):
    caplog.set_level(logging.INFO, logger="kvgate.agent")
    p = agent_mod._Problems()
    p.report("control/unreachable", "refused")
    p.report("control/unreachable", "reset")  # same problem, other wording: no new line
    p.report("control/token", "rejected")  # a new kind of problem in the area: a line
    p.report("control/token", "rejected")
    p.report("engine/unhealthy", "down")
    p.clear("control", "ok again")
    p.clear("control", "ok again")  # nothing to clear: silent
    p.report("control/token", "rejected")  # back: a line
    assert [r.getMessage() for r in caplog.records] == ["refused", "rejected", "down", "ok again", "rejected"]


def test_agent_rejects_nonpositive_interval():
    with pytest.raises(ValueError):
        Agent("n1", "http://e", "http://c", "t", interval_s=0)


# --------------------------------------------------------------------------- CLI
def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(agent_command, list(args), env={"KVGATE_TOKEN": None, **(env or {})})


def test_cli_once_prints_report_without_token(engine, monkeypatch):
    monkeypatch.setattr("kvgate.agent.cli.ONCE_CPU_SAMPLE_S", 0)
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--once")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["node_id"] == "n1" and report["engine"]["kind"] == "vllm"


def test_cli_missing_token(engine):
    res = invoke("--node-id", "n1", "--engine-url", engine.url)
    assert res.exit_code == 2 and "needs the admin token" in res.stderr


def test_cli_unreadable_token_file(engine, tmp_path):
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--token-file", str(tmp_path / "nope"))
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: cannot read token file {tmp_path / 'nope'}: No such file or directory"


def test_cli_empty_token_file(engine, tmp_path):
    (tmp_path / "tok").write_text("\n\n")
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--token-file", str(tmp_path / "tok"))
    assert res.exit_code == 2 and "is empty" in res.stderr


def test_cli_token_and_token_file_conflict(engine, tmp_path):
    (tmp_path / "tok").write_text("abc\n")
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--token", "x", "--token-file", str(tmp_path / "tok"))
    assert res.exit_code == 2 and "not both" in res.stderr


def test_cli_bad_url_and_interval(engine):
    res = invoke("--node-id", "n1", "--engine-url", "localhost:8000", "--token", "x")
    assert res.exit_code == 2 and "--engine-url must be an http://" in res.stderr
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--token", "x", "--interval", "0")
    assert res.exit_code == 2


def test_cli_token_file_is_used(engine, receiver, tmp_path, monkeypatch):
    """The token file's first line reaches the control plane; an explicit file beats KVGATE_TOKEN;
    --interval fixes the interval."""
    (tmp_path / "tok").write_text("from-file\nignored\n")
    served: list[Agent] = []
    monkeypatch.setattr("kvgate.agent.cli.serve", served.append)  # no signal handlers in pytest's process
    res = invoke("--node-id", "n1", "--engine-url", engine.url, "--control-url", receiver.url,
                 "--token-file", str(tmp_path / "tok"), "--interval", "7", env={"KVGATE_TOKEN": "from-env"})
    assert res.exit_code == 0, res.output
    (a,) = served
    assert (a.token, a.interval_s, a.follow_control) == ("from-file", 7.0, False)
    a.run_once()
    assert receiver.posts[0][1]["Authorization"] == "Bearer from-file"
    assert a.interval_s == 7.0


def test_cli_env_token(engine, monkeypatch):
    served: list[Agent] = []
    monkeypatch.setattr("kvgate.agent.cli.serve", served.append)
    res = invoke("--node-id", "n1", "--engine-url", engine.url, env={"KVGATE_TOKEN": "env-tok"})
    assert res.exit_code == 0, res.output
    assert (served[0].token, served[0].interval_s, served[0].follow_control) == ("env-tok", 2.0, True)
