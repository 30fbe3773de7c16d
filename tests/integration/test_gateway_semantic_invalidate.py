"""Invalidation of the semantic cache (issue 15) on the whole stack started by ``kvgate up``: the real
semantic service (``kvgate semantic``, real embeddings), the gateway, Redis, the control plane.
``kvgate cache invalidate --tag T`` removes the tagged exact and semantic entries;
``kvgate cache bump-knowledge POOL`` (and the admin Cache page's button) retires a pool's semantic
entries through the runtime push, without a reload."""

from __future__ import annotations

import time

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


def wait_semantic(fleet: Fleet, text: str) -> requests.Response:
    """The paraphrase until it is a SEMANTIC hit (the insert goes from a timer, then an embedding)."""
    def hit():
        r = ask(fleet, text)
        return r if r.headers.get("X-Kvgate-Cache") == "SEMANTIC" else None

    return wait_until(hit, "a semantic hit", timeout=10)


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
    hit = wait_semantic(fleet, PARAPHRASE)
    assert float(hit.headers["X-Kvgate-Similarity"]) >= 0.9
    assert hit.json() == first.json()
    # an unrelated question and a negation miss
    assert ask(fleet, "How do I disable two-factor authentication?").headers["X-Kvgate-Cache"] == "MISS"

    # the tag: exact and semantic entries go
    out = fleet.kvgate("cache", "invalidate", "--tag", "doc-2fa")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tag doc-2fa: 1 exact entries removed, 1 semantic" in out.stdout, out.stdout
    assert ask(fleet, QUESTION).headers["X-Kvgate-Cache"] == "MISS"  # recomputed (and stored again, untagged)
    time.sleep(0.3)
    hit = wait_semantic(fleet, PARAPHRASE)

    # the knowledge version: pushed as runtime (no reload), every semantic answer of the pool retired
    loads = fleet.in_force()["loads"]
    out = fleet.kvgate("cache", "bump-knowledge", "default")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pool default: knowledge version 1 -> 2" in out.stdout, out.stdout
    assert fleet.in_force()["runtime"]["cache"]["knowledge"] == {"default": 2}
    assert fleet.in_force()["loads"] == loads, "a push, not a reload"
    r = ask(fleet, PARAPHRASE)
    assert r.headers["X-Kvgate-Cache"] == "MISS", r.headers
    # the exact cache is not the knowledge version's: the question itself still hits exactly
    assert ask(fleet, QUESTION).headers["X-Kvgate-Cache"] == "HIT"

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
