"""The control plane's state in Redis, so a restart (or a second instance reading it) loses nothing.

Keys (all under ``kvgate:control:``; values are JSON):

``node:<id>``        the node's record (state, since, reason, weights, health, warm-up, drain)
``report:<id>``      the agent's last report plus ``received_at`` (unix s)

and, for the gateway (outside ``kvgate:control:``, the contract of :mod:`kvgate.keys`):
``kvgate:load:<pool>`` a hash, node id -> the engine's last reported waiting/running/KV use
                     with ``received_at`` and the report interval (:func:`kvgate.keys.node_load_value`)
``pool:<name>``      pool runtime (overload degrade in force, since when)
``events``           a Redis stream of events, capped at ``control.events_kept``
``versions``         a list of applied policy versions, newest last, capped at ``control.versions_kept``
``version_seq``      the last version number handed out
``instance``         a random marker set by the first control plane to find none: a new value
                     means the store was emptied under it (restarted without persistence, flushed)

Every method raises :class:`StoreError` (with the Redis error) when Redis cannot be reached.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import redis

from .. import keys, redisconn

PREFIX = "kvgate:control:"
VERSIONS_KEY = PREFIX + "versions"
"""The applied policy versions (JSON, newest last); the semantic service follows the newest."""

log = logging.getLogger("kvgate.control")


class StoreError(RuntimeError):
    """Redis is unreachable or answered an error; the message says what was attempted."""


class Store:
    """Redis-backed state of one control plane.

    Args:
        url: ``redis://HOST:PORT/DB`` or the Sentinel form of :mod:`kvgate.redisconn`
            (``redis+sentinel://H:P,.../MASTER/DB``, the policy's ``redis.client_url``).
        timeout_s: socket timeout of every call.

    Through Sentinel, every save of a node record, a pool's state, a named value or an applied
    policy version ends with ``WAIT 1 WAIT_MS`` on the same connection (one pipeline), so the save
    returns once a replica holds it: a failover that promotes that replica keeps it
    (docs/sentinel.md, for what this does not cover).
    """

    WAIT_MS = 500
    """How long a save waits for one replica's acknowledgement (ms) before it returns anyway (logged)."""
    WAIT_SHORT_MS = 10
    NO_REPLICA_S = 10.0
    """After a save no replica acknowledged, the saves of the next NO_REPLICA_S wait only
    WAIT_SHORT_MS (an acknowledged one ends this at once)."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.r = redisconn.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    decode_responses=True, health_check_interval=30)
        self._down_until = 0.0
        self._last_error = ""
        self._wait = redisconn.is_sentinel(url)
        self.unreplicated = 0
        """Saves that no replica acknowledged within WAIT_MS (through Sentinel only)."""
        self._unreplicated_logged = 0.0
        self._no_replica_until = 0.0

    def _save(self, what: str, pipe) -> list[Any]:
        """Execute ``pipe`` (the writes of one logical save), with ``WAIT 1 WAIT_MS`` appended
        through Sentinel; returns the writes' replies."""
        if not self._wait:
            return self._call(what, pipe.execute)
        # with no replica acknowledging lately (it is down or resyncing), a save waits only
        # WAIT_SHORT_MS: the control plane must not slow to one save per WAIT_MS meanwhile
        short = time.monotonic() < self._no_replica_until
        pipe.execute_command("WAIT", 1, self.WAIT_SHORT_MS if short else self.WAIT_MS)
        replies = self._call(what, pipe.execute)
        if replies[-1]:
            self._no_replica_until = 0.0
        else:
            self._no_replica_until = time.monotonic() + self.NO_REPLICA_S
            self.unreplicated += 1
            if time.monotonic() - self._unreplicated_logged > 10:
                self._unreplicated_logged = time.monotonic()
                log.warning("redis %s: %s: no replica acknowledged within %d ms (%d such saves so far): a failover "
                            "now could lose it", self.url, what, self.WAIT_MS, self.unreplicated)
        return replies[:-1]

    def save(self, what: str, pipe) -> list[Any]:
        """Execute ``pipe`` (a pipeline of ``self.r``, no transaction) as one logical save: through
        Sentinel followed by ``WAIT 1 WAIT_MS`` on the same connection. Returns its replies.
        Raises StoreError."""
        return self._save(what, pipe)

    def _save_one(self, what: str, method: str, *args, **kwargs) -> Any:
        if not self._wait:
            return self._call(what, getattr(self.r, method), *args, **kwargs)
        pipe = self.r.pipeline(transaction=False)
        getattr(pipe, method)(*args, **kwargs)
        return self._save(what, pipe)[0]

    BREAKER_S = 2.0
    """After a failed call, calls fail at once for this long: an unreachable Redis (a network
    partition, where every call would wait for its timeout) must not stall the control plane."""

    def _call(self, what: str, fn, *args, **kwargs):
        if time.monotonic() < self._down_until:
            raise StoreError(f"redis {self.url}: {what}: unavailable (last error: {self._last_error})")
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            self._down_until = time.monotonic() + self.BREAKER_S
            self._last_error = str(exc)
            raise StoreError(f"redis {self.url}: {what}: {exc}") from None

    def ping(self) -> bool:
        """Whether Redis answers now (ignores the breaker)."""
        try:
            ok = bool(self.r.ping())
        except redis.RedisError:
            return False
        self._down_until = 0.0
        return ok

    # ------------------------------------------------------------- nodes
    def nodes(self) -> dict[str, dict[str, Any]]:
        """Every stored node record by id."""
        keys = self._call("list nodes", lambda: list(self.r.scan_iter(PREFIX + "node:*", count=500)))
        if not keys:
            return {}
        values = self._call("read nodes", self.r.mget, keys)
        out = {}
        for k, v in zip(keys, values):
            if v:
                out[k.removeprefix(PREFIX + "node:")] = json.loads(v)
        return out

    def put_node(self, record: dict[str, Any]) -> None:
        self._save_one("write node", "set", PREFIX + f"node:{record['id']}", json.dumps(record, sort_keys=True))

    def put_nodes(self, records: list[dict[str, Any]]) -> None:
        """:meth:`put_node` of several records in one round trip (a pipeline, no transaction):
        a probe round saves every node's health counters, 1,000 SETs at 1,000 nodes."""
        if not records:
            return
        pipe = self.r.pipeline(transaction=False)
        for record in records:
            pipe.set(PREFIX + f"node:{record['id']}", json.dumps(record, sort_keys=True))
        self._save("write nodes", pipe)

    def delete_node(self, node_id: str) -> None:
        self._save_one("delete node", "delete", PREFIX + f"node:{node_id}", PREFIX + f"report:{node_id}")

    # ----------------------------------------------------------- reports
    def put_report(self, node_id: str, report: dict[str, Any], received_at: float) -> None:
        body = json.dumps({"received_at": received_at, "report": report})
        self._call("write report", self.r.set, PREFIX + f"report:{node_id}", body, ex=24 * 3600)

    def put_report_and_load(self, pool: str, node_id: str, report: dict[str, Any], received_at: float,
                            interval_s: float) -> None:
        """:meth:`put_report` and :meth:`put_node_load` in one round trip (a pipeline, no
        transaction): 1,000 agents reporting every 2 s are 500 of these a second."""
        eng = report.get("engine") or {}
        value = keys.node_load_value(received_at, interval_s, eng.get("waiting"), eng.get("running"),
                                     eng.get("kv_cache_usage"))
        key = keys.node_load_key(pool)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(PREFIX + f"report:{node_id}", json.dumps({"received_at": received_at, "report": report}),
                 ex=24 * 3600)
        pipe.hset(key, node_id, value)
        pipe.expire(key, 24 * 3600)
        self._call("write report", pipe.execute)

    def put_node_load(self, pool: str, node_id: str, report: dict[str, Any], received_at: float,
                      interval_s: float) -> None:
        """The engine figures of a report where the gateway reads them (``kvgate:load:<pool>``,
        field ``node_id``; the hash lives a day past the last report): ``waiting``, ``running``
        and ``kv_cache_usage`` of ``report["engine"]``, ``-`` for each one it lacks."""
        eng = report.get("engine") or {}
        value = keys.node_load_value(received_at, interval_s, eng.get("waiting"), eng.get("running"),
                                     eng.get("kv_cache_usage"))
        key = keys.node_load_key(pool)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, node_id, value)
        pipe.expire(key, 24 * 3600)
        self._call("write node load", pipe.execute)

    def reports(self, node_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{id: {"received_at": s, "report": {...}}}`` for the nodes that have one."""
        if not node_ids:
            return {}
        values = self._call("read reports", self.r.mget, [PREFIX + f"report:{n}" for n in node_ids])
        return {n: json.loads(v) for n, v in zip(node_ids, values) if v}

    def try_reports(self, node_ids: list[str]) -> dict[str, dict[str, Any]] | None:
        """:meth:`reports`, or None (logged) when Redis cannot be read: then nothing that depends
        on reports is decided (a Redis outage must not look like dead agents)."""
        try:
            return self.reports(node_ids)
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    # ------------------------------------------------------------- pools
    def pools(self, names: list[str]) -> dict[str, dict[str, Any]]:
        if not names:
            return {}
        values = self._call("read pools", self.r.mget, [PREFIX + f"pool:{n}" for n in names])
        return {n: json.loads(v) for n, v in zip(names, values) if v}

    def put_pool(self, name: str, record: dict[str, Any]) -> None:
        self._save_one("write pool", "set", PREFIX + f"pool:{name}", json.dumps(record, sort_keys=True))

    # ------------------------------------------------------------ events
    def add_event(self, kind: str, message: str, node: str | None = None, pool: str | None = None,
                  keep: int = 10000, **data: Any) -> dict[str, Any]:
        """Append an event; returns it (with its stream ``id``). Never raises: an event that cannot
        be stored is returned with ``id: null`` (the caller's action must not fail for it)."""
        event = {"ts": time.time(), "kind": kind, "message": message, "node": node, "pool": pool, "data": data}
        try:
            event_id = self._call("write event", self.r.xadd, PREFIX + "events", {"json": json.dumps(event)},
                                  maxlen=keep, approximate=True)
        except StoreError:
            event_id = None
        return {"id": event_id, **event}

    def events(self, limit: int = 100, node: str | None = None, kind: str | None = None,
               before: str | None = None) -> list[dict[str, Any]]:
        """Newest first; filtered by node and/or kind prefix (``reload`` matches ``reload``,
        ``reload_failed``); ``before`` is an event id to page from."""
        out: list[dict[str, Any]] = []
        end = f"({before}" if before else "+"
        while len(out) < limit:
            batch = self._call("read events", self.r.xrevrange, PREFIX + "events", max=end, min="-", count=500)
            if not batch:
                break
            for event_id, fields in batch:
                ev = {"id": event_id, **json.loads(fields["json"])}
                if node and ev.get("node") != node:
                    continue
                if kind and not str(ev.get("kind", "")).startswith(kind):
                    continue
                out.append(ev)
                if len(out) >= limit:
                    break
            end = f"({batch[-1][0]}"
        return out

    # -------------------------------------------------------------- misc
    def instance(self) -> str:
        """The store's instance marker (``instance``), set to a new random value when there is
        none: a Redis that restarted empty, or was flushed, answers a value it never did before."""
        value = self._call("read instance", self.r.get, PREFIX + "instance")
        if value:
            return value
        self._call("write instance", self.r.set, PREFIX + "instance", uuid.uuid4().hex, nx=True)
        return self._call("read instance", self.r.get, PREFIX + "instance") or ""

    def try_instance(self) -> str | None:
        """:meth:`instance`, or None (logged) when Redis cannot be read."""
        try:
            return self.instance()
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    def restore(self, records: list[dict[str, Any]], pools: dict[str, dict[str, Any]], namespace_max: int) -> None:
        """Write node records, pool states and the namespace floor again (into a store that was
        emptied under the control plane). Errors are logged: the next change writes them again."""
        for rec in records:
            try:
                self.put_node(rec)
            except StoreError as exc:
                log.warning("%s", exc)
        try:
            for name, p in pools.items():
                self.put_pool(name, p)
            if namespace_max:
                self.set("cache_namespace_max", str(namespace_max))
        except StoreError as exc:
            log.warning("%s", exc)

    def get(self, name: str) -> str | None:
        return self._call(f"read {name}", self.r.get, PREFIX + name)

    def set(self, name: str, value: str) -> None:
        self._save_one(f"write {name}", "set", PREFIX + name, value)

    def revoke_session(self, sid: str, ttl_s: int) -> None:
        """Mark an admin page session as signed out (until it would have expired anyway)."""
        self._save_one("revoke session", "set", PREFIX + "revoked_session:" + sid, "1", ex=max(1, int(ttl_s)))

    def session_revoked(self, sid: str) -> bool:
        return bool(self._call("read session", self.r.exists, PREFIX + "revoked_session:" + sid))

    # ----------------------------------------------------------- versions
    def add_version(self, yaml_text: str, digest: str, source: str, keep: int = 100,
                    files_base: str | None = None) -> dict[str, Any]:
        """Record an applied policy text as the next version. ``files_base``: the folder its relative
        file names (``pools[].semantic.static_answers``) are read from — the folder of the file the
        operator applied — kept with the version so a rollback and the semantic service read the
        same files (docs/semantic-cache.md)."""
        seq = int(self._call("number version", self.r.incr, PREFIX + "version_seq"))
        version = {"version": seq, "yaml": yaml_text, "digest": digest, "source": source, "applied_at": time.time(),
                   "files_base": files_base}
        # WAIT inside MULTI returns at once: through Sentinel the push and the trim go without a
        # transaction (a trim after another writer's push still keeps the newest `keep`)
        pipe = self.r.pipeline(transaction=not self._wait)
        pipe.rpush(VERSIONS_KEY, json.dumps(version))
        pipe.ltrim(VERSIONS_KEY, -keep, -1)
        self._save("write version", pipe)
        return version

    def versions(self) -> list[dict[str, Any]]:
        """Applied versions, newest first."""
        values = self._call("read versions", self.r.lrange, VERSIONS_KEY, 0, -1)
        return [json.loads(v) for v in reversed(values)]

    def latest_version(self) -> dict[str, Any] | None:
        value = self._call("read version", self.r.lindex, VERSIONS_KEY, -1)
        return json.loads(value) if value else None
