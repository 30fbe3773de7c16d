"""The semantic service (``kvgate semantic``) for real: a real redis-server, the service as a
subprocess on its unix socket, the protocol the gateway speaks (/insert, /lookup, /invalidate,
/health, /metrics), TTLs on every key, an index rebuilt from Redis after a restart and shared by
two services, static answers from the policy's file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gwfixtures import RedisServer, _wait
from kvgate.semantic.client import SemanticClient

pytestmark = pytest.mark.integration

SCOPE = "a1" * 32
OTHER_SCOPE = "b2" * 32


class Service:
    def __init__(self, proc: subprocess.Popen, listen: str, log: Path):
        self.proc, self.listen, self.log = proc, listen, log
        self.client = SemanticClient(listen, timeout=10)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def write_policy(base: Path, redis: RedisServer, static: str | None = None) -> Path:
    faq = base / "faq.yaml"
    faq.write_text("similarity_min: 0.85\nanswers:\n"
                   "  - questions: ['What are your opening hours?', 'When are you open?']\n"
                   "    answer: 'We are open 9:00-17:00, Monday to Friday.'\n"
                   "  - questions: ['Do you offer gift wrapping?']\n"
                   "    answer: 'Yes, for 3 euros an item.'\n")
    p = base / "policy.yaml"
    p.write_text(f"version: 1\nredis: {{url: '{redis.url}', managed: false}}\n"
                 f"semantic_service: {{listen: 'unix:{base / 'run' / 'semantic.sock'}'}}\n"
                 "pools:\n  - name: default\n    models: [m]\n    nodes: [{id: n1, url: 'http://127.0.0.1:9'}]\n"
                 f"    semantic: {{enabled: true, static_answers: {static or 'faq.yaml'}}}\n")
    return p


@pytest.fixture
def services(tmp_path: Path, start_redis):
    redis = start_redis()
    policy = write_policy(tmp_path, redis)
    started: list[Service] = []

    def start(name: str = "a") -> Service:
        run_dir = tmp_path / f"run-{name}"
        log = tmp_path / f"semantic-{name}.log"
        listen = f"unix:{run_dir / 'semantic.sock'}"  # the root test runner reaches it (nginx's nobody would not)
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), "semantic",
                                 "--policy", str(policy), "--listen", listen],
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        svc = Service(proc, listen, log)
        started.append(svc)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"kvgate semantic exited: {log.read_text()}")
            try:
                return svc.client.health()["status"] == "ok"
            except OSError:
                return False

        _wait(ready, 60, "kvgate semantic")
        return svc

    start.redis = redis
    yield start
    for s in started:
        s.stop()


def test_insert_lookup_guards_scope_and_ttls(services) -> None:
    svc = services()
    c, r = svc.client, services.redis.client()
    c.insert("default", SCOPE, "How do I change my delivery address?", "kvgate:cache:k1", ttl_s=600, tags=["shipping"])
    c.insert("default", SCOPE, "What is the fee for order 5521?", "kvgate:cache:k2", ttl_s=600)

    hit = c.lookup("default", SCOPE, "How can I change my delivery address?", 0.9)
    assert hit["hit"] == "semantic" and hit["entry"] == "kvgate:cache:k1" and hit["rejected"] is None
    assert 0.9 <= hit["similarity"] <= 1.0 and hit["ms"] < 50
    # a guard: the same question with another number, a negation
    no = c.lookup("default", SCOPE, "What is the fee for order 5512?", 0.9)
    assert no["hit"] is None and no["rejected"] == "number" and no["entry"] is None
    no = c.lookup("default", SCOPE, "How do I not change my delivery address?", 0.9)
    assert no["hit"] is None and no["rejected"] == "negation"
    # another scope (another tenant, conversation, model...): never a candidate
    assert c.lookup("default", OTHER_SCOPE, "How can I change my delivery address?", 0.9)["hit"] is None
    assert c.lookup("other-pool", SCOPE, "How can I change my delivery address?", 0.9)["hit"] is None
    # below the threshold: a miss with no guard named
    miss = c.lookup("default", SCOPE, "Which courier do you use?", 0.9)
    assert miss == {**miss, "hit": None, "rejected": None}
    # past the model's 256 tokens only the beginning would be compared: never stored nor served
    long_q = "Please review this contract clause by clause. " * 60
    c.insert("default", SCOPE, long_q + "Is clause nine fair?", "kvgate:cache:long", ttl_s=600)
    no = c.lookup("default", SCOPE, long_q + "Is clause ten fair?", 0.9)
    assert no["hit"] is None and no["rejected"] == "length"
    # every key the semantic cache wrote has a TTL
    keys = list(r.scan_iter("kvgate:sem:*"))
    assert len(keys) == 3  # two entries and the tag's set
    assert all(0 < r.ttl(k) <= 600 for k in keys), {k: r.ttl(k) for k in keys}
    # /metrics counts per pool and result
    text = c.call("GET", "/metrics")[1]
    assert 'kvgate_semantic_service_lookups_total{pool="default",result="semantic"} 1.0' in text
    assert 'kvgate_semantic_service_guard_rejections_total{guard="number",pool="default"} 1.0' in text


def test_expiry_invalidation_and_bad_requests(services) -> None:
    svc = services()
    c = svc.client
    c.insert("default", SCOPE, "How long is the warranty?", "kvgate:cache:w", ttl_s=1)
    assert c.lookup("default", SCOPE, "How long is the warranty?", 0.9)["hit"] == "semantic"
    time.sleep(1.3)
    assert c.lookup("default", SCOPE, "How long is the warranty?", 0.9)["hit"] is None  # expired
    c.insert("default", SCOPE, "How do I return a parcel?", "kvgate:cache:r", ttl_s=600, tags=["returns-doc"])
    c.insert("default", SCOPE, "Where is the nearest store?", "kvgate:cache:s", ttl_s=600)
    assert c.invalidate(tag="returns-doc") == 1
    assert c.lookup("default", SCOPE, "How do I return a parcel?", 0.9)["hit"] is None
    assert c.lookup("default", SCOPE, "Where is the nearest store?", 0.9)["hit"] == "semantic"
    assert c.invalidate(pool="default") == 1
    assert not list(services.redis.client().scan_iter("kvgate:sem:e:*"))
    status, body = c.call("POST", "/lookup", {"pool": "default", "text": "x"})
    assert status == 400 and body["error"]["param"] == "scope" and body["error"]["type"] == "invalid_request_error"
    status, body = c.call("POST", "/lookup", {"pool": "default", "scope": SCOPE, "text": "x", "threshold": 0.2})
    assert status == 400 and "cosine similarity" in body["error"]["message"]
    assert c.call("POST", "/invalidate", {})[0] == 400


def test_restart_rebuilds_from_redis_and_two_services_share_entries(services) -> None:
    a = services("a")
    a.client.insert("default", SCOPE, "Can I pay by bank transfer?", "kvgate:cache:p", ttl_s=600)
    a.stop()
    a2 = services("a")  # the same host restarted: its index comes back from Redis
    assert a2.client.health()["entries"] == 1
    assert a2.client.lookup("default", SCOPE, "Can I pay with a bank transfer?", 0.9)["entry"] == "kvgate:cache:p"
    b = services("b")  # another host's service: started after the insert (rebuild) ...
    assert b.client.lookup("default", SCOPE, "Can I pay with a bank transfer?", 0.9)["hit"] == "semantic"
    # ... and following inserts and removals made through another service (pub/sub)
    a2.client.insert("default", SCOPE, "Do you sell gift cards?", "kvgate:cache:g", ttl_s=600)
    _wait(lambda: b.client.lookup("default", SCOPE, "Do you sell gift cards?", 0.9)["hit"] == "semantic", 5,
          "the insert seen by the other service")
    a2.client.invalidate(pool="default")
    _wait(lambda: b.client.health()["entries"] == 0, 5, "the removal seen by the other service")


def test_static_answers(services) -> None:
    c = services().client
    exact = c.lookup("default", SCOPE, "  when are you OPEN ", None, static=True, semantic=False)
    assert exact["hit"] == "static" and exact["similarity"] == 1.0
    assert exact["answer"] == "We are open 9:00-17:00, Monday to Friday."
    para = c.lookup("default", SCOPE, "What time are you open?", None, static=True, semantic=False)
    assert para["hit"] == "static" and 0.85 <= para["similarity"] < 1.0
    # guards apply to static answers too
    no = c.lookup("default", SCOPE, "Do you not offer gift wrapping?", None, static=True, semantic=False)
    assert no["hit"] is None and no["rejected"] == "negation"
    assert c.lookup("default", SCOPE, "When are you open?", None, static=False)["hit"] is None  # not asked
    assert c.health()["static"] == {"default": 3}


def test_static_answers_reload_with_their_file(services, tmp_path: Path) -> None:
    c = services().client
    faq = tmp_path / "faq.yaml"
    faq.write_text("answers:\n  - questions: ['What are your opening hours?']\n    answer: 'Now 8:00-20:00.'\n"
                   "  - questions: ['Where do I park?']\n    answer: ''\n")
    _wait(lambda: "default" in c.health()["static_errors"], 10, "the invalid file reported")
    err = c.health()["static_errors"]["default"]
    assert f"{faq}: answers[1].answer: answer must be a non-empty string" in err
    # the previous version keeps answering
    assert c.lookup("default", SCOPE, "When are you open?", None, static=True)["answer"].startswith("We are open")
    faq.write_text("answers:\n  - questions: ['What are your opening hours?']\n    answer: 'Now 8:00-20:00.'\n")
    _wait(lambda: c.lookup("default", SCOPE, "What are your opening hours?", None, static=True)["answer"]
          == "Now 8:00-20:00.", 10, "the new file answering")
    assert c.health()["static_errors"] == {}


def test_kvgate_up_starts_it_only_for_pools_that_use_it(tmp_path: Path, start_redis) -> None:
    """The stack's part (kvgate up → Stack.start_semantic): started with the policy when a pool
    has the semantic cache or static answers, kept while the policy's path holds, stopped when
    no pool uses it."""
    from kvgate.policy import load_policy
    from kvgate.stack import Stack

    redis = start_redis()
    policy_path = write_policy(tmp_path, redis)
    stack = Stack(tmp_path / "run")
    stack.logs.mkdir(parents=True)  # as `kvgate up` makes them
    stack.pids.mkdir(parents=True, exist_ok=True)
    try:
        assert stack.start_semantic(policy_path, load_policy(policy_path)) == "started"
        client = SemanticClient(f"unix:{tmp_path / 'run' / 'semantic.sock'}")

        def ready() -> bool:
            try:
                return client.health()["static"] == {"default": 3}
            except OSError:
                return False

        _wait(ready, 60, "the semantic service of kvgate up")
        assert stack.start_semantic(policy_path, load_policy(policy_path)) == "running"
        off = tmp_path / "off.yaml"
        off.write_text(policy_path.read_text().replace("semantic: {enabled: true, static_answers: faq.yaml}",
                                                       "semantic: {enabled: false}"))
        assert stack.start_semantic(off, load_policy(off)) == "stopped"
        assert stack.start_semantic(off, load_policy(off)) == "disabled"
    finally:
        stack._stop_pid("semantic")
