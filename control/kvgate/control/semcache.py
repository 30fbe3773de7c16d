"""Invalidation of the semantic cache and of tagged cache entries (issue 15), for the control
plane (:class:`kvgate.control.plane.ControlPlane`), its API and the admin page.

* :func:`bump_knowledge`: a pool's ``knowledge_version`` one above the one in force, as a
  *runtime* value (``cache.knowledge`` of :func:`kvgate.render.runtime_document`, pushed to the
  gateway without a reload). The version is part of every semantic scope the gateway computes
  (lua/kvgate/semantic.lua), so the pool's semantic entries are never matched again and expire
  by their TTL. The highest version ever in force is kept in Redis (``knowledge_max``) and never
  goes back: a policy file with a lower ``knowledge_version`` does not make old answers
  reachable again.
* :func:`invalidate_tag`: every exact-cache entry filed under a tag (``X-Kvgate-Cache-Tags`` on
  the request that stored it; the gateway keeps a set ``kvgate:tag:<tag>`` of entry keys with a
  TTL) is deleted, and the semantic service is asked to drop its entries with the tag
  (``POST /invalidate``): "delete a document → its answers go".
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fleet.events import EventKind
from ..keys import TAG_PREFIX  # the gateway's sets of exact-cache keys per tag
from .store import StoreError

if TYPE_CHECKING:  # pragma: no cover
    from .plane import ControlPlane

log = logging.getLogger(__name__)

KNOWLEDGE_KEY = "knowledge_max"
"""The store's record (under ``kvgate:control:``) of pool → the highest knowledge_version in force (JSON)."""
SERVICE_TIMEOUT_S = 5.0
MAX_TAG_BYTES = 64


class CacheOpError(ValueError):
    """A bad request to a cache operation (unknown pool, bad tag); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def load_floor(plane: "ControlPlane") -> dict[str, int]:
    """pool → the highest knowledge_version ever in force, from the store ({} when none or unreadable)."""
    try:
        raw = plane.store.get(KNOWLEDGE_KEY)
    except StoreError as exc:
        log.warning("knowledge versions not readable: %s", exc)
        return {}
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int) and v >= 1} if isinstance(data, dict) else {}


def knowledge_in_force(plane: "ControlPlane") -> dict[str, int]:
    """pool → its knowledge_version in force (the policy's, or the floor when higher), for every pool."""
    assert plane.policy is not None
    floor = getattr(plane, "knowledge_floor", {}) or {}
    return {p.name: max(p.semantic.knowledge_version, int(floor.get(p.name) or 0)) for p in plane.policy.pools}


def bump_knowledge(plane: "ControlPlane", pool: str, source: str) -> dict[str, Any]:
    """Raise ``pool``'s knowledge_version by one and push the runtime (no reload).

    Returns ``{"pool", "old", "new", "result"}`` (``result``: the push's, e.g. ``pushed``).
    Raises CacheOpError (no such pool, or the pool has neither the semantic cache nor static
    answers), StoreError (Redis unreachable: nothing changed), ApplyError."""
    with plane.lock:
        if plane.policy is None:
            raise CacheOpError("no policy is applied yet")
        p = next((p for p in plane.policy.pools if p.name == pool), None)
        if p is None:
            raise CacheOpError(f"no pool {pool!r} in the policy", "pool")
        if not (p.semantic.enabled or p.semantic.static_answers):
            raise CacheOpError(f"pool {pool!r} has neither the semantic cache nor static answers "
                               "(pools[].semantic.enabled / static_answers)", "pool")
        old = knowledge_in_force(plane)[pool]
        new = old + 1
        floor = dict(getattr(plane, "knowledge_floor", {}) or {})
        floor[pool] = new
        plane.store.set(KNOWLEDGE_KEY, json.dumps(floor, sort_keys=True))  # recorded first: never goes back
        plane.knowledge_floor = floor
        result = plane.apply_runtime(force=True)
        plane.event(EventKind.CACHE_INVALIDATED, f"semantic cache of pool {pool} invalidated by {source}: "
                    f"knowledge version {old} → {new}", pool=pool, old=old, new=new)
        return {"pool": pool, "old": old, "new": new, "result": result}


def check_tag(tag: str) -> str:
    """The tag as the gateway files it (1-64 bytes of letters, digits, ``_ . : / -``) or CacheOpError."""
    tag = (tag or "").strip()
    if not tag or len(tag.encode()) > MAX_TAG_BYTES or any(not (c.isascii() and (c.isalnum() or c in "_.:/-"))
                                                            for c in tag):
        raise CacheOpError("a tag is 1-64 characters of letters, digits and _ . : / -", "tag")
    return tag


def _service_call(listen: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the semantic service at ``listen`` (``unix:/path`` or ``HOST:PORT``)."""
    if listen.startswith("unix:"):
        class _Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(SERVICE_TIMEOUT_S)
                self.sock.connect(listen[5:])

        conn: http.client.HTTPConnection = _Unix("localhost", timeout=SERVICE_TIMEOUT_S)
    else:
        host, _, port = listen.rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=SERVICE_TIMEOUT_S)
    try:
        data = json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", "Content-Length": str(len(data))})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status >= 300:
            raise OSError(f"{path}: HTTP {resp.status}")
        return json.loads(raw) if raw else {}
    finally:
        conn.close()


def invalidate_tag(plane: "ControlPlane", tag: str, source: str) -> dict[str, Any]:
    """Delete every exact-cache entry filed under ``tag`` and the semantic service's entries with it.

    Returns ``{"tag", "removed_exact": n, "removed_semantic": n | None, "semantic_error": str | None}``
    (``None``: the service was not reachable; its entries then point at deleted exact entries, so
    a semantic lookup finds them stale and misses). Raises CacheOpError (bad tag), StoreError."""
    from ..render import semantic_listen

    tag = check_tag(tag)
    assert plane.policy is not None
    r = plane.store.r
    key = TAG_PREFIX + tag
    try:
        members = [m for m in r.smembers(key)]
        removed = 0
        for i in range(0, len(members), 500):
            removed += int(r.delete(*members[i:i + 500]) or 0)
        r.delete(key)
    except Exception as exc:  # redis-py's errors: the store's kind
        raise StoreError(f"invalidate tag {tag}: {exc}") from None
    sem: int | None = None
    err: str | None = None
    if any(p.semantic.enabled for p in plane.policy.pools):
        listen = semantic_listen(plane.policy, Path(plane.run_dir) if plane.run_dir else None)
        try:
            sem = int(_service_call(listen, "/invalidate", {"tag": tag}).get("removed") or 0)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            err = f"the semantic service at {listen} did not answer: {exc}"
            log.warning("%s", err)
    plane.event(EventKind.CACHE_INVALIDATED, f"cache entries tagged {tag} removed by {source}: {removed} exact"
                + (f", {sem} semantic" if sem is not None else ""), tag=tag, removed=removed)
    return {"tag": tag, "removed_exact": removed, "removed_semantic": sem, "semantic_error": err}
