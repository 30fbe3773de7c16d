"""Tenants' API keys in Redis: created, listed and revoked by the control plane, read by every
gateway (``lua/kvgate/tenant.lua``).

A key is ``kvg-`` + 43 URL-safe base64 characters (32 random bytes, :func:`secrets.token_urlsafe`).
Only its SHA-256 digest is stored: ``kvgate:apikey:<sha256 hex>`` is a hash with ``id``
(``key_`` + 12 hex, what operators see and revoke by), ``tenant``, ``name``, ``created`` and
``last_used`` (unix seconds; ``last_used`` is set by the gateways, about every
``gateway.auth_cache_ttl_s``), ``revoked`` (``0``/``1``). ``kvgate:apikeys`` maps each id to its
digest. The secret is returned once, by :meth:`ApiKeys.create`, and is written nowhere: not to
Redis, not to a log, not to an event (events name the key's id).

Revoking keeps the record (``revoked = 1``): the gateways' per-worker caches drop a revoked key
within ``gateway.auth_cache_ttl_s`` seconds (docs/tenants.md).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from .. import keys
from .store import Store

SECRET_PREFIX = "kvg-"
"""Every kvgate API key starts with this (secret scanners and logs can spot one)."""
MAX_NAME = 100
_ID_RE = re.compile(r"^key_[0-9a-f]{12}$")


def digest(secret: str) -> str:
    """SHA-256 hex of a secret: its identity in Redis (the gateway hashes the Bearer token alike)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One key's record (never its secret). ``created``/``last_used``: unix seconds (``None``: never used)."""

    id: str
    tenant: str
    name: str
    created: float
    last_used: float | None
    revoked: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ApiKeyError(ValueError):
    """A key request that cannot be done: an unknown tenant, a bad name (→ 400)."""


class UnknownKey(KeyError):
    """No key has this id (→ 404)."""


def _record(h: dict[str, str]) -> ApiKey:
    used = h.get("last_used")
    return ApiKey(id=h.get("id", ""), tenant=h.get("tenant", ""), name=h.get("name", ""),
                  created=float(h.get("created") or 0), last_used=float(used) if used else None,
                  revoked=h.get("revoked") == "1")


class ApiKeys:
    """The API keys of one Redis (``store``: the control plane's :class:`~kvgate.control.store.Store`;
    every call raises :class:`~kvgate.control.store.StoreError` when Redis is unreachable)."""

    def __init__(self, store: Store):
        self.store = store

    def create(self, tenant: str, name: str = "", tenants: list[str] | None = None) -> tuple[ApiKey, str]:
        """A new key of ``tenant`` -> (its record, the secret). ``tenants``: the policy's tenant ids
        (``ApiKeyError`` when ``tenant`` is not one of them). The secret is not kept anywhere."""
        if tenants is not None and tenant not in tenants:
            raise ApiKeyError(f"unknown tenant {tenant!r}: the policy's tenants are "
                              f"{', '.join(tenants) if tenants else 'none (set gateway.auth and tenants)'}")
        if len(name) > MAX_NAME or any(not c.isprintable() for c in name):
            raise ApiKeyError(f"a key's name is at most {MAX_NAME} printable characters")
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        d = digest(secret)
        key_id = "key_" + secrets.token_hex(6)
        rec = ApiKey(id=key_id, tenant=tenant, name=name, created=round(time.time(), 3), last_used=None,
                     revoked=False)
        # one pipeline, and through Sentinel followed by WAIT (Store.save): a key printed once must
        # survive a failover that promotes the replica (no MULTI: WAIT inside it returns at once;
        # the record is written before its index entry, which is what lists it)
        pipe = self.store.r.pipeline(transaction=False)
        pipe.hset(keys.apikey_key(d), mapping={"id": key_id, "tenant": tenant, "name": name,
                                               "created": f"{rec.created:.3f}", "revoked": "0"})
        pipe.hset(keys.APIKEY_INDEX, key_id, d)
        self.store.save("create api key", pipe)
        return rec, secret

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        """Every key (of ``tenant`` when given), oldest first."""
        r = self.store.r
        index = self.store._call("list api keys", r.hgetall, keys.APIKEY_INDEX)
        if not index:
            return []

        def read() -> list[dict[str, str]]:
            pipe = r.pipeline(transaction=False)
            for d in index.values():
                pipe.hgetall(keys.apikey_key(d))
            return pipe.execute()

        out = [_record(h) for h in self.store._call("read api keys", read) if h]
        if tenant is not None:
            out = [k for k in out if k.tenant == tenant]
        return sorted(out, key=lambda k: (k.created, k.id))

    def get(self, key_id: str) -> ApiKey:
        """The key with this id. Raises :class:`UnknownKey`."""
        d = self._digest_of(key_id)
        h = self.store._call("read api key", self.store.r.hgetall, keys.apikey_key(d))
        if not h:
            raise UnknownKey(f"no API key {key_id!r}")
        return _record(h)

    def revoke(self, key_id: str) -> ApiKey:
        """Mark the key revoked (idempotent) -> its record. Raises :class:`UnknownKey`."""
        d = self._digest_of(key_id)
        k = keys.apikey_key(d)
        # only an existing record: HSET on a missing hash would create a half one. Through Sentinel
        # the revocation is WAITed for (Store.save): a failover must not bring a revoked key back
        pipe = self.store.r.pipeline(transaction=False)
        pipe.eval("if redis.call('EXISTS', KEYS[1]) == 1 then "
                  "redis.call('HSET', KEYS[1], 'revoked', '1') return 1 end return 0", 1, k)
        done = self.store.save("revoke api key", pipe)[0]
        if not done:
            raise UnknownKey(f"no API key {key_id!r}")
        return self.get(key_id)

    def _digest_of(self, key_id: str) -> str:
        if not _ID_RE.match(key_id or ""):
            raise UnknownKey(f"no API key {key_id[:40]!r}: ids look like key_0123456789ab")
        d = self.store._call("read api key index", self.store.r.hget, keys.APIKEY_INDEX, key_id)
        if not d:
            raise UnknownKey(f"no API key {key_id!r}")
        return d
