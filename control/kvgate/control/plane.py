"""The control plane's core: node states, health, weights, drain, warm-up, ramp, overload degrade.

One :class:`ControlPlane` owns the gateway's nginx config while it runs. Every
change (an operator action, a report, a tick of the reconciler) ends in
:meth:`ControlPlane._apply_runtime`, which renders the policy with the live
:class:`~kvgate.render.Runtime` (weights, ``down`` nodes, balancer switches) and
applies it as a transaction (:meth:`kvgate.nginxctl.Nginx.apply`: render, compare,
``nginx -t`` on a staged copy, atomic swap, reload, wait for the new digest, keep the
last good config). A config that fails leaves the running one serving and becomes
an event and ``kvgate_control_reloads_total{result="failed"}``.

The reconciler (:meth:`tick`, every ``control.tick_s``) scrapes the gateway's
``/metrics`` (per-node in-flight requests, answers by status, failovers), probes
each engine's ``/health`` every ``health.probe_interval_s``, and moves nodes:
ejects failing ones, brings recovered ones back, advances ramps, finishes drains,
switches overloaded pools to ``least_conn`` and back, and follows load with damped
weights. Node records, reports, events and applied policy versions are kept in Redis
(:mod:`kvgate.control.store`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ..nginxctl import Nginx, NginxError
from ..policy import PolicyError, parse_policy_text
from ..policy.model import Policy
from ..render import WEIGHT_SCALE, Runtime
from . import states as st
from .health import PassiveWindows, StoreWatch
from .history import History
from .store import Store, StoreError
from .warmup import WarmupResult, run_warmup
from ..fleet.weights import Damper, capacities, computed_weight, load_factor, ramp_weight

log = logging.getLogger("kvgate.control")


RETRY_FAILED_APPLY_S = 5.0
"""After a failed apply, the reconciler tries the same config again only after this long
(operator actions always try at once)."""

LEAKED_COUNT_S = 10.0
"""How long a draining node's engine must be idle, with the gateway's in-flight count for it
standing still above 0, before that count is taken for a leak (see ``_drain_round``)."""


class ApplyError(RuntimeError):
    """nginx refused or failed to load a config; the running config keeps serving."""


class NotFound(KeyError):
    """No node (or version) with that id."""


class Conflict(RuntimeError):
    """The action is refused in the current situation (the API answers 409): a warm-up already
    runs, or draining would leave a pool without a serving node."""


class NodeHasWork(Conflict):
    """A policy apply would remove nodes that still have work (the API answers 409,
    ``code: node_has_work``); nothing was applied.

    ``nodes``: ``[{"id", "state", "inflight": int (the larger known count), "inflight_gateway":
    float | None, "inflight_engine": float | None}]``."""

    def __init__(self, message: str, nodes: list[dict[str, Any]]):
        super().__init__(message)
        self.nodes = nodes


def _work_text(b: dict[str, Any]) -> str:
    """``draining, 10 request(s) in flight: 10 at the gateway, 9 at the engine`` for a
    :class:`NodeHasWork` entry."""
    def num(v: float | None) -> str:
        return "?" if v is None else f"{v:.0f}"

    return (f"{b['state']}, {b['inflight']} request(s) in flight: {num(b['inflight_gateway'])} at the "
            f"gateway, {num(b['inflight_engine'])} at the engine")


from ..addr import connect_address  # noqa: E402,F401 (moved to kvgate.addr; re-exported for old imports)


def runtime_for(policy: Policy, records: dict[str, dict[str, Any]], pools: dict[str, dict[str, Any]]) -> Runtime:
    """The gateway runtime for node ``records`` and pool states (as stored in Redis).

    ``active`` nodes get their target weight, ``ramping`` ones the ramp step's share of it,
    every other state 0 (nginx ``down``); a node without a record is ``joining`` (0) unless
    there are no records at all (a fresh fleet: every node at its base weight). Pools in
    overload degrade get ``least_conn``.
    """
    weights: dict[str, int] = {}
    for node in policy.nodes():
        rec = records.get(node.id)
        if rec is None:
            weights[node.id] = 0 if records else node.weight * WEIGHT_SCALE
            continue
        target = rec.get("target_weight") or node.weight * WEIGHT_SCALE
        if rec.get("base_weight") != node.weight:
            target = node.weight * WEIGHT_SCALE
        if rec["state"] == st.ACTIVE:
            weights[node.id] = target
        elif rec["state"] == st.RAMPING:
            steps = policy.ramp.steps
            step = (rec.get("ramp") or {}).get("step", 0)
            weights[node.id] = ramp_weight(target, steps[min(step, len(steps) - 1)])
        else:
            weights[node.id] = 0
    balancers = {name: "least_conn" for name, p in pools.items() if p.get("degraded")}
    return Runtime(weights=weights, balancers=balancers)


class ControlMetrics:
    """``kvgate_control_*`` metrics on a private registry (served at the control plane's ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reloads = Counter("kvgate_control_reloads", "Gateway config applies by result "
                               "(reloaded, started, written, unchanged, failed).", ["result"], registry=r)
        self.policy_applies = Counter("kvgate_control_policy_applies", "Policy applies by result "
                                      "(applied, invalid, failed, refused: it would remove a node "
                                      "that still has work).", ["result"], registry=r)
        self.transitions = Counter("kvgate_control_node_transitions", "Node state transitions.",
                                   ["node", "from_state", "to_state"], registry=r)
        self.state = Gauge("kvgate_control_node_state", "1 for the node's current state.", ["node", "state"], registry=r)
        self.weight = Gauge("kvgate_control_node_weight", "nginx weight in force (0 = down).", ["node"], registry=r)
        self.target = Gauge("kvgate_control_node_target_weight", "Target weight: base × capacity × load, damped.",
                            ["node"], registry=r)
        self.inflight = Gauge("kvgate_control_node_inflight", "Requests in flight on the node "
                              "(max of the gateway's count and the engine's running + waiting).", ["node"], registry=r)
        self.reports = Counter("kvgate_control_reports", "Agent reports received.", ["node"], registry=r)
        self.report_age = Gauge("kvgate_control_report_age_seconds", "Age of the node's last agent report.",
                                ["node"], registry=r)
        self.health_checks = Counter("kvgate_control_health_checks", "Health checks by result (pass, fail).",
                                     ["node", "result"], registry=r)
        self.report_grace = Gauge("kvgate_control_report_grace", "1 while a missing agent report counts as "
                                  "unknown, not failed: after the control plane's start or its store's return.",
                                  registry=r)
        self.degraded = Gauge("kvgate_control_pool_degraded", "1 while overload degrade (least_conn) is in force.",
                              ["pool"], registry=r)
        self.degrade_switches = Counter("kvgate_control_degrade_switches", "Overload degrade switches "
                                        "(to=least_conn or to=<the pool's balancer>).", ["pool", "to"], registry=r)
        self.warmups = Counter("kvgate_control_warmups", "Warm-ups by result (ok, partial, failed).",
                               ["node", "result"], registry=r)
        self.warmup_ttft = Gauge("kvgate_control_warmup_ttft_seconds", "TTFT of the node's first warm-up prompt "
                                 "before and after its last warm-up.", ["node", "when"], registry=r)
        self.ticks = Counter("kvgate_control_ticks", "Reconciler rounds.", registry=r)
        self.tick_errors = Counter("kvgate_control_tick_errors", "Reconciler rounds that failed (logged).", registry=r)

    def forget_node(self, node_id: str) -> None:
        """Drop the series of a node that left the policy."""
        for metric in (self.weight, self.target, self.inflight, self.report_age):
            try:
                metric.remove(node_id)
            except KeyError:
                pass
        for state in st.STATES:
            try:
                self.state.remove(node_id, state)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ControlPlane:
    """Node registry, reconciler and operator actions over one gateway.

    Args:
        store: Redis state.
        nginx: the gateway's nginx prefix.
        run_dir: where the running policy copy (``policy.yaml``) is kept for ``kvgate up``.
        external_gateway: never start nginx (another process, e.g. the compose ``gateway``
            service, runs it): write the config and reload a running master only.
    """

    def __init__(self, store: Store, nginx: Nginx, run_dir: Path | None = None, external_gateway: bool = False):
        self.store = store
        self.nginx = nginx
        self.run_dir = Path(run_dir) if run_dir else None
        self.external_gateway = external_gateway
        self.metrics = ControlMetrics()
        self.lock = threading.RLock()
        self.policy: Policy | None = None
        self.policy_version: dict[str, Any] | None = None
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pools: dict[str, dict[str, Any]] = {}
        self.applied: Runtime | None = None
        self._failed_runtime: tuple | None = None
        self._gateway: dict[str, Any] = {"ok": False, "inflight": {}, "requests": {}, "errors": {}, "failovers": {}}
        self._probe_due = 0.0
        self._started_at = time.time()
        self._store_back_at = 0.0  # when the store last came back (see _note_store, _report_grace)
        self._store_watch = StoreWatch()
        self.passive = PassiveWindows()
        """Each node's answers and 5xx at the gateway over ``health.passive.window_s``."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warmups: dict[str, threading.Thread] = {}
        self._http = requests.Session()
        self._pending_events: list[tuple[str, str, dict[str, Any]]] = []
        self._policy_text: str | None = None
        self.namespace_floor = 0
        """The highest response-cache namespace version ever in force (kept in Redis): the
        version in force never goes below it (see :attr:`namespace_in_force`)."""
        self.history = History()
        """The last 15 minutes of each node's figures, for the admin page (memory only)."""

    # ================================================================ lifecycle
    def start(self, policy_text: str | None, source: str) -> None:
        """Load state from Redis, apply the policy and start the reconciler.

        ``policy_text`` (the ``--policy`` file) is applied when it differs from the file
        applied at the previous start; when the file is unchanged, the latest applied
        version stays (a policy applied through the API survives a restart). Without a
        file, the latest version is used.

        Raises:
            PolicyError: the policy is invalid. StoreError: Redis is unreachable.
            ApplyError: nginx refused the config. ValueError: no policy anywhere.
        """
        latest = self.store.latest_version()
        file_digest = hashlib.sha256(policy_text.encode()).hexdigest() if policy_text is not None else None
        if policy_text is None or (latest and self.store.get("startup_file_digest") == file_digest):
            if latest is None:
                raise ValueError("no policy: pass --policy (nothing was applied before in this Redis)")
            policy_text, source = latest["yaml"], f"restart (version {latest['version']})"
        with self.lock:
            self.nodes = self.store.nodes()
            self.namespace_floor = int(self.store.get("cache_namespace_max") or 0)
            if latest and latest["yaml"] == policy_text:
                policy = parse_policy_text(policy_text, f"version {latest['version']}")
                self._adopt(policy, policy_text)
                self.policy_version = latest
                self._apply_runtime(force=True)
            else:
                self.apply_policy(policy_text, source)
            if file_digest:
                self.store.set("startup_file_digest", file_digest)
            # warm-ups do not survive a restart: a node that was warming starts its warm-up
            # again (a manual one on another state is just marked interrupted)
            for rec in self.nodes.values():
                if rec["state"] == st.WARMING:
                    self._launch_warmup(rec)
                elif (rec.get("warmup") or {}).get("status") == "running":
                    rec["warmup"]["status"] = "interrupted"
                    self._save(rec)
        self._started_at = time.time()  # agents' missing reports count from here (see _report_grace)
        self._store_watch.instance = self._store_instance()
        self._thread = threading.Thread(target=self._loop, name="kvgate-reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # the loop must survive anything; the error is logged and counted
                self.metrics.tick_errors.inc()
                log.exception("reconciler round failed")
            interval = self.policy.control.tick_s if self.policy else 1.0
            self._stop.wait(max(0.05, interval - (time.monotonic() - started)))

    # ================================================================== events
    def _event(self, kind: str, message: str, node: str | None = None, pool: str | None = None, **data: Any) -> None:
        keep = self.policy.control.events_kept if self.policy else 10000
        self.store.add_event(kind, message, node=node, pool=pool, keep=keep, **data)
        log.info("%s: %s", kind, message)

    def _save(self, rec: dict[str, Any]) -> None:
        try:
            self.store.put_node(rec)
        except StoreError as exc:
            log.warning("%s", exc)

    def _transition(self, rec: dict[str, Any], to: str, reason: str, action: str | None = None) -> None:
        st.check(rec["id"], rec["state"], to, action)
        old = rec["state"]
        rec.update(state=to, since=time.time(), reason=reason)
        self.metrics.transitions.labels(rec["id"], old, to).inc()
        self._save(rec)
        self._event("state", f"{rec['id']}: {old} → {to} ({reason})", node=rec["id"], pool=rec["pool"],
                    from_state=old, to_state=to, reason=reason)

    # ================================================================== policy
    def _flush_pending_events(self, keep: bool = True) -> None:
        """Record (or, for a refused policy, drop) the node_added/node_removed events of _adopt."""
        pending, self._pending_events = self._pending_events, []
        if keep:
            for kind, message, where in pending:
                self._event(kind, message, **where)

    def _adopt(self, policy: Policy, text: str) -> None:
        """Make ``policy`` current: create records for new nodes, drop removed ones."""
        first = not self.nodes
        wanted = {n.id: n for n in policy.nodes()}
        for node_id in list(self.nodes):
            if node_id not in wanted:
                self.nodes.pop(node_id)
                self.store.delete_node(node_id)
                self.metrics.forget_node(node_id)
                self.history.forget(node_id)
                self._pending_events.append(("node_removed", f"{node_id}: removed from the policy",
                                             {"node": node_id}))
        now = time.time()
        for pool in policy.pools:
            for node in pool.nodes:
                rec = self.nodes.get(node.id)
                if rec is None:
                    state, reason = (st.ACTIVE, "initial fleet") if first else (st.JOINING, "added to the policy")
                    rec = {"id": node.id, "pool": pool.name, "url": node.url, "state": state, "since": now,
                           "reason": reason, "base_weight": node.weight, "target_weight": None,
                           "health": {"fails": 0, "passes": 0, "last_error": None, "last_check": None},
                           "ramp": None, "drain": None, "warmup": None, "engine_start_time": None,
                           "resume_state": None, "has_agent": False, "last_weight_change": None}
                    self.nodes[node.id] = rec
                    self._pending_events.append(("node_added", f"{node.id}: {reason}, state {state}",
                                                 {"node": node.id, "pool": pool.name}))
                rec["pool"], rec["url"] = pool.name, node.url
                self._save(rec)
        self.pools = {p.name: self.pools.get(p.name) or self.store.pools([p.name]).get(p.name)
                      or {"degraded": False, "since": None, "above_since": None, "below_since": None,
                          "last_weight_change": None}
                      for p in policy.pools}
        self.policy = policy
        self._policy_text = text

    def validate(self, text: str) -> Policy:
        """Parse and check a policy text, including ``nginx -t`` of its render and the fields a
        running control plane cannot change (its address, its Redis). Raises PolicyError (field
        paths) or ApplyError (nginx refused the rendered config)."""
        policy = parse_policy_text(text, "policy")
        if self.policy is not None:
            self._check_restart_fields(policy)
        try:
            self.nginx.test(self._render_files(policy, self.applied))
        except (NginxError, ValueError) as exc:
            raise ApplyError(str(exc)) from None
        return policy

    def _render_files(self, policy: Policy, runtime: Runtime | None) -> dict[str, str]:
        from ..render import render

        return render(policy, self.nginx.lua_dir, runtime)

    def apply_policy(self, text: str, source: str, force: bool = False) -> dict[str, Any]:
        """Validate and apply a policy as one transaction.

        A policy that drops a node that still has work (see :meth:`_removal_work`) is refused
        unless ``force``; a forced removal says in its ``node_removed`` event what was in flight.

        Returns ``{"version": n, "result": "reloaded"|"unchanged"|..., "changed": bool}``.

        Raises:
            PolicyError: invalid (nothing changed; counted as ``invalid``).
            NodeHasWork: it would remove a node with work (nothing changed; counted as ``refused``).
            ApplyError: nginx refused the rendered config or failed to reload (the running
                config keeps serving; an event and ``kvgate_control_reloads_total{result="failed"}``).
        """
        figures = self._removal_figures(text)  # network I/O, before the lock when the caller holds none
        with self.lock:
            if self.policy is not None and not self.store.ping():
                # applied but recorded nowhere, it could neither be listed nor rolled back
                raise StoreError("Redis is unreachable: policy changes are refused until the control plane can "
                                 "record them as versions (the running policy keeps serving)")
            try:
                policy = parse_policy_text(text, "policy")
                if self.policy is not None:
                    self._check_restart_fields(policy)
            except PolicyError as exc:
                self.metrics.policy_applies.labels("invalid").inc()
                self._event("policy_rejected", f"policy from {source} rejected: "
                            + "; ".join(str(i) for i in exc.issues[:5])
                            + (f" (+{len(exc.issues) - 5} more)" if len(exc.issues) > 5 else ""),
                            issues=[{"path": i.path, "reason": i.reason} for i in exc.issues])
                raise
            busy = self._removal_work(policy, figures) if self.policy is not None else []
            if busy and not force:
                self.metrics.policy_applies.labels("refused").inc()
                message = self._removal_refusal(busy)
                self._event("policy_rejected", f"policy from {source} refused: {message.split('; ')[0]}",
                            nodes=busy)
                raise NodeHasWork(f"policy not applied: {message}", busy)
            # deep copies: _adopt and the weight updates change the records in place (url, base weight)
            old = (self.policy, getattr(self, "_policy_text", None), copy.deepcopy(self.nodes),
                   copy.deepcopy(self.pools))
            try:
                self._adopt(policy, text)
                for rec in self.nodes.values():
                    node = policy.node(rec["id"])
                    if rec["base_weight"] != node.weight:
                        rec["base_weight"], rec["target_weight"] = node.weight, None
                self._update_targets(time.time(), self._reports())
                result = self._apply_runtime(force=True)
            except (ApplyError, StoreError) as exc:
                # nothing of the refused policy stays: memory, Redis records and nginx as before
                if isinstance(exc, ApplyError):
                    self.metrics.policy_applies.labels("failed").inc()
                    self._event("policy_rejected", f"policy from {source} not applied: {str(exc).splitlines()[0]}")
                self._flush_pending_events(keep=False)
                self.policy, self._policy_text, self.nodes, self.pools = old
                for rec in self.nodes.values():
                    self._save(rec)
                for node_id in {n.id for n in policy.nodes()} - set(self.nodes):
                    try:  # records _adopt created for the refused policy's new nodes
                        self.store.delete_node(node_id)
                    except StoreError as store_exc:
                        log.warning("%s", store_exc)
                raise
            forced = {b["id"]: b for b in busy}
            self._pending_events = [
                (kind, f"{message} (forced while it still had work: {_work_text(forced[where['node']])})"
                 if kind == "node_removed" and where.get("node") in forced else message, where)
                for kind, message, where in self._pending_events]
            self._flush_pending_events()
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            try:
                latest = self.store.latest_version()
                changed = not latest or latest["yaml"] != text
                if changed:
                    self.policy_version = self.store.add_version(text, digest, source,
                                                                 keep=policy.control.versions_kept)
                    self._event("policy_applied", f"policy version {self.policy_version['version']} applied "
                                f"from {source} (nginx {result})", version=self.policy_version["version"])
                else:
                    self.policy_version = latest
            except StoreError as exc:
                # nginx already runs the new policy: say so, even though its version is not recorded
                log.warning("policy applied but not recorded as a version: %s", exc)
                changed = True
                self.policy_version = {"version": None, "yaml": text, "digest": digest, "source": source,
                                       "applied_at": time.time()}
            self.metrics.policy_applies.labels("applied").inc()
            self._write_running_copy(text)
            return {"version": self.policy_version["version"], "result": result, "changed": changed}

    def _check_restart_fields(self, policy: Policy) -> None:
        """Refuse, through the API, changes a running control plane cannot make to itself:
        its own address and its Redis (``kvgate up`` restarts it for those)."""
        from ..policy import PolicyIssue

        assert self.policy is not None
        issues = []
        if policy.control.listen != self.policy.control.listen:
            issues.append(PolicyIssue("control.listen", "the running control plane cannot move to another address; "
                                      "apply this policy with `kvgate up` (it restarts the control plane)"))
        if policy.redis.url != self.policy.redis.url:
            issues.append(PolicyIssue("redis.url", "the running control plane keeps its state in the current Redis; "
                                      "apply this policy with `kvgate up` (it restarts the control plane)"))
        if issues:
            raise PolicyError("policy", issues)

    def _removal_figures(self, text: str) -> dict[str, Any] | None:
        """In-flight figures of the nodes ``text`` would remove, read now (network I/O):
        ``{"gateway": <_fetch_gateway snapshot>, "engine": {node id: _engine_inflight(url)}}``,
        or None when it removes none (or does not parse: the apply then refuses it anyway)."""
        with self.lock:
            if self.policy is None:
                return None
            listen = self.policy.gateway.listen
            current = {node_id: rec["url"] for node_id, rec in self.nodes.items()}
        try:
            wanted = {n.id for n in parse_policy_text(text, "policy").nodes()}
        except Exception:  # noqa: BLE001 - the apply reports what is wrong with it
            return None
        removed = {node_id: url for node_id, url in current.items() if node_id not in wanted}
        if not removed:
            return None
        with ThreadPoolExecutor(max_workers=min(16, len(removed))) as ex:
            engine = dict(zip(removed, ex.map(self._engine_inflight, removed.values())))
        return {"gateway": self._fetch_gateway(listen), "engine": engine}

    def _removal_work(self, policy: Policy, figures: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The nodes ``policy`` removes that still have work, in the shape of :class:`NodeHasWork`.

        A node has work when requests are in flight on it — at the gateway
        (``kvgate_upstream_inflight``) or at the engine (running + waiting), whatever its state,
        an ``active`` node with traffic included: drain it first — or when it is ``draining``
        (its drain has not confirmed it idle yet). A count that cannot be read is not held
        against it. ``figures``: from :meth:`_removal_figures` (None: nothing read; a node
        removed since is judged on its state)."""
        wanted = {n.id for n in policy.nodes()}
        snap = (figures or {}).get("gateway") or {}
        busy = []
        for node_id, rec in self.nodes.items():
            if node_id in wanted:
                continue
            g = snap["inflight"].get(node_id, 0.0) if snap.get("ok") else None
            e = ((figures or {}).get("engine") or {}).get(node_id, (None, None))[0]
            known = [c for c in (g, e) if c is not None]
            inflight = int(max(known)) if known else 0
            if inflight > 0 or rec["state"] == st.DRAINING:
                busy.append({"id": node_id, "state": rec["state"], "inflight": inflight,
                             "inflight_gateway": g, "inflight_engine": e})
        return busy

    @staticmethod
    def _removal_refusal(busy: list[dict[str, Any]]) -> str:
        """The 409 message for nodes with work (without the "policy not applied: " head)."""
        ids = [b["id"] for b in busy]
        what = ", ".join(f"{b['id']} ({_work_text(b)})" for b in busy)
        one = len(busy) == 1
        return (f"node{'' if one else 's'} {what} still {'has' if one else 'have'} work; drain "
                f"{'it' if one else 'them'} first and wait for the drain "
                f"({'; '.join(f'`kvgate drain {i} --wait`' for i in ids)}), then apply again, or force the "
                "removal (`kvgate apply --force`, `?force=true` in the API): keys move at once and requests in "
                "flight are left to end on the node. The running config keeps serving")

    def invalidate_cache(self, source: str) -> dict[str, Any]:
        """Invalidate the whole response cache at once: apply the running policy with
        ``cache.namespace_version`` one above the version in force (:attr:`namespace_in_force`;
        a new policy version, the operator's comments kept). Every cache key carries the version
        (``kvgate:resp:v<N>:...``, lua/kvgate/cache_key.lua), so old entries are never read again
        and expire by their TTL.

        Returns ``{"old": n, "new": n + 1, "version": policy version, "result": nginx result}``.
        Raises PolicyError, ApplyError (nothing changed), StoreError (Redis unreachable: refused),
        ValueError (no policy yet)."""
        from ..policy.edit import bump_namespace_version

        with self.lock:
            text = self._policy_text
            if self.policy is None or text is None:
                raise ValueError("no policy is applied yet")
            old = self.namespace_in_force
            new_text, new = bump_namespace_version(text, at_least=old + 1)
            result = self.apply_policy(new_text, source)
            self._event("cache_invalidated", f"response cache invalidated by {source}: namespace version "
                        f"{old} → {new} (policy version {result['version']})", old=old, new=new,
                        version=result["version"])
            return {"old": old, "new": new, **result}

    def rollback(self, version: int, by: str | None = None, force: bool = False) -> dict[str, Any]:
        """Apply a stored version again (as a new version). Raises NotFound, PolicyError, NodeHasWork
        (unless ``force``), ApplyError, StoreError. The namespace version in force does not go back
        (see :attr:`namespace_in_force`)."""
        for v in self.store.versions():
            if v["version"] == version:
                return self.apply_policy(v["yaml"], f"rollback to version {version}" + (f" by {by}" if by else ""),
                                         force=force)
        raise NotFound(f"no stored policy version {version}")

    def _write_running_copy(self, text: str) -> None:
        """Keep ``run_dir/policy.yaml`` (what ``kvgate up``/``status`` read) in step with the API."""
        if not self.run_dir or not (self.run_dir / "policy.yaml").exists():
            return
        tmp = self.run_dir / "policy.yaml.api"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.run_dir / "policy.yaml")

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
        """Node id → the nginx weight the node has when it serves: the weight in force, and for a
        node that is down (draining, drained, ejected, warming …) its target weight. The ring of
        these weights defines a route key's *home node* (the admin page's affinity ratio,
        :mod:`kvgate.control.traffic`): a drain does not move the other nodes' homes."""
        assert self.policy is not None
        with self.lock:
            applied = dict(self.applied.weights) if self.applied else {}
            out = {}
            for node in self.policy.nodes():
                w = applied.get(node.id) or 0
                if w <= 0:
                    w = (self.nodes.get(node.id) or {}).get("target_weight") or node.weight * WEIGHT_SCALE
                out[node.id] = int(w)
            return out

    def desired_runtime(self) -> Runtime:
        """Weights (0 = down), balancer switches and the namespace version for the current states."""
        assert self.policy is not None
        runtime = runtime_for(self.policy, self.nodes, self.pools)
        if self.namespace_floor > self.policy.cache.namespace_version:
            runtime = dataclasses.replace(runtime, namespace_version=self.namespace_floor)
        return runtime

    def _apply_runtime(self, force: bool = False) -> str:
        """Render and apply the desired runtime if it differs from the applied one.

        Raises ApplyError (after recording it) when nginx refuses or fails."""
        assert self.policy is not None
        runtime = self.desired_runtime()
        key = (tuple(sorted(runtime.weights.items())), tuple(sorted(runtime.balancers.items())))
        if not force and self.applied is not None and runtime == self.applied:
            return "unchanged"
        if not force and self._failed_runtime and key == self._failed_runtime[0] \
                and time.monotonic() < self._failed_runtime[1]:
            return "failed"  # the same config failed moments ago: retried after a back-off
        try:
            result = self.nginx.apply(self.policy, runtime, start=not self.external_gateway)
        except (NginxError, ValueError, OSError, subprocess.SubprocessError) as exc:
            self._failed_runtime = (key, time.monotonic() + RETRY_FAILED_APPLY_S)
            self.metrics.reloads.labels("failed").inc()
            self._event("reload_failed", f"gateway config not applied, the running one keeps serving: "
                        f"{str(exc).splitlines()[0]}", error=str(exc)[:2000])
            raise ApplyError(str(exc)) from None
        self._failed_runtime = None
        self.applied = runtime
        if self.namespace_in_force > self.namespace_floor:
            self.namespace_floor = self.namespace_in_force
            try:
                self.store.set("cache_namespace_max", str(self.namespace_floor))
            except StoreError as exc:
                log.warning("namespace version %d in force but not recorded: %s", self.namespace_floor, exc)
        self.metrics.reloads.labels(result).inc()
        if result != "unchanged":
            self._event("reload", f"gateway config {result}", result=result,
                        weights=dict(runtime.weights), balancers=dict(runtime.balancers))
        for node_id, w in runtime.weights.items():
            self.metrics.weight.labels(node_id).set(w)
        return result

    def _try_apply(self) -> None:
        try:
            self._apply_runtime()
        except ApplyError:
            pass  # recorded; the running config keeps serving

    # ================================================================ reports
    def report(self, node_id: str, report: dict[str, Any]) -> dict[str, Any]:
        """Store an agent report. Returns ``{"interval_s": ...}`` for the agent. Raises NotFound."""
        with self.lock:
            rec = self.nodes.get(node_id)
            if rec is None:
                raise NotFound(f"no node {node_id!r} in the policy")
            now = time.time()
            self._note_engine_start(rec, report, now)  # also while the store is down (answered 503)
            self.store.put_report(node_id, report, now)
            self.history.add_report(node_id, now, report)
            self.metrics.reports.labels(node_id).inc()
            if not rec.get("has_agent"):
                rec["has_agent"] = True
                self._save(rec)
            return {"interval_s": self.policy.control.report_interval_s if self.policy else 2.0}

    def _note_engine_start(self, rec: dict[str, Any], report: dict[str, Any], now: float) -> None:
        """Keep the engine's process start time (``engine.start_time``) of every report, and when it
        was seen: the record tells an engine that kept its cache from a restarted one (see
        :meth:`_recover`) from the first report on, not only after a probe round."""
        start = (report.get("engine") or {}).get("start_time")
        if start is None:
            return
        before = rec.get("engine_start_time")
        if before is not None and before != start and rec["state"] in (st.ACTIVE, st.RAMPING):
            self._event("engine_restarted", f"{rec['id']}: engine restarted; its prefix cache is empty",
                        node=rec["id"], pool=rec["pool"])
        rec["engine_start_time"], rec["engine_start_seen_at"] = start, now
        if before != start:
            self._save(rec)

    def _store_instance(self) -> str | None:
        """The store's instance marker (:meth:`Store.instance`), None when Redis cannot be read."""
        try:
            return self.store.instance()
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    def _note_store(self, readable: bool, instance: str | None, now: float) -> None:
        """Start the report grace when the store is back (readable after failing, or emptied under
        us: see :class:`~kvgate.control.health.StoreWatch`); an emptied store gets the node and
        pool records and the namespace floor again at once."""
        assert self.policy is not None
        back = self._store_watch.observe(readable, instance, now)
        if back:
            self._store_back_at = now
            if back["emptied"]:
                for rec in self.nodes.values():
                    self._save(rec)
                try:
                    for name, p in self.pools.items():
                        self.store.put_pool(name, p)
                    if self.namespace_floor:
                        self.store.set("cache_namespace_max", str(self.namespace_floor))
                except StoreError as exc:
                    log.warning("%s", exc)
            ri = self.policy.control.report_interval_s
            window = self._report_window()
            self._event("store_back", "Redis is back" + (f" after {back['down_s']:.0f}s" if back["down_s"] else "")
                        + (", emptied (its data is gone): node records written again" if back["emptied"] else "")
                        + f"; missing agent reports count as unknown for {window:.0f}s (agents retry every "
                        f"{ri:g}s, longer after failed posts)", emptied=back["emptied"], down_s=back["down_s"])
        self.metrics.report_grace.set(1 if self._report_grace(now) else 0)

    def _reports(self) -> dict[str, dict[str, Any]] | None:
        """The nodes' last reports, or None when Redis cannot be read (then nothing that
        depends on reports is decided: a Redis outage must not look like dead agents)."""
        try:
            return self.store.reports(list(self.nodes))
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    def _fresh(self, entry: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
        """The report if it is younger than ``health.missing_reports`` intervals, else None."""
        if not entry or not self.policy:
            return None
        limit = self.policy.health.missing_reports * self.policy.control.report_interval_s
        return entry["report"] if now - entry["received_at"] <= limit else None

    # ============================================================== gateway
    def _fetch_gateway(self, listen: str) -> dict[str, Any]:
        """Per-node in-flight, answers and 5xx, and failovers from the gateway's ``/metrics``
        (network I/O: called without the lock)."""
        url = f"http://{connect_address(listen)}/metrics"
        snap: dict[str, Any] = {"ok": False, "inflight": {}, "requests": {}, "errors": {}, "failovers": {}}
        try:
            text = self._http.get(url, timeout=2).text
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    lb = s.labels
                    if s.name == "kvgate_upstream_inflight":
                        snap["inflight"][lb.get("node", "")] = snap["inflight"].get(lb.get("node", ""), 0) + s.value
                    elif s.name == "kvgate_requests_total":
                        n = lb.get("node", "")
                        snap["requests"][n] = snap["requests"].get(n, 0) + s.value
                        if lb.get("status", "").startswith("5"):
                            snap["errors"][n] = snap["errors"].get(n, 0) + s.value
                    elif s.name == "kvgate_failovers_total":
                        p = lb.get("pool", "")
                        snap["failovers"][p] = snap["failovers"].get(p, 0) + s.value
            snap["ok"] = True
        except (requests.RequestException, ValueError) as exc:
            snap["error"] = str(exc).splitlines()[0]
        return snap

    def _take_gateway(self, snap: dict[str, Any]) -> None:
        """Adopt a gateway snapshot; failover counter increases become events."""
        prev = self._gateway
        self.history.add_gateway(time.time(), snap)
        if snap["ok"] and self.policy is not None:
            self.passive.add(time.time(), self.nodes, snap["requests"], snap["errors"],
                             self.policy.health.passive.window_s)
        if snap["ok"] and prev.get("ok"):
            for pool, value in snap["failovers"].items():
                delta = value - prev["failovers"].get(pool, 0)
                if delta > 0:
                    self._event("failover", f"pool {pool}: {int(delta)} request(s) failed over to another node",
                                pool=pool, count=int(delta))
        self._gateway = snap

    # ================================================================== tick
    def tick(self) -> None:
        """One reconciler round (see the module docstring).

        Network I/O (the gateway's ``/metrics``, engine probes, a draining engine's
        in-flight count) happens before the lock is taken, so API calls are not held up
        by a slow or dead engine; only the state changes and the nginx apply hold it."""
        with self.lock:
            if self.policy is None:
                return
            policy = self.policy
            urls = {rec["id"]: rec["url"] for rec in self.nodes.values()}
            draining = {rec["id"]: rec["url"] for rec in self.nodes.values() if rec["state"] == st.DRAINING}
            probe_now = time.monotonic() >= self._probe_due
            if probe_now:
                self._probe_due = time.monotonic() + policy.health.probe_interval_s
        self.metrics.ticks.inc()
        snap = self._fetch_gateway(policy.gateway.listen)
        got = self._reports()
        reports_ok, reports = got is not None, got or {}
        instance = self._store_instance() if reports_ok else None
        probes = self._probe_all(urls, policy.health.probe_timeout_s) if probe_now else None
        engine_inflight = {node_id: self._engine_inflight(url) for node_id, url in draining.items()}
        with self.lock:
            if self.policy is None:
                return
            now = time.time()
            self._take_gateway(snap)
            self._note_store(reports_ok, instance, now)
            if probes is not None:
                self._health_round(reports, now, probes, reports_ok)
            self._drain_round(now, engine_inflight)
            if reports_ok:  # ramps, overload and weights decide on the reports: they wait for Redis
                self._ramp_round(reports, now)
                self._overload_round(reports, now)
                self._update_targets(now, reports)
            self._try_apply()
            for rec in self.nodes.values():
                for s in st.STATES:
                    self.metrics.state.labels(rec["id"], s).set(1 if rec["state"] == s else 0)
                if rec["target_weight"]:
                    self.metrics.target.labels(rec["id"]).set(rec["target_weight"])
                entry = reports.get(rec["id"])
                if entry:
                    self.metrics.report_age.labels(rec["id"]).set(max(0.0, now - entry["received_at"]))

    # ---------------------------------------------------------------- health
    def _probe_all(self, urls: dict[str, str], timeout: float) -> dict[str, str | None]:
        """Probe every engine at once: node id → None (healthy) or the reason it failed."""
        if not urls:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(urls))) as ex:
            return dict(zip(urls, ex.map(lambda u: self._probe(u, timeout), urls.values())))

    def _probe(self, url: str, timeout: float) -> str | None:
        """None if ``GET url/health`` answers 200 within ``timeout``, else the reason."""
        try:
            resp = requests.get(f"{url}/health", timeout=timeout)
        except requests.RequestException as exc:
            return f"health probe failed: {type(exc).__name__}"
        return None if resp.status_code == 200 else f"health probe answered HTTP {resp.status_code}"

    def _report_window(self) -> float:
        """Seconds of the report grace: ``missing_reports`` intervals plus the agents' longest
        backoff (``max(interval, min(10 s, 5 × interval))``, see :mod:`kvgate.agent.agent`)."""
        assert self.policy is not None
        ri = self.policy.control.report_interval_s
        return self.policy.health.missing_reports * ri + max(ri, min(10.0, 5 * ri))

    def _report_grace(self, now: float) -> bool:
        """True while agents' missing reports cannot be held against them: this process is young
        (they could not report while it was not running), or its store came back lately (their
        posts were answered 503 while it was away, and their last reports may be gone with it);
        either way they retry with backoff. A missing report is then unknown, not a failed check."""
        return now - max(self._started_at, self._store_back_at) <= self._report_window()

    def _health_round(self, reports: dict[str, dict[str, Any]], now: float, probes: dict[str, str | None],
                      reports_ok: bool = True) -> None:
        """Count passed/failed checks; eject and recover. A check fails on the probe, on the agent's
        report (missing — unless in the report grace —, or saying the engine is unhealthy) and, for a
        serving node, on its 5xx share at the gateway (``health.passive``). Without readable reports
        (Redis down) the agent's part is not judged."""
        assert self.policy is not None
        hc = self.policy.health
        for rec in list(self.nodes.values()):
            if rec["id"] not in probes:
                continue  # joined after the probes were sent
            reasons = [probes[rec["id"]]] if probes[rec["id"]] else []
            entry = reports.get(rec["id"])
            if rec.get("has_agent") and reports_ok:
                fresh = self._fresh(entry, now)
                if fresh is None and not self._report_grace(now):
                    age = now - entry["received_at"] if entry else None
                    reasons.append("no agent report" + (f" for {age:.0f}s" if age is not None else ""))
                elif fresh is not None and not (fresh.get("engine") or {}).get("healthy", True):
                    reasons.append("agent: engine " + str((fresh.get("engine") or {}).get("error") or "unhealthy"))
            h = rec["health"]
            h["last_check"] = now
            h["passive"] = self.passive.figures(rec["id"])
            capped = False
            if hc.passive.enabled and rec["state"] in st.SERVING and self._gateway.get("ok"):
                why = self.passive.verdict(rec["id"], hc.passive)
                if why:
                    # failing on its 5xx share alone: ejected only within the pool's share
                    capped = not reasons and not self._passive_room(rec, hc.passive.max_ejected_share)
                    reasons.append(why)
            if reasons:
                h["fails"], h["passes"], h["last_error"] = h["fails"] + 1, 0, "; ".join(reasons)
                self.metrics.health_checks.labels(rec["id"], "fail").inc()
                # a joining node is not serving: it just waits for its first passing check
                last = rec["state"] in st.SERVING and not self._others_serving(rec)
                if last and h["fails"] == hc.eject_after:
                    self._event("eject_skipped", f"{rec['id']}: {h['fails']} failed health checks, but it is the "
                                f"last serving node of pool {rec['pool']}: kept in the ring ({h['last_error']})",
                                node=rec["id"], pool=rec["pool"])
                if capped and not last and h["fails"] == hc.eject_after:
                    self._event("eject_skipped", f"{rec['id']}: {h['fails']} failed health checks on its 5xx share "
                                f"alone, but passive health already ejected the most of pool {rec['pool']} it may "
                                f"(health.passive.max_ejected_share {hc.passive.max_ejected_share:g}): kept in the "
                                f"ring ({h['last_error']})", node=rec["id"], pool=rec["pool"])
                if (not last and not capped and rec["state"] in (st.WARMING, st.RAMPING, st.ACTIVE)
                        and h["fails"] >= hc.eject_after):
                    rec["resume_state"] = rec["state"]
                    rec["engine_start_time_at_eject"] = rec.get("engine_start_time")
                    self.passive.reset(rec["id"])  # no traffic while ejected: judged again on its return
                    self._transition(rec, st.EJECTED, f"{h['fails']} failed health checks: {h['last_error']}")
            else:
                h["fails"], h["passes"] = 0, h["passes"] + 1
                self.metrics.health_checks.labels(rec["id"], "pass").inc()
                # the engine's start time comes with each report (_note_engine_start)
                if rec["state"] == st.JOINING:
                    self._start_warming(rec, "passed its health check")
                elif rec["state"] == st.EJECTED and h["passes"] >= hc.recover_after:
                    self._recover(rec)
            self._save(rec)

    def _passive_room(self, rec: dict[str, Any], share: float) -> bool:
        """Whether ejecting ``rec`` keeps its pool's ejected nodes within ``share`` of the pool
        (rounded down, at least 1): the cap on ejections by passive health."""
        pool = [r for r in self.nodes.values() if r["pool"] == rec["pool"]]
        ejected = sum(1 for r in pool if r["state"] == st.EJECTED)
        return ejected + 1 <= max(1, int(len(pool) * share))

    def _recover(self, rec: dict[str, Any]) -> None:
        """An ejected node passed ``recover_after`` checks: back through warming if its engine
        restarted (or we cannot tell), else straight back to where it was.

        "Same engine" needs an agent report since the ejection whose ``engine.start_time`` is the
        one seen before it; a node with an agent waits for that report for up to
        ``missing_reports`` report intervals of passing checks (called again each round) rather
        than be warmed for want of it. Its passive-health window starts again either way."""
        assert self.policy is not None
        before = rec.get("engine_start_time_at_eject")
        now_start = rec.get("engine_start_time")
        seen = (rec.get("engine_start_seen_at") or 0.0) >= (rec.get("since") or 0.0)
        hc = self.policy.health
        passing_extra_s = (rec["health"]["passes"] - hc.recover_after) * hc.probe_interval_s
        if rec.get("has_agent") and before is not None and not seen \
                and passing_extra_s < hc.missing_reports * self.policy.control.report_interval_s:
            return
        same_engine = before is not None and seen and now_start == before
        resume = rec.get("resume_state")
        self.passive.reset(rec["id"])
        if same_engine and resume in (st.ACTIVE, st.RAMPING):
            if resume == st.RAMPING and rec.get("ramp"):
                rec["ramp"]["since"] = time.time()
            self._transition(rec, resume, f"recovered after {rec['health']['passes']} passed checks; "
                             "same engine process, cache kept")
        else:
            why = f"it was {resume}" if same_engine else "engine restarted, cache is empty" \
                if before is not None and seen else "cannot tell whether the engine kept its cache"
            self._start_warming(rec, f"recovered after {rec['health']['passes']} passed checks ({why})")

    # --------------------------------------------------------------- warm-up
    def _start_warming(self, rec: dict[str, Any], reason: str) -> None:
        self._transition(rec, st.WARMING, reason)
        self._launch_warmup(rec)

    def _launch_warmup(self, rec: dict[str, Any], reason: str | None = None) -> None:
        node_id = rec["id"]
        running = self._warmups.get(node_id)
        if running and running.is_alive():
            return
        rec["warmup"] = {"status": "running", "started_at": time.time(), "result": None, "progress": [0, 0]}
        self._save(rec)
        self._event("warmup", f"{node_id}: warm-up started" + (f" (requested by {reason})" if reason else ""),
                    node=node_id, pool=rec["pool"])
        t = threading.Thread(target=self._warmup_thread, args=(node_id,), name=f"warmup-{node_id}",
                             daemon=True)
        self._warmups[node_id] = t
        t.start()

    def _warmup_thread(self, node_id: str) -> None:
        with self.lock:
            rec = self.nodes.get(node_id)
            if rec is None or self.policy is None:
                return
            pool = next(p for p in self.policy.pools if p.name == rec["pool"])
            url, redis_url = rec["url"], self.policy.redis.url

        def progress(done: int, total: int) -> None:
            rec["warmup"]["progress"] = [done, total]

        try:
            # hot prefixes are in the gateway's Redis (the policy's), which `--redis-url` may not be
            log_redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                result = run_warmup(url, pool, log_redis, progress=progress)
            finally:
                log_redis.close()
        except Exception as exc:  # never leave a node stuck in warming
            log.exception("warm-up of %s failed", node_id)
            result = WarmupResult(errors=[str(exc)])
        with self.lock:
            rec = self.nodes.get(node_id)
            if rec is None:
                return
            outcome = "ok" if result.failed == 0 else ("failed" if result.sent == 0 else "partial")
            rec["warmup"] = {"status": outcome, "started_at": result.started_at, "result": result.as_dict(),
                             "progress": [result.sent + result.failed, result.sent + result.failed]}
            self.metrics.warmups.labels(node_id, outcome).inc()
            if result.ttft_before_ms is not None:
                self.metrics.warmup_ttft.labels(node_id, "before").set(result.ttft_before_ms / 1000)
            if result.ttft_after_ms is not None:
                self.metrics.warmup_ttft.labels(node_id, "after").set(result.ttft_after_ms / 1000)
            ttft = (f"; TTFT {result.ttft_before_ms} ms cold → {result.ttft_after_ms} ms warm"
                    if result.ttft_before_ms is not None and result.ttft_after_ms is not None else "")
            self._event("warmup", f"{node_id}: warm-up {outcome}: {result.sent}/{result.prompts + 1 if result.prompts else 0} "
                        f"request(s) sent ({result.from_policy} policy prompt(s), {result.from_hot_prefixes} hot "
                        f"prefix(es)) in {result.duration_s:.1f}s{ttft}", node=node_id, pool=rec["pool"],
                        **{k: v for k, v in result.as_dict().items() if k != "errors"}, errors=result.errors)
            # whoever started this warm-up: a node that is warming now goes on to ramping (an
            # undrain or a recovery during a manual warm-up does not start a second one)
            if rec["state"] == st.WARMING:
                if outcome == "failed":
                    # stays warming; the next passing health check after a failure retries
                    rec["health"]["passes"] = 0
                    self._save(rec)
                    self._retry_warmup_later(node_id)
                    return
                rec["ramp"] = {"step": 0, "since": time.time(), "held": None,
                               "baseline": self._node_counts(node_id)}
                self._transition(rec, st.RAMPING, f"warm-up {outcome}; ramping at "
                                 f"{self.policy.ramp.steps[0]:.0%} of its weight" if self.policy else "ramping")
                self._try_apply()
            else:
                self._save(rec)

    def _retry_warmup_later(self, node_id: str) -> None:
        def retry() -> None:
            if self._stop.wait(self.policy.health.probe_interval_s * 2 if self.policy else 4):
                return
            with self.lock:
                rec = self.nodes.get(node_id)
                if rec and rec["state"] == st.WARMING:
                    self._launch_warmup(rec)

        threading.Thread(target=retry, daemon=True).start()

    # ------------------------------------------------------------------ ramp
    def _node_counts(self, node_id: str) -> tuple[float, float]:
        g = self._gateway
        return (g["requests"].get(node_id, 0.0), g["errors"].get(node_id, 0.0))

    def _ramp_round(self, reports: dict[str, dict[str, Any]], now: float) -> None:
        assert self.policy is not None
        rc = self.policy.ramp
        for rec in self.nodes.values():
            if rec["state"] != st.RAMPING:
                continue
            ramp = rec["ramp"]
            if now - ramp["since"] < rc.step_interval_s:
                continue
            total, errors = self._node_counts(rec["id"])
            b_total, b_errors = ramp.get("baseline") or (0.0, 0.0)
            answered = total - b_total
            error_rate = (errors - b_errors) / answered if answered > 0 else 0.0
            waiting = ((self._fresh(reports.get(rec["id"]), now) or {}).get("engine") or {}).get("waiting") or 0
            held = None
            if error_rate > rc.max_error_rate:
                held = f"error rate {error_rate:.1%} > {rc.max_error_rate:.1%}"
            elif waiting > rc.max_queue:
                held = f"{waiting:.0f} waiting > {rc.max_queue:.0f}"
            if held:
                if ramp.get("held") != held:
                    ramp["held"] = held
                    self._event("ramp_held", f"{rec['id']}: ramp held at "
                                f"{rc.steps[min(ramp['step'], len(rc.steps) - 1)]:.0%}: {held}",
                                node=rec["id"], pool=rec["pool"])
                    self._save(rec)
                continue
            step = ramp["step"] + 1
            if step >= len(rc.steps) - 1:
                rec["ramp"] = None
                self._transition(rec, st.ACTIVE, "ramp complete")
            else:
                rec["ramp"] = {"step": step, "since": now, "held": None, "baseline": self._node_counts(rec["id"])}
                self._save(rec)
                self._event("ramp", f"{rec['id']}: ramp step {step + 1}/{len(rc.steps)}: {rc.steps[step]:.0%} of its weight",
                            node=rec["id"], pool=rec["pool"], step=step, fraction=rc.steps[step])

    # ----------------------------------------------------------------- drain
    def _engine_inflight(self, url: str) -> tuple[float | None, str | None]:
        """``(running + waiting, None)`` from the engine's own ``/metrics``, scraped now.

        ``(0.0, None)`` when the engine refuses connections (a dead engine has nothing in flight).
        ``(None, why)`` when the engine answers but its figures are *unavailable*: ``/metrics``
        answers 4xx or 501 (llama.cpp without ``--metrics``), or text without vLLM/SGLang figures
        (TGI, any plain OpenAI server); a drain then decides on the gateway's count alone.
        ``(None, None)`` when they cannot be told *now* (a timeout under load, a 5xx): unknown,
        never idle."""
        from ..agent.collect import engine as scrape_engine

        figures = scrape_engine(url, timeout=2.0)
        if figures.get("running") is not None:
            return float(figures.get("running") or 0) + float(figures.get("waiting") or 0), None
        error = str(figures.get("error") or "")
        if "connection failed" in error:
            return 0.0, None
        if figures.get("figures_error"):
            return None, str(figures["figures_error"])
        return None, None

    def _drain_round(self, now: float, engine_inflight: dict[str, tuple[float | None, str | None]]) -> None:
        """Finish drains: a draining node whose gateway in-flight count (``kvgate_upstream_inflight``)
        and engine running + waiting were both 0 on two checks in a row is drained. When the
        engine's figures are unavailable (see :meth:`_engine_inflight`), the gateway's count
        alone decides, and the drain record and reason say so (``decided_on: "gateway"``)."""
        for rec in self.nodes.values():
            if rec["state"] != st.DRAINING or rec["id"] not in engine_inflight:
                continue
            d = rec["drain"]
            g = self._gateway["inflight"].get(rec["id"], 0.0) if self._gateway.get("ok") else None
            e, unavailable = engine_inflight[rec["id"]]
            d["inflight_gateway"], d["inflight_engine"] = g, e
            d["engine_figures"] = f"unavailable: {unavailable}" if unavailable else None
            d["decided_on"] = "gateway" if unavailable else "gateway and engine"
            self.metrics.inflight.labels(rec["id"]).set(max(g or 0.0, e or 0.0))
            # unknown (None) is never idle: drain.timeout_s ends such a drain
            engine_idle = (e is not None and e <= 0) or bool(unavailable)
            idle = g is not None and g <= 0 and engine_idle and now - d["started"] >= 1.0
            if idle:
                d["zero_checks"] = d.get("zero_checks", 0) + 1
            else:
                d["zero_checks"] = 0
            # The engine has been idle while the gateway's count stood still: nothing can still be
            # streaming (the gateway relays as the engine produces), so the count leaked (an nginx
            # worker that crashed never ran its log phase).
            stuck = d.get("gateway_stuck")
            if g is not None and g > 0 and e == 0:
                if not stuck or stuck[0] != g:
                    d["gateway_stuck"] = stuck = [g, now]
            else:
                d["gateway_stuck"] = stuck = None
            if d["zero_checks"] >= 2:
                if unavailable:
                    self._transition(rec, st.DRAINED, f"no request in flight at the gateway after "
                                     f"{now - d['started']:.1f}s; engine figures unavailable ({unavailable}): "
                                     "decided on the gateway's in-flight count")
                else:
                    self._transition(rec, st.DRAINED, f"no request in flight after {now - d['started']:.1f}s")
            elif stuck and now - stuck[1] >= LEAKED_COUNT_S:
                self._transition(rec, st.DRAINED, f"engine idle for {now - stuck[1]:.0f}s while the gateway still "
                                 f"counted {g:.0f} in flight (a count leaked by a crashed nginx worker); "
                                 f"drained after {now - d['started']:.1f}s")
            elif now >= d["deadline"]:
                d["timed_out"] = True
                self._transition(rec, st.DRAINED, f"drain timeout after {now - d['started']:.0f}s with "
                                 f"{'?' if g is None else f'{g:.0f}'} request(s) in flight at the gateway, "
                                 f"{'?' if e is None else f'{e:.0f}'} at the engine"
                                 + (" (engine figures unavailable)" if unavailable else ""))
            else:
                self._save(rec)

    # -------------------------------------------------------------- overload
    def _overload_round(self, reports: dict[str, dict[str, Any]], now: float) -> None:
        assert self.policy is not None
        for pool in self.policy.pools:
            oc = pool.overload
            p = self.pools[pool.name]
            waits = []
            for node in pool.nodes:
                rec = self.nodes[node.id]
                fresh = self._fresh(reports.get(node.id), now)
                if rec["state"] in st.SERVING and fresh and (fresh.get("engine") or {}).get("waiting") is not None:
                    waits.append(float(fresh["engine"]["waiting"]))
            mean = sum(waits) / len(waits) if waits else 0.0
            p["mean_waiting"] = mean
            changed = False
            if not oc.enabled:
                if p.get("degraded"):
                    p.update(degraded=False, since=now)
                    changed = True
            elif not p.get("degraded"):
                if mean > oc.high_queue:
                    p["above_since"] = p.get("above_since") or now
                    if now - p["above_since"] >= oc.for_s:
                        p.update(degraded=True, since=now, below_since=None)
                        changed = True
                        self.metrics.degrade_switches.labels(pool.name, "least_conn").inc()
                        self._event("degrade", f"pool {pool.name}: mean queue {mean:.1f} > {oc.high_queue:g} for "
                                    f"{oc.for_s:g}s; switched to least_conn", pool=pool.name, to="least_conn",
                                    mean_waiting=mean)
                else:
                    p["above_since"] = None
            else:
                if mean < oc.low_queue:
                    p["below_since"] = p.get("below_since") or now
                    if now - p["below_since"] >= oc.for_s:
                        p.update(degraded=False, since=now, above_since=None)
                        changed = True
                        self.metrics.degrade_switches.labels(pool.name, pool.balancer).inc()
                        self._event("degrade", f"pool {pool.name}: mean queue {mean:.1f} < {oc.low_queue:g} for "
                                    f"{oc.for_s:g}s; back to {pool.balancer}", pool=pool.name, to=pool.balancer,
                                    mean_waiting=mean)
                else:
                    p["below_since"] = None
            self.metrics.degraded.labels(pool.name).set(1 if p.get("degraded") else 0)
            if changed:
                try:
                    self.store.put_pool(pool.name, p)
                except StoreError as exc:
                    log.warning("%s", exc)

    # --------------------------------------------------------------- weights
    def _update_targets(self, now: float, reports: dict[str, dict[str, Any]] | None) -> None:
        """Recompute every node's target weight (damped, except the first one after its base
        weight was set or changed). ``reports`` None (unreadable): only missing targets are set."""
        assert self.policy is not None
        cfg = self.policy.weights
        if reports is None:
            for rec in self.nodes.values():
                if rec["target_weight"] is None:
                    rec["target_weight"] = rec["base_weight"] * WEIGHT_SCALE
            return
        damper = Damper(cfg)
        for pool in self.policy.pools:
            fresh = {n.id: self._fresh(reports.get(n.id), now) for n in pool.nodes}
            caps = capacities(fresh) if cfg.dynamic else {n.id: 1.0 for n in pool.nodes}
            p = self.pools[pool.name]
            changed = []
            for node in pool.nodes:
                rec = self.nodes[node.id]
                base = rec["base_weight"]
                if not cfg.dynamic:
                    computed = base * WEIGHT_SCALE
                else:
                    computed = computed_weight(base, caps[node.id], load_factor(fresh[node.id], cfg))
                rec["computed_weight"] = computed
                current = rec["target_weight"]
                if current is None:
                    rec["target_weight"] = computed
                elif current != computed and damper.accept(current, computed, now, p.get("last_weight_change")):
                    changed.append((rec, current, computed))
            for rec, current, computed in changed:
                rec["target_weight"] = computed
                rec["last_weight_change"] = now
                self._save(rec)
                self._event("weight", f"{rec['id']}: target weight {current} → {computed} (capacity × load)",
                            node=rec["id"], pool=pool.name, old=current, new=computed)
            if changed:
                p["last_weight_change"] = now

    # =============================================================== actions
    def _rec(self, node_id: str) -> dict[str, Any]:
        rec = self.nodes.get(node_id)
        if rec is None:
            raise NotFound(f"no node {node_id!r} in the policy")
        return rec

    def _others_serving(self, rec: dict[str, Any]) -> list[str]:
        """Ids of the other serving (ramping/active) nodes of ``rec``'s pool."""
        return [r["id"] for r in self.nodes.values()
                if r["pool"] == rec["pool"] and r["id"] != rec["id"] and r["state"] in st.SERVING]

    def drain(self, node_id: str, reason: str = "operator", force: bool = False) -> dict[str, Any]:
        """Stop new keys reaching the node (nginx ``down``: only its keys move to their next
        nodes on the ring) and wait for its in-flight requests in the background.

        Draining a draining or drained node changes nothing (idempotent). The gateway config is
        applied before this returns. Raises NotFound, InvalidTransition, Conflict (the last
        serving node of its pool, unless ``force``), ApplyError (the node is left as it was)."""
        with self.lock:
            rec = self._rec(node_id)
            assert self.policy is not None
            if rec["state"] in (st.DRAINING, st.DRAINED):
                return self.node_view(node_id)
            if rec["state"] in st.SERVING and not force and not self._others_serving(rec):
                raise Conflict(f"{node_id} is the last serving node of pool {rec['pool']!r}: draining it leaves the "
                               "pool without a node and every request to it fails (502); force it (kvgate drain --force, or "
                               "force=true in the API) to do it anyway")
            previous = dict(rec)
            self._transition(rec, st.DRAINING, f"drain requested by {reason}", action="drain")
            now = time.time()
            rec["drain"] = {"started": now, "deadline": now + self.policy.drain.timeout_s, "zero_checks": 0,
                            "inflight_gateway": None, "inflight_engine": None, "timed_out": False}
            rec["ramp"] = None
            self._save(rec)
            try:
                self._apply_runtime(force=True)
            except ApplyError as exc:
                self.nodes[node_id] = previous
                self._save(previous)
                self._event("drain_failed", f"{node_id}: drain not applied, back to {previous['state']}: "
                            f"{str(exc).splitlines()[0]}", node=node_id, pool=previous["pool"])
                raise
            return self.node_view(node_id)

    def undrain(self, node_id: str, reason: str = "operator") -> dict[str, Any]:
        """Bring a draining or drained node back: warming, then ramping. Raises NotFound, InvalidTransition."""
        with self.lock:
            rec = self._rec(node_id)
            st.check(node_id, rec["state"], st.WARMING, action="undrain")
            rec["drain"] = None
            self._start_warming(rec, f"undrain requested by {reason}")
            return self.node_view(node_id)

    def warm(self, node_id: str, reason: str | None = None) -> dict[str, Any]:
        """Run the warm-up on the node now, without changing its state (e.g. a drained node before
        undrain). Raises NotFound; InvalidTransition-like 409 when a warm-up already runs."""
        with self.lock:
            rec = self._rec(node_id)
            running = self._warmups.get(node_id)
            if running and running.is_alive():
                raise Conflict(f"a warm-up of {node_id} is already running; wait for it (`kvgate warm {node_id}` "
                               "waits) or follow it with `kvgate nodes`")
            self._launch_warmup(rec, reason)
            return self.node_view(node_id)

    # ================================================================= views
    def node_view(self, node_id: str, reports: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """One node as the API shows it: the record, its weight in force and its last report."""
        rec = self._rec(node_id)
        reports = reports if reports is not None else (self._reports() or {})
        entry = reports.get(node_id)
        now = time.time()
        weight = self.applied.weights.get(node_id) if self.applied else None
        return {
            **{k: v for k, v in rec.items() if k not in ("engine_start_time_at_eject",)},
            "weight": weight,
            "serving": rec["state"] in st.SERVING,
            "report": entry["report"] if entry else None,
            "report_age_s": round(now - entry["received_at"], 3) if entry else None,
            "inflight_gateway": self._gateway["inflight"].get(node_id, 0.0) if self._gateway.get("ok") else None,
        }

    def nodes_view(self) -> list[dict[str, Any]]:
        with self.lock:
            assert self.policy is not None
            reports = self._reports() or {}
            return [self.node_view(n.id, reports) for n in self.policy.nodes()]

    def pools_view(self) -> list[dict[str, Any]]:
        with self.lock:
            assert self.policy is not None
            out = []
            for pool in self.policy.pools:
                p = self.pools[pool.name]
                out.append({"name": pool.name, "models": pool.models, "balancer": pool.balancer,
                            "balancer_in_force": "least_conn" if p.get("degraded") else pool.balancer,
                            "degraded": bool(p.get("degraded")), "degraded_since": p.get("since") if p.get("degraded") else None,
                            "mean_waiting": p.get("mean_waiting"),
                            "nodes": [n.id for n in pool.nodes],
                            "failovers": self._gateway["failovers"].get(pool.name)})
            return out
