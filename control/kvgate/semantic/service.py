"""The semantic service (``kvgate semantic``): HTTP/1.1 JSON over a unix socket or a loopback
port, one per gateway host. The protocol (the gateway is the client, docs/semantic-cache.md):

- ``POST /lookup`` ``{"pool", "scope", "text", "threshold", "static": bool, "semantic": bool}`` →
  200 ``{"hit": "semantic"|"static"|null, "similarity", "entry", "answer", "rejected", "ms"}``;
- ``POST /insert`` ``{"pool", "scope", "text", "entry", "ttl_s", "tags": [...]}`` → 204;
- ``POST /invalidate`` ``{"pool"?, "tag"?}`` → 200 ``{"removed": n}``;
- ``GET /health`` → 200 ``{"status": "ok", ...}``; ``GET /metrics`` → Prometheus text.

Bad requests are 400 in OpenAI's error format. A lookup embeds the text once (onnxruntime, in a
thread pool, so the event loop keeps accepting), searches the index of its (pool, scope), then
checks the guards (:mod:`kvgate.semantic.guards`) against each candidate at or above the
threshold, best first, and that the candidate still exists in Redis.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from . import guards
from .embed import Embedder
from .index import make_index
from .static import StaticAnswers, StaticAnswersError, load_static, normalize
from .store import Store, split_key

log = logging.getLogger("kvgate.semantic")
CANDIDATES = 5


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SemanticCache:
    """The service's state: the embedder, the per-scope index mirrored from Redis, the static
    answers of each pool. Thread-safe (one lock around the index)."""

    def __init__(self, client: redis.Redis, *, index: str = "flat", max_entries: int = 100_000,
                 model: str = "all-MiniLM-L6-v2-int8", embedder: Embedder | None = None,
                 default_ttl_s: int = 3600, rescan_s: float = 300.0):
        self.model = model
        self.embedder = embedder or Embedder(model)
        self.origin = uuid.uuid4().hex
        self.store = Store(client, self.origin)
        self.index = make_index(index, self.embedder.dim)
        self.max_entries = max_entries
        self.default_ttl_s = default_ttl_s
        self.rescan_s = rescan_s
        self.meta: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # key -> (text, entry, expires_at)
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, key); stale items skipped
        self.lock = threading.RLock()
        self.static: dict[str, StaticAnswers] = {}
        self.static_errors: dict[str, str] = {}
        self.thresholds: dict[str, float] = {}
        self.timeouts: dict[str, float] = {}  # pool -> the gateway's lookup timeout (s)
        self._stop = threading.Event()
        self.registry = CollectorRegistry()
        self.m_lookups = Counter("kvgate_semantic_service_lookups_total", "Lookups by pool and result "
                                 "(semantic, static, miss, rejected, late)", ["pool", "result"], registry=self.registry)
        self.m_rejections = Counter("kvgate_semantic_service_guard_rejections_total",
                                    "Candidates above the threshold refused by a guard", ["pool", "guard"],
                                    registry=self.registry)
        self.m_inserts = Counter("kvgate_semantic_service_inserts_total", "Entries inserted", ["pool"],
                                 registry=self.registry)
        self.m_skipped = Counter("kvgate_semantic_service_inserts_skipped_total",
                                 "Inserts not stored (length: longer than the model's 256 tokens)", ["pool", "reason"],
                                 registry=self.registry)
        self.m_latency = Histogram("kvgate_semantic_service_lookup_seconds", "Lookup time in the service",
                                   buckets=(.002, .005, .01, .015, .02, .03, .05, .1, .25), registry=self.registry)
        self.m_entries = Gauge("kvgate_semantic_service_entries", "Entries in the in-memory index",
                               registry=self.registry)
        self.m_entries.set_function(lambda: len(self.index))

    # ------------------------------------------------------------ mirror of Redis
    def _add(self, key: str, text: str, entry: str, vec: np.ndarray, expires_at: float) -> None:
        pool, scope = split_key(key)
        with self.lock:
            self.index.add(f"{pool}\0{scope}", key, vec)
            self.meta.pop(key, None)
            self.meta[key] = (text, entry, expires_at)
            heapq.heappush(self._expiry, (expires_at, key))
            while len(self.meta) > self.max_entries:  # oldest first
                old, _ = self.meta.popitem(last=False)
                self.index.remove(old)

    def _remove(self, key: str) -> None:
        with self.lock:
            self.meta.pop(key, None)
            self.index.remove(key)

    def rebuild(self) -> int:
        """Load every live entry from Redis into the index; returns how many. Entries no longer
        in Redis are dropped."""
        seen = set()
        for e in self.store.scan():
            seen.add(e.key)
            with self.lock:
                known = self.meta.get(e.key)
                if known is not None and known[:2] == (e.text, e.entry):  # already indexed: new expiry only
                    self.meta[e.key] = (e.text, e.entry, e.expires_at)
                    heapq.heappush(self._expiry, (e.expires_at, e.key))
                    continue
            self._add(e.key, e.text, e.entry, e.vec, e.expires_at)
        with self.lock:
            gone = [k for k in self.meta if k not in seen]
        if gone:  # inserted while the scan ran, or really gone: ask Redis
            p = self.store.r.pipeline(transaction=False)
            for k in gone:
                p.exists(k)
            for k, alive in zip(gone, p.execute()):
                if not alive:
                    self._remove(k)
        return len(seen)

    def sweep(self) -> None:
        """Drop expired entries from the index (a heap by expiry: the cost is the entries expired)."""
        now = time.time()
        with self.lock:
            while self._expiry and self._expiry[0][0] <= now:
                exp, key = heapq.heappop(self._expiry)
                m = self.meta.get(key)
                if m is not None and m[2] <= now:
                    self._remove(key)
            if len(self._expiry) > 2 * len(self.meta) + 1000:  # replaced/removed entries' leftovers
                self._expiry = [(m[2], k) for k, m in self.meta.items()]
                heapq.heapify(self._expiry)

    def follow(self, rebuilt: bool = False) -> None:
        """Apply the other services' inserts and removals (pub/sub), sweep, rescan; until :meth:`stop`.
        ``rebuilt``: the index was just rebuilt (no scan at the first subscription)."""
        last_scan = time.monotonic()
        while not self._stop.is_set():
            try:
                ps = self.store.r.pubsub(ignore_subscribe_messages=True)
                ps.subscribe("kvgate:sem:events")
                if not rebuilt:
                    self.rebuild()  # what was missed while not subscribed
                rebuilt = False
                while not self._stop.is_set():
                    msg = ps.get_message(timeout=1.0)
                    if msg:
                        self._event(msg["data"])
                    self.sweep()
                    if time.monotonic() - last_scan > self.rescan_s:
                        self.rebuild()
                        last_scan = time.monotonic()
                ps.close()
            except redis.RedisError as exc:
                log.warning("semantic: Redis: %s; retrying in 1 s", exc)
                self._stop.wait(1.0)
            except Exception:  # never let the follower die: the index would go stale silently
                log.exception("semantic: following Redis failed; retrying in 1 s")
                self._stop.wait(1.0)

    def _event(self, data: bytes) -> None:
        try:
            ev = json.loads(data)
        except ValueError:
            return
        if ev.get("origin") == self.origin:
            return
        key = ev.get("key", "")
        if ev.get("op") == "del":
            self._remove(key)
        elif ev.get("op") == "add":
            e = self.store.get(key)
            if e is not None:
                self._add(e.key, e.text, e.entry, e.vec, e.expires_at)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------ static answers
    def load_policy(self, policy, policy_path: Path | str = ".", base: Path | str | None = None) -> None:
        """Take the static answers files and thresholds of ``policy`` (a loaded Policy; relative
        files are relative to ``base``, default ``policy_path``'s directory): a file that fails
        validation keeps the previous version and its error is reported on /health. A pool no
        longer in the policy loses its static answers."""
        base = Path(base) if base is not None else Path(policy_path).parent
        names = {pool.name for pool in policy.pools}
        with self.lock:
            for gone in [p for p in self.static if p not in names]:
                self.static.pop(gone, None)
        for gone in [p for p in self.static_errors if p not in names]:
            self.static_errors.pop(gone, None)
        for pool in policy.pools:
            self.thresholds[pool.name] = pool.semantic.similarity_min
            self.timeouts[pool.name] = pool.semantic.timeout_ms / 1000
            name = pool.semantic.static_answers
            if not name:
                self.static.pop(pool.name, None)
                self.static_errors.pop(pool.name, None)
                continue
            path = (base / name) if not os.path.isabs(name) else Path(name)
            try:
                self.set_static(pool.name, load_static(path))
                self.static_errors.pop(pool.name, None)
            except StaticAnswersError as exc:
                self.static_errors[pool.name] = str(exc)
                log.error("semantic: %s", exc)

    def set_static(self, pool: str, answers: StaticAnswers) -> None:
        answers.vectors = self.embedder.embed(answers.questions)
        with self.lock:
            self.static[pool] = answers

    # ------------------------------------------------------------ the protocol
    def lookup(self, pool: str, scope: str, text: str, threshold: float | None = None,
               static: bool = False, semantic: bool = True, arrived: float | None = None) -> dict:
        """The protocol's /lookup (see the module doc); ``ms`` is the time spent here.
        ``arrived`` (``time.monotonic()`` when the request came in): a lookup that waited for a
        thread longer than the pool's ``timeout_ms`` is answered as a miss at once — the gateway
        has given up on it, and an overloaded service should not spend a core on it."""
        t0 = time.perf_counter()
        if arrived is not None and time.monotonic() - arrived > self.timeouts.get(pool, 0.05):
            self.m_lookups.labels(pool, "late").inc()
            return {"hit": None, "similarity": None, "entry": None, "answer": None, "rejected": None, "ms": 0.0}
        threshold = threshold if threshold is not None else self.thresholds.get(pool, 0.92)
        res = {"hit": None, "similarity": None, "entry": None, "answer": None, "rejected": None}
        vec, long_text = None, False
        sa = self.static.get(pool) if static else None
        if sa is not None:
            qi = sa.exact.get(normalize(text))
            if qi is not None:
                res.update(hit="static", similarity=1.0, answer=sa.answers[sa.qa[qi]])
            else:
                vec, long_text = self.embedder.embed_checked(text)
                sims = sa.vectors @ vec if not long_text else np.zeros(0)
                for qi in np.argsort(-sims)[:CANDIDATES]:
                    if sims[qi] < sa.similarity_min:
                        break
                    why = guards.check(text, sa.questions[qi])
                    if why:
                        res["rejected"] = res["rejected"] or why
                        self.m_rejections.labels(pool, why).inc()
                        continue
                    res.update(hit="static", similarity=round(float(sims[qi]), 4), answer=sa.answers[sa.qa[qi]])
                    break
        if res["hit"] is None and semantic:
            if vec is None:
                vec, long_text = self.embedder.embed_checked(text)
        if res["hit"] is None and long_text:
            # past the model's 256 tokens the rest of the text is not in the vector: a similarity
            # would compare beginnings only, so such a question is answered exactly or not at all
            res["rejected"] = "length"
            self.m_rejections.labels(pool, "length").inc()
        elif res["hit"] is None and semantic:
            with self.lock:
                cands = self.index.search(f"{pool}\0{scope}", vec, CANDIDATES)
                cands = [(k, s, self.meta.get(k)) for k, s in cands]
            now = time.time()
            for key, sim, meta in cands:
                if sim < threshold or meta is None:
                    break
                ctext, centry, exp = meta
                if exp <= now:
                    self._remove(key)
                    continue
                why = guards.check(text, ctext)
                if why:
                    res["rejected"] = res["rejected"] or why
                    self.m_rejections.labels(pool, why).inc()
                    continue
                if not self.store.exists(key):  # removed elsewhere, message not seen yet
                    self._remove(key)
                    continue
                res.update(hit="semantic", similarity=round(min(sim, 1.0), 4), entry=centry, rejected=None)
                break
        if res["hit"]:
            res["rejected"] = None
        dt = time.perf_counter() - t0
        self.m_latency.observe(dt)
        self.m_lookups.labels(pool, res["hit"] or ("rejected" if res["rejected"] else "miss")).inc()
        res["ms"] = round(dt * 1000, 3)
        return res

    def insert(self, pool: str, scope: str, text: str, entry: str, ttl_s: int | None = None,
               tags: list[str] | None = None, vec: np.ndarray | None = None) -> str | None:
        """The protocol's /insert: embed, write to Redis with the TTL, add to the index. Returns the
        key, or None for a text longer than the model reads (256 tokens), which is not stored."""
        ttl = int(ttl_s or self.default_ttl_s)
        if vec is None:
            vec, long_text = self.embedder.embed_checked(text)
            if long_text:  # never found by similarity (see lookup): not stored
                self.m_skipped.labels(pool, "length").inc()
                return None
        key = self.store.put(pool, scope, text, entry, vec, ttl, list(tags or []), self.model)
        self._add(key, text, entry, vec, time.time() + ttl)
        self.m_inserts.labels(pool).inc()
        return key

    def invalidate(self, pool: str | None = None, tag: str | None = None) -> int:
        """The protocol's /invalidate: remove the entries with ``tag`` (of ``pool`` when given),
        or every entry of ``pool``. Returns how many entries were removed."""
        if tag:
            keys = self.store.keys_with_tag(tag)
            if pool:
                keys = [k for k in keys if split_key(k)[0] == pool]
            n = self.store.delete(keys)
            self.store.drop_tag(tag, None if not pool else keys)
        elif pool:
            keys = [e.key for e in self.store.scan(pool)]
            n = self.store.delete(keys)
        else:
            raise BadRequest("give `pool` or `tag` (or both)", "pool")
        for k in keys:
            self._remove(k)
        return n

    def health(self) -> dict:
        try:
            redis_ok = bool(self.store.r.ping())
        except redis.RedisError:
            redis_ok = False
        return {"status": "ok" if redis_ok else "degraded", "redis": redis_ok, "model": self.model,
                "index": self.index.kind, "entries": len(self.index),
                "static": {p: len(s.questions) for p, s in self.static.items()},
                "static_errors": self.static_errors}


# ---------------------------------------------------------------- HTTP
def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


def _field(body: dict, name: str, kind, required: bool = True, default=None):
    v = body.get(name, default)
    if v is None:
        if required:
            raise BadRequest(f"`{name}` is required", name)
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"`{name}` must be {kind.__name__}", name)
    return v


def make_app(cache: SemanticCache, workers: int = 4) -> web.Application:
    """The aiohttp application serving ``cache``'s protocol; the work runs in a thread pool."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="semantic")

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def body_of(request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc), exc.param)
        except redis.RedisError as exc:
            log.warning("semantic: Redis: %s", exc)
            return _error(503, "the semantic cache's Redis is unavailable", code="redis_unavailable")

    async def lookup(request):
        arrived = time.monotonic()
        b = await body_of(request)
        thr = _field(b, "threshold", float, required=False)
        if thr is not None and not 0.5 <= thr <= 1.0:
            raise BadRequest("`threshold` is a cosine similarity in [0.5, 1.0]", "threshold")
        args = (_field(b, "pool", str), _field(b, "scope", str), _field(b, "text", str), thr,
                _field(b, "static", bool, False, False), _field(b, "semantic", bool, False, True), arrived)
        return web.json_response(await run(cache.lookup, *args))

    async def insert(request):
        b = await body_of(request)
        ttl = _field(b, "ttl_s", int, required=False)
        if ttl is not None and ttl < 1:
            raise BadRequest("`ttl_s` must be at least 1", "ttl_s")
        tags = _field(b, "tags", list, False, [])
        if not all(isinstance(t, str) and t for t in tags):
            raise BadRequest("`tags` must be a list of non-empty strings", "tags")
        await run(cache.insert, _field(b, "pool", str), _field(b, "scope", str), _field(b, "text", str),
                  _field(b, "entry", str), ttl, tags)
        return web.Response(status=204)

    async def invalidate(request):
        b = await body_of(request)
        n = await run(cache.invalidate, _field(b, "pool", str, False), _field(b, "tag", str, False))
        return web.json_response({"removed": n})

    async def health(request):
        return web.json_response(await run(cache.health))

    async def metrics(request):
        return web.Response(body=generate_latest(cache.registry), content_type="text/plain", charset="utf-8")

    app = web.Application(middlewares=[errors], client_max_size=1 << 20)
    app.add_routes([web.post("/lookup", lookup), web.post("/insert", insert), web.post("/invalidate", invalidate),
                    web.get("/health", health), web.get("/metrics", metrics)])
    app.on_cleanup.append(lambda _app: asyncio.get_running_loop().run_in_executor(None, pool.shutdown))
    return app


def serve(cache: SemanticCache, listen: str, policy_path: Path | None = None, workers: int = 4) -> None:
    """Rebuild the index from Redis, follow changes, reload the policy's static answers when the
    policy or a static file changes, and serve on ``listen`` (``unix:/path`` or ``HOST:PORT``,
    loopback only) until SIGTERM/SIGINT."""
    n = cache.rebuild()
    log.info("semantic: %d entries from Redis", n)
    # the follower scans once more after it subscribed (in the background, serving meanwhile): an
    # insert announced between the rebuild above and the subscription is not missed
    threading.Thread(target=cache.follow, name="semantic-follow", daemon=True).start()
    if policy_path is not None:
        try:  # before the first request
            state = current_policy(cache, policy_path)
        except Exception as exc:  # noqa: BLE001 - a version it cannot read: the file, and the watch retries
            log.warning("semantic: the applied policy version: %s; reading %s", exc, policy_path)
            state = _file_policy(policy_path)
        policy, base, origin = state
        cache.load_policy(policy, base=base)
        seen = (origin, str(base), _stamp(policy, base))
        threading.Thread(target=_watch_policy, args=(cache, policy_path, seen, state), name="semantic-policy",
                         daemon=True).start()
    app = make_app(cache, workers)
    try:
        asyncio.run(_serve(app, listen))
    finally:
        cache.stop()


async def _serve(app: web.Application, listen: str) -> None:
    import signal

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if listen.startswith("unix:"):
        path = listen[5:]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a previous run
        site = web.UnixSite(runner, path)
        await site.start()
        os.chmod(path, 0o666)  # nginx workers run as another user (the run dir still gates access)
    else:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"semantic_service.listen {listen!r}: loopback addresses only")
        site = web.TCPSite(runner, host, int(port))
        await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if listen.startswith("unix:"):
        try:
            os.unlink(listen[5:])
        except OSError:
            pass


def _read_policy(policy_path: Path):
    """The policy without the loader's static-answers check: a bad FAQ file is reported per pool
    on /health (and the previous version kept), not a reason to stop following the policy."""
    from kvgate.policy.loader import parse_policy_text

    return parse_policy_text(policy_path.read_text(encoding="utf-8"), str(policy_path))


def _file_policy(policy_path: Path) -> tuple[object, Path, str]:
    """The ``--policy`` file, its folder, and its origin (path, mtime and size: an edit is a new one)."""
    st = policy_path.stat()
    return _read_policy(policy_path), policy_path.parent, f"file {policy_path} {st.st_mtime_ns} {st.st_size}"


def current_policy(cache: SemanticCache, policy_path: Path,
                   last: tuple[object, Path, str] | None = None) -> tuple[object, Path, str]:
    """The policy this service follows, the folder of its relative files, and what it was read
    from: the control plane's latest applied version in Redis when there is one (what
    ``kvgate apply`` / the admin page applied, with the folder of the file applied,
    ``files_base``), else the ``--policy`` file (a service without a control plane). ``last``: the
    previous answer, returned as is when its version is still the newest (no parse every 2 s:
    a policy of 1,000 nodes takes ~70 ms to validate)."""
    from kvgate.policy.loader import parse_policy_text

    from ..control.store import VERSIONS_KEY

    try:
        raw = cache.store.r.lindex(VERSIONS_KEY, -1)
    except redis.RedisError as exc:
        raise RuntimeError(f"reading the applied policy version: {exc}") from None
    if not raw:
        if last is not None and last[2].startswith("file "):
            st = policy_path.stat()
            if last[2] == f"file {policy_path} {st.st_mtime_ns} {st.st_size}":
                return last
        return _file_policy(policy_path)
    v = json.loads(raw)
    origin = f"version {v.get('version')} {v.get('digest')}"
    if last is not None and last[2] == origin:
        return last
    base = Path(v["files_base"]) if isinstance(v.get("files_base"), str) else policy_path.parent
    return parse_policy_text(v["yaml"], f"policy version {v.get('version')}"), base, origin


def _stamp(policy, base: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of each static answers file (a changed file is reloaded)."""
    out = {}
    for p in policy.pools:
        name = p.semantic.static_answers
        if name:
            f = Path(name) if os.path.isabs(name) else base / name
            try:
                st = f.stat()
                out[str(f)] = (st.st_mtime_ns, st.st_size)
            except OSError:
                out[str(f)] = (0, -1)
    return out


def _watch_policy(cache: SemanticCache, policy_path: Path, seen: tuple | None = None,
                  state: tuple[object, Path, str] | None = None) -> None:
    """Every 2 s: reload the static answers when the policy in force changed (a new version
    applied, or the ``--policy`` file when no control plane records versions) or one of its
    files did. ``seen``, ``state``: what :func:`serve` loaded first."""
    while not cache._stop.wait(2.0):
        try:
            state = current_policy(cache, policy_path, state)
            policy, base, origin = state
            stamp = (origin, str(base), _stamp(policy, base))
            if stamp != seen:
                cache.load_policy(policy, base=base)
                log.info("semantic: static answers reloaded (%s, files in %s)", origin, base)
                seen = stamp
        except Exception as exc:  # a policy being edited, Redis away: keep what is loaded
            log.warning("semantic: policy %s: %s", policy_path, exc)

