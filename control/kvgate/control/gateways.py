"""The gateway tier's members as the control plane sees them (issue 17 item 1, docs/scale-out.md).

A policy's ``gateways:`` lists the nginx instances sharing it (:meth:`Policy.gateway_members`;
none listed: one member, ``local``). The first is the control plane's own: it drives that nginx
directly (:mod:`kvgate.control.push`), so that member's status is the plane's own push result and
the last gateway scrape of its reconciler. Every other member runs ``kvgate gateway``
(:mod:`kvgate.gateway.supervisor`) on its host, which

* asks ``GET /api/v1/gateways/<id>/config`` for what it must run (:meth:`GatewayRegistry.config`:
  the current policy version's text and the runtime in force, with a tag; ``?known=<tag>`` makes
  it a long poll that answers as soon as the tag changes, or after ``control.gateway_sync_s``),
* applies it to its own nginx through the confirmed transaction, and
* reports ``POST /api/v1/gateways/<id>/status`` (:meth:`GatewayRegistry.report`).

Statuses are kept in Redis (``kvgate:control:gateways``, a hash member id → JSON), so a restarted
control plane knows the members and when each was last seen. A member whose last status is older
than :data:`LOST_AFTER` sync intervals is ``lost`` (event ``gateway_lost``; back: ``gateway_back``;
``kvgate_control_gateway_up{gateway}``). ``in_sync``: it runs the current policy version and the
runtime in force. An apply waits for every live member (:meth:`GatewayRegistry.wait_version`);
a lost one is not waited for, and catches up when it comes back (its supervisor starts nginx
only with the current version).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from ..fleet.events import EventKind
from ..render import Runtime, runtime_document, runtime_json
from .exceptions import NotFound
from .store import PREFIX, StoreError

if TYPE_CHECKING:
    from .plane import ControlPlane

log = logging.getLogger("kvgate.control")

KEY = PREFIX + "gateways"
"""Redis hash: member id → its last status (JSON, with ``received_at``)."""
LOST_AFTER = 3
"""A member silent for this many sync intervals (``control.gateway_sync_s``) is lost."""
STATUS_FIELDS = {"version": (int, type(None)), "runtime_digest": (str, type(None)), "static_digest": (str, type(None)),
                 "nginx_pid": (int, type(None)), "healthy": (bool,), "result": (str, type(None)),
                 "error": (str, type(None)), "inflight": (dict, type(None)), "listen": (str, type(None)),
                 "applied_at": (float, int, type(None)), "apply_s": (float, int, type(None))}
"""What a supervisor may report (anything else is dropped; a wrong type is a 400)."""
WAIT_POLL_S = 0.05


def runtime_fields(runtime: Runtime | None) -> dict[str, Any]:
    """A :class:`~kvgate.render.Runtime` as JSON (None: the policy as written, ``{}``)."""
    if runtime is None:
        return {}
    return {"weights": dict(runtime.weights), "balancers": dict(runtime.balancers),
            "namespace_version": runtime.namespace_version, "states": dict(runtime.states),
            "home_weights": dict(runtime.home_weights), "knowledge": dict(runtime.knowledge)}


def runtime_from_fields(fields: Mapping[str, Any] | None) -> Runtime | None:
    """The inverse of :func:`runtime_fields` (``{}``/None → None). Raises ValueError on another shape."""
    if not fields:
        return None
    try:
        return Runtime(weights={str(k): int(v) for k, v in (fields.get("weights") or {}).items()},
                       balancers={str(k): str(v) for k, v in (fields.get("balancers") or {}).items()},
                       namespace_version=(None if fields.get("namespace_version") is None
                                          else int(fields["namespace_version"])),
                       states={str(k): str(v) for k, v in (fields.get("states") or {}).items()},
                       home_weights={str(k): int(v) for k, v in (fields.get("home_weights") or {}).items()},
                       knowledge={str(k): int(v) for k, v in (fields.get("knowledge") or {}).items()})
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"not a runtime: {exc}") from None


def runtime_digest(policy: Any, runtime: Runtime | None) -> str:
    """sha256 hex of the runtime document's bytes: what the gateway's ``GET /kvgate/config`` reports
    as ``digest`` once it runs it (the same for every member: the document names no listener)."""
    return hashlib.sha256(runtime_json(runtime_document(policy, runtime)).encode()).hexdigest()


class GatewayRegistry:
    """The members' last statuses, lost/in-sync, and the apply's wait. Thread-safe; never raises
    on a Redis failure (memory is authoritative, Redis the copy a restart reads).

    Args:
        plane: the control plane (its snapshot, store, metrics registry and events).
    """

    def __init__(self, plane: ControlPlane):
        self.plane = plane
        self._lock = threading.Lock()
        self._status: dict[str, dict[str, Any]] = {}
        self._lost: set[str] = set()
        self._local_seen: float | None = None
        self._started = time.time()
        """Silence counts from here at the earliest: a restarted plane gives every member 3 sync intervals."""
        self._digest_cache: tuple[Any, Any, str] | None = None
        self._thread: threading.Thread | None = None
        self.up = Gauge("kvgate_control_gateway_up", "1 while the gateway member reports (or, for the control "
                        "plane's own, answers its scrape) within 3 sync intervals.", ["gateway"],
                        registry=plane.metrics.registry)
        self.in_sync_gauge = Gauge("kvgate_control_gateway_in_sync", "1 while the gateway member runs the current "
                                   "policy version and runtime.", ["gateway"], registry=plane.metrics.registry)

    # ------------------------------------------------------------ lifecycle
    def load(self) -> None:
        """Read the stored statuses (a restarted plane knows when each member was last seen)."""
        store = self.plane.store
        try:
            raw = store._call("read gateway statuses", store.r.hgetall, KEY) or {}
        except StoreError as exc:
            log.warning("%s", exc)
            return
        with self._lock:
            self._started = time.time()
            for member_id, text in raw.items():
                try:
                    self._status[member_id] = json.loads(text)
                except ValueError:
                    continue

    def start(self) -> None:
        """Load the stored statuses and start the checker (lost transitions, gauges) every sync interval."""
        self.load()
        self._thread = threading.Thread(target=self._loop, name="kvgate-gateways", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self.plane.stopping.is_set():
            try:
                self.check()
            except Exception:  # the checker must survive anything; logged
                log.exception("gateway check failed")
            self.plane.stopping.wait(min(self.sync_s() / 2, 1.0))

    # ------------------------------------------------------------ settings
    def sync_s(self) -> float:
        policy = self.plane.snapshot.policy
        return policy.control.gateway_sync_s if policy is not None else 1.0

    def _lost_after(self) -> float:
        return LOST_AFTER * self.sync_s()

    def _members(self) -> list[Any]:
        policy = self.plane.snapshot.policy
        return policy.gateway_members() if policy is not None else []

    # ------------------------------------------------------------ config
    def current_digest(self, snap: Any = None) -> str | None:
        """The runtime digest every member must run now, or as of ``snap`` (a plane snapshot; None
        before a policy)."""
        snap = snap if snap is not None else self.plane.snapshot
        if snap.policy is None:
            return None
        cached = self._digest_cache
        if cached is not None and cached[0] is snap.policy and cached[1] is snap.applied:
            return cached[2]
        digest = runtime_digest(snap.policy, snap.applied)
        self._digest_cache = (snap.policy, snap.applied, digest)
        return digest

    def config(self, member_id: str, snap: Any = None) -> dict[str, Any]:
        """What member ``member_id`` must run: ``{"id", "version", "tag", "policy" (YAML text),
        "files_base", "runtime" (:func:`runtime_fields`), "runtime_digest", "listen",
        "internal_listen", "members", "sync_s", "first"}``. ``tag``: changes whenever the version or
        the runtime does. Raises NotFound (no such member, or no policy yet)."""
        snap = snap if snap is not None else self.plane.snapshot
        if snap.policy is None or snap.policy_version is None:
            raise NotFound("no policy is applied yet")
        members = snap.policy.gateway_members()
        member = next((m for m in members if m.id == member_id), None)
        if member is None:
            raise NotFound(f"no gateway {member_id!r} in the policy's gateways: "
                           f"{', '.join(m.id for m in members)}")
        version = snap.policy_version.get("version")
        digest = self.current_digest(snap)  # the same snapshot as the runtime below: tag and body agree
        return {"id": member.id, "version": version, "tag": f"{version}:{digest}",
                "policy": snap.policy_version.get("yaml"), "files_base": snap.policy_version.get("files_base"),
                "runtime": runtime_fields(snap.applied), "runtime_digest": digest,
                "listen": member.listen, "internal_listen": member.internal_listen,
                "members": [m.id for m in members], "first": member.id == members[0].id,
                "sync_s": snap.policy.control.gateway_sync_s}

    def wait_config(self, member_id: str, known: str | None, timeout_s: float) -> dict[str, Any]:
        """:meth:`config`, once its ``tag`` differs from ``known`` or after ``timeout_s`` (a long
        poll: a change reaches a supervisor within :data:`WAIT_POLL_S`, not a sync interval)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            snap = self.plane.snapshot
            # the tag of this snapshot (the digest is cached per snapshot); the body only on return
            tag = (f"{snap.policy_version.get('version')}:{self.current_digest(snap)}"
                   if snap.policy is not None and snap.policy_version is not None else None)
            if (not known or tag != known or time.monotonic() >= deadline or self.plane.stopping.is_set()):
                return self.config(member_id, snap)
            time.sleep(WAIT_POLL_S)

    # ------------------------------------------------------------ status
    def report(self, member_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Record a supervisor's status. Returns ``{"sync_s", "in_sync"}``. Raises NotFound (not a
        member of the policy; the first is the plane's own), ValueError (a field of the wrong type)."""
        members = self._members()
        if not members or member_id not in {m.id for m in members}:
            raise NotFound(f"no gateway {member_id!r} in the policy")
        if member_id == members[0].id:
            raise NotFound(f"gateway {member_id!r} is the control plane's own: it reports nothing")
        status: dict[str, Any] = {}
        for name, types in STATUS_FIELDS.items():
            if name in body:
                if not isinstance(body[name], types) or isinstance(body[name], bool) and bool not in types:
                    raise ValueError(f"status field {name!r} has the wrong type")
                status[name] = body[name]
        if isinstance(status.get("inflight"), dict):
            status["inflight"] = {str(k): float(v) for k, v in list(status["inflight"].items())[:10000]
                                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        status["received_at"] = time.time()
        with self._lock:
            self._status[member_id] = status
            back = member_id in self._lost
            self._lost.discard(member_id)
        store = self.plane.store
        try:
            store._call("record a gateway status", store.r.hset, KEY, member_id, json.dumps(status))
        except StoreError as exc:
            log.warning("%s", exc)
        if back:
            self.plane.event(EventKind.GATEWAY_BACK, f"gateway {member_id} reports again (policy version "
                             f"{status.get('version')})", gateway=member_id, version=status.get("version"))
        self.up.labels(member_id).set(1)
        return {"sync_s": self.sync_s(), "in_sync": self._in_sync(status)}

    def _in_sync(self, status: Mapping[str, Any]) -> bool:
        version = (self.plane.snapshot.policy_version or {}).get("version")
        return (status.get("version") == version and status.get("runtime_digest") == self.current_digest()
                and bool(status.get("healthy")))

    def check(self) -> None:
        """Lost transitions (events), the gauges, and statuses of members no longer in the policy dropped."""
        snap = self.plane.snapshot
        members = self._members()
        if not members:
            return
        now = time.time()
        if snap.gateway.get("ok"):
            self._local_seen = now
        wanted = {m.id for m in members}
        newly_lost: list[tuple[str, float]] = []
        with self._lock:
            for member_id in [m for m in self._status if m not in wanted]:
                self._status.pop(member_id)
                self._lost.discard(member_id)
                try:
                    self.plane.store._call("drop a gateway status", self.plane.store.r.hdel, KEY, member_id)
                except StoreError as exc:
                    log.warning("%s", exc)
            for m in members[1:]:
                s = self._status.get(m.id)
                if s is None or m.id in self._lost:
                    continue
                age = now - float(s.get("received_at") or 0)
                if now - max(float(s.get("received_at") or 0), self._started) > self._lost_after():
                    self._lost.add(m.id)
                    newly_lost.append((m.id, age))
        for member_id, age in newly_lost:
            self.plane.event(EventKind.GATEWAY_LOST, f"gateway {member_id} lost: no status for {age:.1f}s "
                             f"({LOST_AFTER} sync intervals); applies do not wait for it", gateway=member_id,
                             age_s=round(age, 3))
        for view in self.view():
            self.up.labels(view["id"]).set(0 if view["lost"] else 1)
            self.in_sync_gauge.labels(view["id"]).set(1 if view["in_sync"] else 0)

    def sum_inflight(self, local: Mapping[str, float]) -> dict[str, float] | None:
        """Node id → requests in flight at every gateway: ``local`` (the plane's own gateway's
        ``kvgate_upstream_inflight``) plus each live member's last reported count (at most a sync
        interval old). A drain waits for these (and the engine's count) to reach 0. None (unknown:
        a drain waits) while a live member does not run the runtime in force yet: until it does it
        may still send new requests to a node being drained. A lost member is left out: what it
        still sends reaches the engine, whose own count the drain also waits for."""
        out = dict(local)
        digest = self.current_digest()
        current = {m.id for m in self._members()[1:]}
        with self._lock:
            live = [s for m, s in self._status.items() if m in current and m not in self._lost]
            if any(s.get("runtime_digest") != digest for s in live):
                return None
            reported = [s.get("inflight") for s in live]
        for counts in reported:
            for node_id, n in (counts or {}).items():
                out[node_id] = out.get(node_id, 0.0) + float(n)
        return out

    # ------------------------------------------------------------ views
    def view(self) -> list[dict[str, Any]]:
        """Every member of the policy, in its order: ``{"id", "listen", "internal_listen", "local",
        "version", "runtime_digest", "in_sync", "last_seen" (unix s or None), "age_s", "lost",
        "state" ("in sync" | "behind" | "lost" | "never seen"), "nginx_pid", "healthy", "error",
        "inflight"}``."""
        snap = self.plane.snapshot
        members = self._members()
        if not members:
            return []
        now = time.time()
        version = (snap.policy_version or {}).get("version")
        digest = self.current_digest()
        out = []
        for i, m in enumerate(members):
            if i == 0:
                ok = bool(snap.gateway.get("ok"))
                seen = now if ok else self._local_seen
                status: dict[str, Any] = {"version": version if snap.applied is not None or ok else None,
                                          "runtime_digest": digest if snap.applied is not None else None,
                                          "healthy": ok, "nginx_pid": self.plane.nginx.pid(),
                                          "inflight": dict(snap.gateway.get("inflight") or {}) if ok else None,
                                          "error": None if ok else "the control plane cannot read its /metrics"}
                lost = not ok and (seen is None or now - seen > self._lost_after())
            else:
                with self._lock:
                    status = dict(self._status.get(m.id) or {})
                    lost = m.id in self._lost or not status
                seen = status.get("received_at")
            in_sync = not lost and self._in_sync(status)
            state = ("never seen" if seen is None else "lost" if lost else "in sync" if in_sync else "behind")
            out.append({"id": m.id, "listen": m.listen, "internal_listen": m.internal_listen, "local": i == 0,
                        "version": status.get("version"), "runtime_digest": status.get("runtime_digest"),
                        "in_sync": in_sync, "last_seen": seen, "age_s": round(now - seen, 3) if seen else None,
                        "lost": lost, "state": state, "nginx_pid": status.get("nginx_pid"),
                        "healthy": status.get("healthy"), "error": status.get("error"),
                        "inflight": status.get("inflight"), "result": status.get("result")})
        return out

    def wait_version(self, version: int | None, timeout_s: float) -> dict[str, Any]:
        """Wait until every live member beyond the first runs ``version`` (the first runs it once the
        apply returned). Returns ``{"complete": bool, "waited_s", "laggards": [ids still behind],
        "lost": [ids not waited for], "members": n}``."""
        t0 = time.monotonic()
        deadline = t0 + max(0.0, timeout_s)
        while True:
            views = self.view()
            lost = [v["id"] for v in views if v["lost"]]
            laggards = [v["id"] for v in views if not v["lost"] and not v["local"] and v["version"] != version]
            if version is None or not laggards or time.monotonic() >= deadline:
                return {"complete": not laggards, "waited_s": round(time.monotonic() - t0, 3),
                        "laggards": laggards, "lost": lost, "members": len(views)}
            time.sleep(WAIT_POLL_S)
