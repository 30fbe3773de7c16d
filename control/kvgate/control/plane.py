"""The control plane's orchestrator: gather inputs → run the fleet's steps → apply their changes.

The decisions are pure steps over typed records (:mod:`kvgate.fleet`: health, drain, ramp,
overload, weights); :class:`ControlPlane` does the I/O around them. Each reconciler round
(:meth:`ControlPlane.tick`, every ``control.tick_s``) reads the gateway's ``/metrics``, the
engines' ``/health`` (every ``health.probe_interval_s``) and the agents' reports
(:mod:`kvgate.control.probes`), runs the steps, applies their changes (records to memory and
Redis, events, metrics, warm-ups) and sends the runtime to the gateway
(:mod:`kvgate.control.push`: pushed without a reload, or reloaded through the confirmed
transaction). Policy versions: :mod:`kvgate.control.versions`.

Locks: :attr:`ControlPlane.lock` serialises operator actions and policy applies (a caller may
hold it around a check and an apply); an inner lock (:meth:`ControlPlane.changing`) guards the
records and the gateway apply, never while engines, reports or the gateway's ``/metrics`` are
read. Views read :attr:`ControlPlane.snapshot`, published after every change, and do their I/O
(the reports) without any lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import requests

from ..addr import connect_address  # noqa: F401 - moved to kvgate.addr; re-exported for old imports
from ..fleet import states as st
from ..fleet.changes import Change, Save, event, transition
from ..fleet.drain import DrainInputs, drain_step, new_drain
from ..fleet.events import EventKind
from ..fleet.health import (HealthInputs, PassiveWindows, StoreWatch, engine_start_changes, health_step,
                            start_warming, store_back_event)
from ..fleet.overload import overload_step
from ..fleet.ramp import Counts, ramp_step
from ..fleet.records import NodeRecord, PoolState, others_serving
from ..fleet.runtime import runtime_for
from ..fleet.weights import serving_weights, weights_step
from ..nginxctl import Nginx
from ..policy.model import Policy
from ..render import Runtime
from . import effects, probes, versions, views
from .exceptions import ApplyError, Conflict, NodeHasWork, NotFound, StaleVersion
from .metrics import ControlMetrics
from .push import RuntimePush
from .store import Store, StoreError
from .views import Snapshot
from .warmups import Warmups

__all__ = ["ApplyError", "Conflict", "ControlMetrics", "ControlPlane", "NodeHasWork", "NotFound", "Snapshot",
           "StaleVersion", "connect_address", "runtime_for"]

log = logging.getLogger("kvgate.control")


class ControlPlane:
    """Node registry, reconciler and operator actions over one gateway.

    Args:
        store: Redis state.
        nginx: the gateway's nginx prefix.
        run_dir: where the running policy copy (``policy.yaml``) is kept for ``kvgate up``.
        external_gateway: never start nginx (another process, e.g. the compose ``gateway``
            service, runs it): write the config and reload a running master only.
        history: the admin page's 15-minute series (fed with every report and scrape); a new
            :class:`kvgate.web.admin.history.History` by default.
    """

    def __init__(self, store: Store, nginx: Nginx, run_dir: Path | None = None, external_gateway: bool = False,
                 history: Any = None):
        if history is None:
            from ..web.admin.history import History

            history = History()
        self.store, self.nginx, self.history = store, nginx, history
        self.run_dir = Path(run_dir) if run_dir else None
        self.external_gateway = external_gateway
        self.metrics = ControlMetrics()
        self.lock = threading.RLock()
        self._state = threading.RLock()
        self.policy: Policy | None = None
        self.policy_version: dict[str, Any] | None = None
        self.policy_text: str | None = None
        self.files_base: str | None = None
        """The folder the running policy's relative file names (``static_answers``) are read from:
        the folder of the policy file applied (``kvgate apply FILE``, ``kvgate up FILE``,
        ``kvgate control --policy FILE``); an edit without a file (the admin page) keeps it."""
        self.nodes: dict[str, NodeRecord] = {}
        self.pools: dict[str, PoolState] = {}
        self._snap = Snapshot()
        self.namespace_floor = 0
        """The highest response-cache namespace version ever in force (kept in Redis): the
        version in force never goes below it (see :attr:`namespace_in_force`)."""
        self.knowledge_floor: dict[str, int] = {}
        """pool → the highest semantic knowledge_version ever in force (kept in Redis,
        :mod:`kvgate.control.semcache`)."""
        self.passive = PassiveWindows()
        self.http = requests.Session()
        self.push = RuntimePush(nginx, self.metrics, self.event, start=not external_gateway)
        self._gateway: dict[str, Any] = probes.empty_gateway()
        self._probe_due = 0.0
        self._store_watch = StoreWatch()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.warmups = Warmups(self)
        from .tlswatch import TlsWatch

        self.tls_watch = TlsWatch(self)  # renewed TLS files: reloaded from the tick (docs/tls.md)
        self.usage: Any = None
        """The usage rollups' consumer (:class:`kvgate.costs.rollup.UsageConsumer`), from :meth:`start`."""
        self._batch_api: Any = None
        from .gateways import GatewayRegistry

        self.gateways = GatewayRegistry(self)
        """The gateway tier's members: statuses, lost/in-sync, the apply's wait (:mod:`kvgate.control.gateways`)."""

    # ================================================================ lifecycle
    def start(self, policy_text: str | None, source: str, files_base: str | None = None) -> None:
        """Load state from Redis, make a policy current (``policy_text``: the ``--policy`` file,
        see :func:`kvgate.control.versions.load`), resume warm-ups and start the reconciler.
        Raises PolicyError, StoreError, ApplyError, ValueError (no policy anywhere)."""
        with self.lock, self.changing():
            versions.load(self, policy_text, source, files_base)
            # warm-ups do not survive a restart: a node that was warming starts its warm-up
            # again (a manual one on another state is just marked interrupted)
            for rec in list(self.nodes.values()):
                if rec.state == st.WARMING:
                    self.warmups.launch(rec.id)
                elif rec.warmup and rec.warmup.status == "running":
                    self.apply([Save(rec.evolve(warmup=dataclasses.replace(rec.warmup, status="interrupted")))])
        self._store_watch.started_at = time.time()  # agents' missing reports count from here
        self._store_watch.instance = self.store.try_instance()
        self._thread = threading.Thread(target=self._loop, name="kvgate-reconciler", daemon=True)
        self._thread.start()
        self.gateways.start()
        from ..costs.rollup import UsageConsumer

        # the usage rollups (issue 13): its own thread and Redis connection, reading the snapshot
        self.usage = UsageConsumer(self.store.url, self._usage_state)
        self.usage.start()

    def _usage_state(self) -> tuple[Policy | None, dict[str, int]]:
        """The policy and serving nodes per pool, for the usage consumer's round-robin baseline (no lock)."""
        snap = self.snapshot
        serving: dict[str, int] = {}
        for rec in snap.nodes.values():
            serving[rec.pool] = serving.get(rec.pool, 0) + (1 if rec.serving else 0)
        return snap.policy, serving

    def stop(self) -> None:
        self.stopping.set()
        if self.usage is not None:
            self.usage.stop()
        if self._thread:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # the loop must survive anything; the error is logged and counted
                self.metrics.tick_errors.inc()
                log.exception("reconciler round failed")
            interval = self.policy.control.tick_s if self.policy else 1.0
            self.stopping.wait(max(0.05, interval - (time.monotonic() - started)))

    # ================================================================ changes
    @contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the records' lock; publish a new :attr:`snapshot` when leaving."""
        with self._state:
            try:
                yield
            finally:
                self._snap = Snapshot(self.policy, self.policy_version, dict(self.nodes), dict(self.pools),
                                      self.applied, self._gateway)

    @property
    def snapshot(self) -> Snapshot:
        """The state after the last complete change: one reference, published when a change
        leaves :meth:`changing`, read without a lock (issue 10 item 4: views never take the
        plane's locks). A change in progress (a tick with its gateway apply: a reload transaction
        takes seconds, a push PUSH_SETTLE_S) is not seen until it is complete, so a view is never
        ahead of the gateway, and never waits for it."""
        return self._snap

    def event(self, kind: EventKind, message: str, node: str | None = None, pool: str | None = None,
              **data: Any) -> None:
        """Record an event (never raises: the store keeps what it can)."""
        keep = self.policy.control.events_kept if self.policy else 10000
        self.store.add_event(str(kind), message, node=node, pool=pool, keep=keep, **data)
        log.info("%s: %s", kind, message)

    def put_record(self, rec: NodeRecord) -> None:
        """Store a node record (a store error is logged: memory stays authoritative)."""
        try:
            self.store.put_node(rec.to_json())
        except StoreError as exc:
            log.warning("%s", exc)

    def put_records(self, recs: list[NodeRecord]) -> None:
        """Store node records in one round trip (a store error is logged: memory stays authoritative)."""
        try:
            self.store.put_nodes([rec.to_json() for rec in recs])
        except StoreError as exc:
            log.warning("%s", exc)

    def apply(self, changes: list[Change]) -> None:
        """Apply a step's changes in order (:func:`kvgate.control.effects.apply_changes`); the
        caller holds :meth:`changing`. Raises InvalidTransition for a move the machine refuses."""
        effects.apply_changes(self, changes)

    # ================================================================ Batch API
    @property
    def batch_api(self) -> Any:
        """The Batch API's services (:class:`kvgate.batch.jobs.BatchApi`), built on first use over
        this plane's Redis, its policy's ``batch:`` section and its run directory."""
        if self._batch_api is None:
            from ..batch.jobs import BatchApi

            self._batch_api = BatchApi(self.store.r, lambda: self.policy, self.run_dir)
        return self._batch_api

    @property
    def files(self) -> Any:
        """The Batch API's files (:class:`kvgate.batch.files.FileStore`)."""
        return self.batch_api.files

    @property
    def batches(self) -> Any:
        """The Batch API's batches (:class:`kvgate.batch.jobs.Batches`)."""
        return self.batch_api.batches

    # ================================================================ runtime
    @property
    def gateway_ok(self) -> bool:
        """Whether the last reconciler round could read the gateway's ``/metrics``."""
        return bool(self._gateway.get("ok"))

    @property
    def namespace_in_force(self) -> int:
        """The response cache's namespace version in force: the policy's, or the highest one ever
        in force when that is higher. A rollback or an older policy file (``namespace_version: 1``)
        must not make entries readable again that an invalidation retired: they may still be
        within their TTL."""
        assert self.policy is not None
        return max(self.policy.cache.namespace_version, self.namespace_floor)

    def serving_weights(self) -> dict[str, int]:
        """Node id → the nginx weight the node has when it serves (:func:`kvgate.fleet.weights.serving_weights`)."""
        snap = self.snapshot
        assert snap.policy is not None
        return serving_weights(snap.policy, dict(snap.applied.weights) if snap.applied else {}, snap.nodes)

    def desired_runtime(self) -> Runtime:
        """Weights (0 = down), balancer switches and the namespace version for the current states."""
        assert self.policy is not None
        return runtime_for(self.policy, self.nodes, self.pools, self.namespace_floor, self.knowledge_floor)

    def apply_runtime(self, force: bool = False) -> str:
        """Send the desired runtime to the gateway (:meth:`kvgate.control.push.RuntimePush.apply`):
        ``pushed``, ``reloaded``, ``started``, ``written``, ``unchanged`` or ``failed`` (within the
        back-off after a failure). Raises ApplyError (after recording it) when nginx refuses or fails."""
        assert self.policy is not None
        result = self.push.apply(self.policy, self.desired_runtime(), force)
        if result != "failed" and self.namespace_in_force > self.namespace_floor:
            self.namespace_floor = self.namespace_in_force
            try:
                self.store.set("cache_namespace_max", str(self.namespace_floor))
            except StoreError as exc:
                log.warning("namespace version %d in force but not recorded: %s", self.namespace_floor, exc)
        return result

    @property
    def applied(self) -> Runtime | None:
        """The runtime in force at the gateway (None before the first apply)."""
        return self.push.applied

    def try_apply(self) -> None:
        try:
            self.apply_runtime()
        except ApplyError:
            pass  # recorded; the running config keeps serving

    # ================================================================ reports
    def report(self, node_id: str, report: dict[str, Any]) -> dict[str, Any]:
        """Store an agent report. Returns ``{"interval_s": ...}`` for the agent. Raises NotFound, StoreError."""
        with self.changing():
            rec = self._rec(node_id)
            now = time.time()
            self.apply(engine_start_changes(rec, report, now))  # also while the store is down (answered 503)
            interval_s = self.policy.control.report_interval_s if self.policy else 2.0
            # the report, and the engine's queue/running/KV use where the gateway's balancers read
            # them (kvgate.node_load), in one round trip
            self.store.put_report_and_load(rec.pool, node_id, report, now, interval_s)
            self.history.add_report(node_id, now, report)
            self.metrics.reports.labels(node_id).inc()
            if not self.nodes[node_id].has_agent:
                self.apply([Save(self.nodes[node_id].evolve(has_agent=True))])
            return {"interval_s": interval_s}

    def _reports(self, node_ids: list[str] | None = None) -> dict[str, dict[str, Any]] | None:
        return self.store.try_reports(list(self.nodes) if node_ids is None else node_ids)

    def _note_store(self, readable: bool, instance: str | None, now: float) -> None:
        """Start the report grace when the store is back (readable after failing, or emptied under
        us: see :class:`~kvgate.fleet.health.StoreWatch`); an emptied store gets the node and
        pool records and the namespace floor again at once."""
        assert self.policy is not None
        back = self._store_watch.observe(readable, instance, now)
        if back:
            if back["emptied"]:
                self.store.restore([r.to_json() for r in self.nodes.values()],
                                   {n: p.to_json() for n, p in self.pools.items()}, self.namespace_floor)
            self.apply([store_back_event(back, self.policy)])
        self.metrics.report_grace.set(1 if self._store_watch.in_grace(now, self.policy) else 0)

    # ================================================================== tick
    def _take_gateway(self, snap: dict[str, Any], now: float) -> None:
        """Adopt a gateway snapshot; failover counter increases become events."""
        prev = self._gateway
        self.history.add_gateway(now, snap)
        if snap["ok"] and self.policy is not None:
            self.passive.add(now, self.nodes, snap["requests"], snap["errors"], self.policy.health.passive.window_s)
        self.apply(probes.failover_events(prev, snap))
        self._gateway = snap

    def counts(self) -> Counts:
        return Counts(self._gateway["requests"], self._gateway["errors"])

    def update_targets(self, now: float, reports: Mapping[str, dict[str, Any]] | None = None) -> None:
        """Run the weight step (reports read now unless given; None when unreadable)."""
        assert self.policy is not None
        self.apply(weights_step(self.nodes, self.pools, reports if reports is not None else self._reports(),
                                self.policy, now))

    def tick(self) -> None:
        """One reconciler round (see the module docstring).

        Network I/O (the gateway's ``/metrics``, engine probes, a draining engine's
        in-flight count, the reports) happens before the lock is taken, so API calls are not
        held up by a slow or dead engine; only the changes and the nginx apply hold it."""
        with self._state:
            if self.policy is None:
                return
            policy = self.policy
            urls = {rec.id: rec.url for rec in self.nodes.values()}
            draining = {rec.id: rec.url for rec in self.nodes.values() if rec.state == st.DRAINING}
            probe_now = time.monotonic() >= self._probe_due
            if probe_now:
                self._probe_due = time.monotonic() + policy.health.probe_interval_s
        self.metrics.ticks.inc()
        r = probes.read_round(self.http, policy.gateway.internal_listen, urls, draining,
                              policy.health.probe_timeout_s if probe_now else None, self._reports, self.store.try_instance)
        reports = r.reports or {}
        with self.changing():
            if self.policy is None:
                return
            now = time.time()
            self._take_gateway(r.gateway, now)
            self._note_store(r.reports is not None, r.instance, now)
            if r.probes is not None:
                self.apply(health_step(self.nodes, HealthInputs(r.probes, reports, r.reports is not None,
                                                                self._store_watch.in_grace(now, self.policy), self.gateway_ok,
                                                                self.passive), self.policy, now))
            # every live gateway member's requests in flight, not only this plane's own gateway's
            gateway_inflight = self.gateways.sum_inflight(self._gateway["inflight"]) if self.gateway_ok else None
            self.apply(drain_step(self.nodes, DrainInputs(gateway_inflight, r.engine_inflight), self.policy, now))
            if r.reports is not None:  # ramps, overload and weights decide on the reports: they wait for Redis
                self.apply(ramp_step(self.nodes, self.counts(), reports, self.policy, now))
                self.apply(overload_step(self.nodes, self.pools, reports, self.policy, now))
                self.update_targets(now, reports)
            self.try_apply()
            self.tls_watch.check()
            self.metrics.observe(self.nodes.values(), reports, now)

    # =============================================================== actions
    def _rec(self, node_id: str) -> NodeRecord:
        rec = self.nodes.get(node_id)
        if rec is None:
            raise NotFound(f"no node {node_id!r} in the policy")
        return rec

    def drain(self, node_id: str, reason: str = "operator", force: bool = False) -> dict[str, Any]:
        """Stop new keys reaching the node (weight 0: only its keys move to their next nodes on
        the ring) and wait for its in-flight requests in the background.

        Draining a draining or drained node changes nothing (idempotent). The gateway runtime is
        applied before this returns. Raises NotFound, InvalidTransition, Conflict (the last
        serving node of its pool, unless ``force``), ApplyError (the node is left as it was)."""
        with self.lock, self.changing():
            rec = self._rec(node_id)
            assert self.policy is not None
            if rec.state not in (st.DRAINING, st.DRAINED):
                if rec.serving and not force and not others_serving(self.nodes, rec):
                    raise Conflict(f"{node_id} is the last serving node of pool {rec.pool!r}: draining it leaves "
                                   "the pool without a node and every request to it fails (502); force it (kvgate "
                                   "drain --force, or force=true in the API) to do it anyway")
                now = time.time()
                self.apply([transition(rec, st.DRAINING, f"drain requested by {reason}", now, action="drain",
                                       drain=new_drain(now, self.policy), ramp=None)])
                try:
                    self.apply_runtime(force=True)
                except ApplyError as exc:
                    self.apply([Save(rec), event(EventKind.DRAIN_FAILED, f"{node_id}: drain not applied, back to "
                                                 f"{rec.state}: {str(exc).splitlines()[0]}", node=node_id,
                                                 pool=rec.pool)])
                    raise
        return self.node_view(node_id)

    def undrain(self, node_id: str, reason: str = "operator") -> dict[str, Any]:
        """Bring a draining or drained node back: warming, then ramping. Raises NotFound, InvalidTransition."""
        with self.lock, self.changing():
            rec = self._rec(node_id)
            st.check(node_id, rec.state, st.WARMING, action="undrain")
            self.apply(start_warming(rec.evolve(drain=None), f"undrain requested by {reason}", time.time()))
        return self.node_view(node_id)

    def warm(self, node_id: str, reason: str | None = None) -> dict[str, Any]:
        """Run the warm-up on the node now, without changing its state (e.g. a drained node before
        undrain). Raises NotFound; Conflict (409) when a warm-up already runs."""
        with self.lock, self.changing():
            self._rec(node_id)
            if self.warmups.running(node_id):
                raise Conflict(f"a warm-up of {node_id} is already running; wait for it (`kvgate warm {node_id}` "
                               "waits) or follow it with `kvgate nodes`")
            self.warmups.launch(node_id, reason)
        return self.node_view(node_id)

    # ================================================================ policy
    def validate(self, text: str, files_base: str | None = None) -> Policy:
        """See :func:`kvgate.control.versions.validate`. Raises PolicyError, ApplyError."""
        return versions.validate(self, text, files_base)

    def apply_policy(self, text: str, source: str, force: bool = False,
                     base_version: int | None = None, files_base: str | None = None) -> dict[str, Any]:
        """Validate and apply a policy as one transaction (:func:`kvgate.control.versions.apply_policy`):
        ``{"version", "result", "changed"}``. Raises StaleVersion, PolicyError, NodeHasWork, ApplyError,
        StoreError.

        With several gateway members (``gateways:``) the answer also has ``"gateways"``: the wait for
        every live member to run the new version, up to ``control.gateway_sync_timeout_s``
        (:meth:`kvgate.control.gateways.GatewayRegistry.wait_version`: ``complete``, ``laggards``,
        ``lost``), taken after the plane's locks are released."""
        return self._with_gateways(versions.apply_policy(self, text, source, force, base_version, files_base))

    def _with_gateways(self, result: dict[str, Any]) -> dict[str, Any]:
        """``result`` with the gateway members' wait (policies with one member: unchanged)."""
        policy = self.snapshot.policy
        if policy is None or len(policy.gateway_members()) < 2:
            return result
        return {**result, "gateways": self.gateways.wait_version(result.get("version"),
                                                                 policy.control.gateway_sync_timeout_s)}

    def invalidate_cache(self, source: str) -> dict[str, Any]:
        """Retire every cached response (:func:`kvgate.control.versions.invalidate_cache`):
        ``{"old", "new", "version", "result"}``. Raises PolicyError, ApplyError, StoreError, ValueError."""
        return versions.invalidate_cache(self, source)

    def bump_knowledge(self, pool: str, source: str) -> dict[str, Any]:
        """Retire a pool's semantic entries: its knowledge_version + 1, pushed as runtime
        (:func:`kvgate.control.semcache.bump_knowledge`): ``{"pool", "old", "new", "result"}``."""
        from . import semcache

        return semcache.bump_knowledge(self, pool, source)

    def invalidate_tag(self, tag: str, source: str) -> dict[str, Any]:
        """Remove the cache entries tagged ``tag``, exact and semantic
        (:func:`kvgate.control.semcache.invalidate_tag`)."""
        from . import semcache

        return semcache.invalidate_tag(self, tag, source)

    def rollback(self, version: int, by: str | None = None, force: bool = False) -> dict[str, Any]:
        """Apply a stored version again, as a new version (:func:`kvgate.control.versions.rollback`).
        Raises NotFound, PolicyError, NodeHasWork, ApplyError, StoreError. Waits for the gateway
        members as :meth:`apply_policy` does."""
        return self._with_gateways(versions.rollback(self, version, by, force))

    # ================================================================= views
    def node_view(self, node_id: str, reports: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """One node as the API shows it (:func:`kvgate.control.views.node_view`; its report read
        now unless given). Reads the snapshot, takes no lock. Raises NotFound."""
        snap = self.snapshot
        if node_id not in snap.nodes:
            raise NotFound(f"no node {node_id!r} in the policy")
        entry = (reports if reports is not None else (self._reports([node_id]) or {})).get(node_id)
        return views.node_view(snap, node_id, entry, time.time())

    def nodes_view(self) -> list[dict[str, Any]]:
        """Every node of the policy, in its order (one read of the reports)."""
        snap = self.snapshot
        assert snap.policy is not None
        ids = [n.id for n in snap.policy.nodes() if n.id in snap.nodes]
        reports = self._reports(ids) or {}
        return [views.node_view(snap, i, reports.get(i), time.time()) for i in ids]

    def pools_view(self) -> list[dict[str, Any]]:
        """Every pool with its balancer in force, overload state, nodes and failover count."""
        return views.pools_view(self.snapshot)
