"""kvgate.addr (listen → connect addresses) and kvgate.rundir (the run directory's files), which
the stack, the control plane's client and the CLI share instead of importing each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.addr import connect_address, http_url, split_host_port
from kvgate.control.client import ControlError, resolve
from kvgate.rundir import RunDir, default_run_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("listen,connect", [
    ("0.0.0.0:8080", "127.0.0.1:8080"),
    ("*:8080", "127.0.0.1:8080"),
    (":8080", "127.0.0.1:8080"),
    ("[::]:9090", "[::1]:9090"),
    ("::1:9090", "::1:9090"),
    ("[::1]:9090", "[::1]:9090"),
    ("10.1.2.3:80", "10.1.2.3:80"),
    ("engine-n1:8000", "engine-n1:8000"),
])
def test_connect_address(listen: str, connect: str) -> None:
    assert connect_address(listen) == connect
    assert http_url(listen) == f"http://{connect}"


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_host_port("[::1]:9090") == ("::1", 9090)
    with pytest.raises(ValueError):
        split_host_port("localhost")
    with pytest.raises(ValueError):
        split_host_port("localhost:http")


def test_the_plane_still_exports_connect_address() -> None:
    from kvgate.control import plane

    assert plane.connect_address is connect_address


def test_default_run_dir_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_RUN_DIR", str(tmp_path / "r"))
    assert default_run_dir() == (tmp_path / "r").resolve()
    assert RunDir().root == (tmp_path / "r").resolve()
    monkeypatch.delenv("KVGATE_RUN_DIR")
    monkeypatch.chdir(tmp_path)
    assert RunDir().root == (tmp_path / ".kvgate" / "run").resolve()


def test_run_dir_records_and_forgets_the_running_policy(tmp_path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    assert rd.policy_path() is None and rd.load_running_policy() is None
    src = tmp_path / "p.yaml"
    src.write_text((REPO / "policies" / "demo.yaml").read_text())
    (tmp_path / "demo-faq.yaml").write_text((REPO / "policies" / "demo-faq.yaml").read_text())  # its static_answers
    rd.record_running(src)
    assert rd.policy_path() == src.resolve()
    assert rd.running_policy_file.read_text() == src.read_text()
    src.write_text("edited: later\n")  # the copy is what runs, not the operator's file
    assert rd.load_running_policy() is not None
    rd.clear_running()
    assert rd.policy_path() is None and not rd.running_policy_file.exists()
    assert (rd.pid_file("redis"), rd.log_file("control")) == (rd.root / "pids" / "redis.pid",
                                                               rd.root / "logs" / "control.log")


def test_client_resolves_from_the_run_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVGATE_CONTROL_URL", raising=False)
    monkeypatch.delenv("KVGATE_TOKEN", raising=False)
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    with pytest.raises(ControlError, match="no admin token"):
        resolve(rd.root)
    rd.token_file.write_text("tok\n")
    assert resolve(rd.root) == ("http://127.0.0.1:9090", "tok")  # no running stack: the default
    src = tmp_path / "p.yaml"
    demo = (REPO / "policies" / "demo.yaml").read_text()
    (tmp_path / "demo-faq.yaml").write_text((REPO / "policies" / "demo-faq.yaml").read_text())  # its static_answers
    assert "  listen: 127.0.0.1:9090\n" in demo
    src.write_text(demo.replace("  listen: 127.0.0.1:9090\n", '  listen: "0.0.0.0:19999"\n'))
    rd.record_running(src)
    assert resolve(rd.root) == ("http://127.0.0.1:19999", "tok")
    assert resolve(rd.root, url="http://h:1/", token="t") == ("http://h:1", "t")


def test_the_running_copy_reads_relative_static_answers_from_the_operators_folder(tmp_path):
    """The run dir's copy of a policy naming `static_answers: faq.yaml` (relative, as the docs
    show) reads the FAQ next to the operator's file, not in the run dir (kvgate status, up)."""
    from kvgate.rundir import RunDir

    src = tmp_path / "mine"
    src.mkdir()
    (src / "faq.yaml").write_text("answers:\n  - questions: ['When are you open?']\n    answer: '9 to 5.'\n")
    (src / "p.yaml").write_text("version: 1\npools:\n  - name: p\n    models: [m]\n"
                                "    nodes: [{id: n1, url: 'http://127.0.0.1:9'}]\n"
                                "    semantic: {enabled: true, static_answers: faq.yaml}\n")
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.record_running(src / "p.yaml")
    assert rd.load_running_policy().pools[0].semantic.static_answers == "faq.yaml"


def test_the_running_copy_follows_the_folder_of_the_file_applied_since(tmp_path):
    """After `kvgate apply other/p.yaml` (the control plane records its folder, files_base in
    state.json), the running copy's relative static_answers are read from other/, not from the
    folder of the file `up` started from."""
    from kvgate.policy import PolicyError
    from kvgate.rundir import RunDir

    policy = ("version: 1\npools:\n  - name: p\n    models: [m]\n    nodes: [{id: n1, url: 'http://127.0.0.1:9'}]\n"
              "    semantic: {static_answers: faq.yaml}\n")
    first, other = tmp_path / "first", tmp_path / "other"
    for d in (first, other):
        d.mkdir()
        (d / "p.yaml").write_text(policy)
    (first / "faq.yaml").write_text("answers:\n  - questions: ['When are you open?']\n    answer: '9 to 5.'\n")
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.record_running(first / "p.yaml")
    assert rd.files_base() == first.resolve()
    rd.record_files_base(other)  # what the control plane's apply of other/p.yaml writes
    assert rd.files_base() == other
    with pytest.raises(PolicyError) as err:  # other/ has no faq.yaml: named at the field's path
        rd.load_running_policy()
    assert err.value.issues[0].path == "pools[0].semantic.static_answers"
    assert "cannot read" in err.value.issues[0].reason
    (other / "faq.yaml").write_text("answers:\n  - questions: ['When are you open?']\n    answer: '8 to 4.'\n")
    assert rd.load_running_policy().pools[0].semantic.static_answers == "faq.yaml"
