"""Invalidation of the semantic cache (issue 15) on the whole stack started by ``kvgate up``: the real
semantic service (``kvgate semantic``, real embeddings), the gateway, Redis, the control plane.
``kvgate cache invalidate --tag T`` removes the tagged exact and semantic entries;
``kvgate cache bump-knowledge POOL`` (and the admin Cache page's button) retires a pool's semantic
entries through the runtime push, without a reload."""

from __future__ import annotations

import pytest
import requests

from ctlfixtures import MODEL, Fleet, wait_until
from gwfixtures import free_port

pytestmark = pytest.mark.integration

QUESTION = "How do I enable two-factor authentication?"
PARAPHRASE = "how do i enable two-factor authentication"


def ask(fleet: Fleet, text: str, headers: dict | None = None) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 4}
    return requests.post(fleet.gateway + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def wait_inserts(fleet: Fleet, n: int) -> None:
    """Until the gateway has sent ``n`` semantic inserts the service took (they go from the store's
    timer after the answer): asking the paraphrase earlier would make it a miss of its own."""
    def done() -> bool:
        text = requests.get(f"http://127.0.0.1:{fleet.internal_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvgate_semantic_inserts_total{") and 'result="ok"' in line) >= n

    wait_until(done, f"{n} semantic inserts", timeout=10)


def test_tags_and_knowledge_version_retire_semantic_answers(control_fleet) -> None:
    port = free_port()
    fleet = control_fleet(n=1, pool_extra="    semantic: {enabled: true, similarity_min: 0.9, timeout_ms: 500}",
                          extra=f'semantic_service: {{listen: "127.0.0.1:{port}"}}')
    def up() -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok
        except requests.RequestException:
            return False

    wait_until(up, "the semantic service", 60)
    # the real service: a seeded question, its paraphrase answered from the cache
    first = ask(fleet, QUESTION, headers={"X-Kvgate-Cache-Tags": "doc-2fa"})
    assert first.status_code == 200 and first.headers["X-Kvgate-Cache"] == "MISS"
    wait_inserts(fleet, 1)
    hit = ask(fleet, PARAPHRASE)
    assert hit.headers["X-Kvgate-Cache"] == "SEMANTIC", hit.headers
    assert float(hit.headers["X-Kvgate-Similarity"]) >= 0.9
    assert hit.json() == first.json()
    # an unrelated question and a negation miss
    assert ask(fleet, "How do I disable two-factor authentication?").headers["X-Kvgate-Cache"] == "MISS"
    wait_inserts(fleet, 2)  # (the negation's own answer, inserted too)

    # the tag: exact and semantic entries go
    out = fleet.kvgate("cache", "invalidate", "--tag", "doc-2fa")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tag doc-2fa: 1 exact entries removed, 1 semantic" in out.stdout, out.stdout
    assert ask(fleet, PARAPHRASE).headers["X-Kvgate-Cache"] == "MISS"  # computed, stored and inserted again
    wait_inserts(fleet, 3)
    again = ask(fleet, "How do I enable two-factor authentication")
    assert again.headers["X-Kvgate-Cache"] == "SEMANTIC", again.headers

    # the knowledge version: pushed as runtime (no reload), every semantic answer of the pool retired
    loads = fleet.in_force()["loads"]
    out = fleet.kvgate("cache", "bump-knowledge", "default")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pool default: knowledge version 1 -> 2" in out.stdout, out.stdout
    assert fleet.in_force()["runtime"]["cache"]["knowledge"] == {"default": 2}
    assert fleet.in_force()["loads"] == loads, "a push, not a reload"
    r = ask(fleet, "how do I enable two-factor authentication?")
    assert r.headers["X-Kvgate-Cache"] == "MISS", r.headers
    # the exact cache is not the knowledge version's: a question asked before still hits exactly
    assert ask(fleet, PARAPHRASE).headers["X-Kvgate-Cache"] == "HIT"

    # the admin Cache page lists the pool's version and bumps it (JSON for a Bearer client)
    page = fleet.api("GET", "/admin/cache", headers={"Accept": "text/html"})
    assert page.status_code == 200 and "bump-knowledge-default" in page.text
    r = fleet.api("POST", "/admin/cache/knowledge/default")
    assert r.status_code == 200, r.text
    assert r.json()["old"] == 2 and r.json()["new"] == 3
    assert fleet.in_force()["runtime"]["cache"]["knowledge"] == {"default": 3}
    bad = fleet.api("POST", "/api/v1/cache/knowledge", json={"pool": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pool"
    bad = fleet.api("POST", "/api/v1/cache/invalidate-tag", json={"tag": "no spaces"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tag"
