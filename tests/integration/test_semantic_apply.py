"""A pool's ``semantic.static_answers`` file through ``kvgate apply`` and the admin page's editor
(issue 15, item 8: "validated and reloaded with the policy"), against the stack of ``kvgate up``
with the real semantic service:

- an apply whose file is missing or invalid is refused, naming ``pools[0].semantic.static_answers``
  and the reason, and the running policy keeps answering;
- a relative path is read from the folder of the policy file applied — not the CLI's working
  directory, not the run dir (both hold a decoy ``faq.yaml`` here);
- after an apply that changes the file's contents or its path, the service answers the new
  answers; the admin page's editor (YAML without a file) reads a relative path from the running
  policy's folder.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from ctlfixtures import MODEL, Fleet, control_fleet_module, wait_until  # noqa: F401 - fixture
from gwfixtures import free_port

pytestmark = pytest.mark.integration

SEMANTIC_PORT = free_port()
EXTRA = f'semantic_service: {{listen: "127.0.0.1:{SEMANTIC_PORT}"}}'
QUESTION = "What are your support hours?"
_tokens = itertools.count(8)  # another max_tokens per request: never an exact-cache hit of an earlier answer


def faq(answer: str) -> str:
    return f'answers:\n  - questions: ["{QUESTION}", "When is support open?"]\n    answer: "{answer}"\n'


def pool_extra(static: str) -> str:
    return f"    semantic: {{static_answers: '{static}'}}"


def answer(fl: Fleet) -> str | None:
    """The gateway's static answer to QUESTION (None: not answered statically)."""
    r = requests.post(fl.gateway + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "temperature": 0, "max_tokens": next(_tokens),
                            "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200, r.text
    if r.headers.get("X-Kvgate-Cache") != "STATIC":
        return None
    return r.json()["choices"][0]["message"]["content"]


def serves(fl: Fleet, expected: str, timeout: float = 30) -> None:
    seen: list[str | None] = []

    def ok() -> bool:
        seen.append(answer(fl))
        return seen[-1] == expected

    try:
        wait_until(ok, f"the static answer {expected!r}", timeout)
    except AssertionError:
        raise AssertionError(f"{expected!r} never served; last answers {seen[-3:]}") from None


def apply(fl: Fleet, policy: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``kvgate apply POLICY`` run from ``cwd``, as an operator in another folder would."""
    return subprocess.run([sys.executable, "-m", "kvgate", "--run-dir", str(fl.run_dir), "apply", str(policy)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def running(fl: Fleet) -> dict:
    r = fl.api("GET", "/api/v1/policy")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def fleet(control_fleet_module, tmp_path_factory):  # noqa: F811
    first = tmp_path_factory.mktemp("first") / "faq.yaml"
    first.write_text(faq("answer of the first file"))
    fl = control_fleet_module(n=1, extra=EXTRA, pool_extra=pool_extra(str(first)))
    serves(fl, "answer of the first file", timeout=90)  # the service loads the model first
    fl.ops = tmp_path_factory.mktemp("ops")  # the operator's folder: policies and their FAQ files
    fl.elsewhere = tmp_path_factory.mktemp("elsewhere")  # the operator's shell is here
    for decoy in (fl.elsewhere / "faq.yaml", fl.run_dir / "faq.yaml"):
        decoy.write_text(faq("a decoy: read from the wrong folder"))
    return fl


def test_a_missing_or_invalid_file_is_refused_and_the_running_policy_keeps_serving(fleet: Fleet):
    fl = fleet
    before = running(fl)["version"]
    policy = fl.ops / "policy.yaml"
    policy.write_text(fl.render(pool_extra=pool_extra("faq.yaml")))  # ops/faq.yaml does not exist yet
    r = apply(fl, policy, fl.elsewhere)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pools[0].semantic.static_answers" in r.stderr and "cannot read" in r.stderr, r.stderr
    assert str(fl.ops / "faq.yaml") in r.stderr, r.stderr  # the folder of the file applied, not the cwd's
    (fl.ops / "faq.yaml").write_text('answers:\n  - questions: ["What are your support hours?", ""]\n'
                                     '    answer: "x"\n')
    r = apply(fl, policy, fl.elsewhere)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pools[0].semantic.static_answers" in r.stderr and "answers[0].questions[1]" in r.stderr, r.stderr
    # the API says the same to a client that sends the folder; a relative folder is a bad request
    r = fl.api("POST", "/api/v1/policy/validate", data=policy.read_text(),
               headers={"Content-Type": "application/yaml", "X-Kvgate-Policy-Dir": str(fl.ops)})
    assert r.status_code == 422, r.text
    assert [i["path"] for i in r.json()["error"]["issues"]] == ["pools[0].semantic.static_answers"], r.text
    r = fl.api("PUT", "/api/v1/policy", data=policy.read_text(),
               headers={"Content-Type": "application/yaml", "X-Kvgate-Policy-Dir": "ops"})
    assert r.status_code == 400, r.text
    assert running(fl)["version"] == before
    assert answer(fl) == "answer of the first file"


def test_a_relative_file_is_read_from_the_applied_files_folder_and_reloaded_on_apply(fleet: Fleet):
    fl = fleet
    policy = fl.ops / "policy.yaml"
    policy.write_text(fl.render(pool_extra=pool_extra("faq.yaml")))
    (fl.ops / "faq.yaml").write_text(faq("answer of ops/faq.yaml"))
    r = apply(fl, policy, fl.elsewhere)
    assert r.returncode == 0, r.stdout + r.stderr
    assert running(fl)["files_base"] == str(fl.ops)
    serves(fl, "answer of ops/faq.yaml")
    # the same policy text, the file's contents changed: apply (no new version) and the new answer
    (fl.ops / "faq.yaml").write_text(faq("answer of ops/faq.yaml, second edition"))
    r = apply(fl, policy, fl.elsewhere)
    assert r.returncode == 0 and "unchanged" in r.stdout, r.stdout + r.stderr
    serves(fl, "answer of ops/faq.yaml, second edition")
    # another path
    (fl.ops / "faq-b.csv").write_text(f"question,answer\n{QUESTION},answer of ops/faq-b.csv\n")
    policy_b = fl.ops / "policy-b.yaml"
    policy_b.write_text(fl.render(pool_extra=pool_extra("faq-b.csv")))
    r = apply(fl, policy_b, fl.elsewhere)
    assert r.returncode == 0 and "applied as version" in r.stdout, r.stdout + r.stderr
    serves(fl, "answer of ops/faq-b.csv")
    health = requests.get(f"http://127.0.0.1:{SEMANTIC_PORT}/health", timeout=5).json()
    assert not health["static_errors"], health


def test_the_admin_editor_reads_a_relative_file_from_the_running_policys_folder(fleet: Fleet):
    fl = fleet
    assert running(fl)["files_base"] == str(fl.ops)  # the previous test's apply
    auth = {"Authorization": f"Bearer {fl.token}"}
    (fl.ops / "faq-admin.yaml").write_text(faq("answer of ops/faq-admin.yaml"))
    missing = fl.render(pool_extra=pool_extra("faq-nowhere.yaml"))
    r = requests.post(fl.control + "/admin/policy/apply", data={"yaml": missing}, headers=auth, timeout=60)
    assert r.status_code == 422, r.text
    assert "pools[0].semantic.static_answers" in r.text and "faq-nowhere.yaml: cannot read" in r.text, r.text
    page = requests.get(fl.control + "/admin/policy", headers=auth, timeout=30)
    assert str(fl.ops) in page.text  # the page says where a relative file is read from
    r = requests.post(fl.control + "/admin/policy/apply", headers=auth, timeout=60,
                      data={"yaml": fl.render(pool_extra=pool_extra("faq-admin.yaml"))})
    assert r.status_code == 200, r.text
    assert running(fl)["files_base"] == str(fl.ops)
    serves(fl, "answer of ops/faq-admin.yaml")
