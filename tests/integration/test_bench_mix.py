"""The bill demo's mixed workload (kvgate.bench.mix, issue 16): deterministic, its shares those of
mix.yaml, its FAQ set what the semantic cache's embedding and guards pass, and a small run of it
through a real stack (``kvgate up``: gateway, Redis, simulators, control plane, batch worker) in
both modes.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import yaml

from ctlfixtures import MIX_TENANTS, MODEL, control_fleet_module  # noqa: F401 - fixture

pytestmark = pytest.mark.integration
multiturn = pytest.importorskip("kvgate.bench.multiturn", reason="part S's multi-turn workload has not landed")

from kvgate.bench import mix as mixmod  # noqa: E402



def _fingerprint(m: mixmod.Mix) -> tuple:
    return ([(r.index, m.trace_tenant[r.index]) for r in m.trace],
            [(c.id, c.start_s, c.turns, c.answers, c.system) for c in m.conversations],
            m.faq, m.batch_lines)


def test_load_mix_is_deterministic_and_has_the_files_shares():
    a = mixmod.load_mix(model=MODEL)
    b = mixmod.load_mix(model=MODEL)
    assert _fingerprint(a) == _fingerprint(b)
    params = mixmod.read_params()
    counts = a.counts()
    n = sum(counts.values())
    for kind, share in params["shares"].items():
        assert share["source"]
        assert abs(counts[kind] / n - share["value"]) < 0.02, (kind, counts, n)
    paths = {p: sum(q.path == p for q in a.faq) / len(a.faq) for p in ("exact", "semantic", "static")}
    for p, v in params["faq"]["paths"].items():
        assert abs(paths[p] - v) < 0.05, paths
    lo, hi = params["multi_turn"]["turns"]
    assert all(lo <= len(c.turns) <= hi for c in a.conversations)
    assert 0.6 <= a.params["measured"]["multi_turn_history_share"] <= 0.8
    assert a.tenants == {"chat-a", "chat-b", "assistant", "support", "jobs"}
    assert set(m for m in a.trace_tenant.values()) == {"chat-a", "chat-b"}
    # a conversation of the trace (its second block) stays with one tenant
    by_conv: dict[int, set[str]] = {}
    for r in a.trace:
        if len(r.hash_ids) > 1:
            by_conv.setdefault(r.hash_ids[1], set()).add(a.trace_tenant[r.index])
    assert all(len(t) == 1 for t in by_conv.values())
    # scale grows the mix, the shares stay
    big = mixmod.load_mix(model=MODEL, scale=1.5)
    assert sum(big.counts().values()) > 1.3 * n
    assert "trace" in a.describe() and f"{counts['faq']:,} FAQ" in a.describe()


def test_faq_set_passes_the_guards_where_it_should():
    """Each paraphrase passes (similarity and guards) against every phrasing of its own topic, no
    phrasing against another topic's, no dynamic question matches a static answer, and each static
    paraphrase matches its own answer (the real embedding model, kvgate.semantic.guards)."""
    from kvgate.semantic.embed import Embedder
    from kvgate.semantic.guards import check
    from kvgate.semantic.static import load_static

    params = mixmod.read_params()
    qs = yaml.safe_load(mixmod._resolve(params["faq"]["questions"]).read_text())
    static = load_static(mixmod._resolve(params["faq"]["static_answers"]))
    emb = Embedder()
    dyn = [(i, q) for i, t in enumerate(qs["dynamic"]) for q in [t["ask"], *t["paraphrases"]]]
    vec = emb.embed([q for _, q in dyn])
    bad = []
    for (x, (i, a)), (y, (j, b)) in itertools.combinations(enumerate(dyn), 2):
        passes = float(vec[x] @ vec[y]) >= 0.92 and check(a, b) is None
        if passes != (i == j):
            bad.append((a, b))
    svec = emb.embed(static.questions)

    def static_answer(q: str):
        v = emb.embed([q])[0]
        sims = svec @ v
        for k in sims.argsort()[::-1][:5]:
            if sims[k] >= static.similarity_min and check(static.questions[k], q) is None:
                return static.qa[k]
        return None

    bad += [(q, "static") for _, q in dyn if static_answer(q) is not None]
    for sp in qs["static_paraphrases"]:
        want = static.qa[static.questions.index(sp["covers"])]
        bad += [(q, sp["covers"]) for q in sp["paraphrases"] if static_answer(q) != want]
    assert not bad


@pytest.fixture(scope="module")
def stack(control_fleet_module):  # noqa: F811
    fleet = control_fleet_module(n=2, gateway_extra=", auth: optional", extra=MIX_TENANTS)
    fleet.keys = {}
    for t in ("chat-a", "chat-b", "assistant", "support", "jobs"):
        r = fleet.api("POST", "/api/v1/keys", json={"tenant": t, "name": "mix"})
        assert r.status_code == 201, r.text
        fleet.keys[t] = r.json()["secret"]
    return fleet


@pytest.mark.parametrize("mode", ["baseline", "kvgate"])
def test_a_tiny_mix_runs_in_both_modes(stack, mode):
    m = mixmod.load_mix(model=MODEL, scale=0.03)
    res = asyncio.run(mixmod.run_mix(m, gateway=stack.gateway, keys=stack.keys, mode=mode, speedup=20,
                                     concurrency=64))
    failed = [(o.id, o.status, o.error) for o in res.live if not o.ok]
    assert not failed
    kinds = {k: [o for o in res.live if o.kind == k] for k in ("trace", "multi_turn", "faq", "batch_live")}
    counts = m.counts()
    assert len(kinds["trace"]) == counts["trace"] and len(kinds["faq"]) == counts["faq"]
    assert len(kinds["multi_turn"]) == counts["multi_turn"]
    ids = [o.id for o in res.live]
    assert len(ids) == len(set(ids))
    assert all(o.prompt_tokens and o.completion_tokens for o in kinds["trace"] + kinds["multi_turn"])
    assert {o.tenant for o in kinds["trace"]} <= {"chat-a", "chat-b"}
    if mode == "baseline":
        assert len(kinds["batch_live"]) == counts["batch"] and res.batch_id is None and not res.batch_output
    else:
        assert not kinds["batch_live"]
        assert res.batch_status == "completed" and res.batch_ok == counts["batch"] and res.batch_failed == 0
        assert set(res.batch_output) == {x["custom_id"] for x in m.batch_lines}
        assert all(u.get("prompt_tokens") for u in res.batch_output.values())
        # the FAQ's exact repeats are answered by the response cache (no semantic service here)
        assert any(o.cache == "HIT" for o in kinds["faq"])
