"""Policy versions on a running control plane: validate, apply (one transaction), rollback,
cache invalidation, and the "node still has work" refusal of a policy that removes nodes.

Each applied policy text is a version in the store (``kvgate:control:versions``, newest last,
``control.versions_kept``); applying the text in force again is no new version. The functions
take the :class:`~kvgate.control.plane.ControlPlane` whose policy they change; its methods of
the same names call them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping

from ..fleet import states as st
from ..fleet.changes import Event, event
from ..fleet.events import EventKind
from ..fleet.records import NodeRecord, PoolState, new_record, node_records
from ..nginxctl import NginxError
from ..policy import PolicyError, PolicyIssue, parse_policy_text
from ..policy.model import Policy
from ..policy.tls import relative_tls, resolve_tls, tls_problems
from . import probes
from .exceptions import ApplyError, NodeHasWork, NotFound, StaleVersion
from .store import StoreError

if TYPE_CHECKING:
    from .plane import ControlPlane

log = logging.getLogger("kvgate.control")


def load(plane: ControlPlane, policy_text: str | None, source: str, files_base: str | None = None) -> None:
    """Load the plane's state from its store and make a policy current (the caller holds the
    plane's locks; see :meth:`kvgate.control.plane.ControlPlane.start`).

    ``policy_text`` (the ``--policy`` file) is applied when it differs from the file applied at
    the previous start; when the file is unchanged, the latest applied version stays (a policy
    applied through the API survives a restart). Without a file, the latest version is used.
    ``files_base``: the ``--policy`` file's folder (its relative ``static_answers``); a stored
    version brings its own.
    Raises PolicyError, StoreError, ApplyError, ValueError (no policy anywhere)."""
    latest = plane.store.latest_version()
    file_digest = hashlib.sha256(policy_text.encode()).hexdigest() if policy_text is not None else None
    if policy_text is None or (latest and plane.store.get("startup_file_digest") == file_digest):
        if latest is None:
            raise ValueError("no policy: pass --policy (nothing was applied before in this Redis)")
        policy_text, source = latest["yaml"], f"restart (version {latest['version']})"
        files_base = latest.get("files_base")
    plane.nodes = node_records(plane.store.nodes())
    plane.namespace_floor = int(plane.store.get("cache_namespace_max") or 0)
    from .semcache import load_floor

    plane.knowledge_floor = load_floor(plane)
    if latest and latest["yaml"] == policy_text:
        policy = resolve_tls(parse_policy_text(policy_text, f"version {latest['version']}"),
                             latest.get("files_base") or files_base)
        plane.apply(adopt(plane, policy, policy_text))
        plane.policy_version = latest
        plane.files_base = latest.get("files_base") or files_base
        plane.apply_runtime(force=True)
    else:
        apply_policy(plane, policy_text, source, files_base=files_base)
    if file_digest:
        plane.store.set("startup_file_digest", file_digest)


def work_text(b: dict[str, Any]) -> str:
    """``draining, 10 request(s) in flight: 10 at the gateway, 9 at the engine`` for a
    :class:`NodeHasWork` entry."""
    def num(v: float | None) -> str:
        return "?" if v is None else f"{v:.0f}"

    return (f"{b['state']}, {b['inflight']} request(s) in flight: {num(b['inflight_gateway'])} at the "
            f"gateway, {num(b['inflight_engine'])} at the engine")


def removal_refusal(busy: list[dict[str, Any]]) -> str:
    """The 409 message for nodes with work (without the "policy not applied: " head)."""
    ids = [b["id"] for b in busy]
    what = ", ".join(f"{b['id']} ({work_text(b)})" for b in busy)
    one = len(busy) == 1
    return (f"node{'' if one else 's'} {what} still {'has' if one else 'have'} work; drain "
            f"{'it' if one else 'them'} first and wait for the drain "
            f"({'; '.join(f'`kvgate drain {i} --wait`' for i in ids)}), then apply again, or force the "
            "removal (`kvgate apply --force`, `?force=true` in the API): keys move at once and requests in "
            "flight are left to end on the node. The running config keeps serving")


def removal_work(nodes: Mapping[str, NodeRecord], policy: Policy, figures: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The nodes ``policy`` removes that still have work, in the shape of :class:`NodeHasWork`.

    A node has work when requests are in flight on it — at the gateway
    (``kvgate_upstream_inflight``) or at the engine (running + waiting), whatever its state,
    an ``active`` node with traffic included: drain it first — or when it is ``draining``
    (its drain has not confirmed it idle yet). A count that cannot be read is not held
    against it. ``figures``: from :func:`removal_figures` (None: nothing read; a node
    removed since is judged on its state)."""
    wanted = {n.id for n in policy.nodes()}
    snap = (figures or {}).get("gateway") or {}
    busy = []
    for node_id, rec in nodes.items():
        if node_id in wanted:
            continue
        g = snap["inflight"].get(node_id, 0.0) if snap.get("ok") else None
        e = ((figures or {}).get("engine") or {}).get(node_id, (None, None))[0]
        known = [c for c in (g, e) if c is not None]
        inflight = int(max(known)) if known else 0
        if inflight > 0 or rec.state == st.DRAINING:
            busy.append({"id": node_id, "state": rec.state, "inflight": inflight,
                         "inflight_gateway": g, "inflight_engine": e})
    return busy


def removal_figures(plane: ControlPlane, text: str) -> dict[str, Any] | None:
    """In-flight figures of the nodes ``text`` would remove, read now (network I/O, on the plane's
    snapshot: no lock is taken): ``{"gateway": <probes.fetch_gateway snapshot>, "engine": {node
    id: probes.engine_inflight(url)}}``, or None when it removes none (or does not parse: the
    apply then refuses it anyway)."""
    snap = plane.snapshot
    if snap.policy is None:
        return None
    try:
        wanted = {n.id for n in parse_policy_text(text, "policy").nodes()}
    except Exception:  # noqa: BLE001 - the apply reports what is wrong with it
        return None
    removed = {node_id: rec.url for node_id, rec in snap.nodes.items() if node_id not in wanted}
    if not removed:
        return None
    with ThreadPoolExecutor(max_workers=min(16, len(removed))) as ex:
        engine = dict(zip(removed, ex.map(probes.engine_inflight, removed.values())))
    return {"gateway": probes.fetch_gateway(plane.http, snap.policy.gateway.internal_listen), "engine": engine}


def check_restart_fields(current: Policy, policy: Policy) -> None:
    """Refuse, through the API, changes a running control plane cannot make to itself:
    its own address and its Redis (``kvgate up`` restarts it for those). Raises PolicyError."""
    issues = []
    if policy.control.listen != current.control.listen:
        issues.append(PolicyIssue("control.listen", "the running control plane cannot move to another address; "
                                  "apply this policy with `kvgate up` (it restarts the control plane)"))
    if (policy.control.tls is None) != (current.control.tls is None):
        issues.append(PolicyIssue("control.tls", "the running control plane cannot switch between HTTP and HTTPS; "
                                  "apply this policy with `kvgate up` (it restarts the control plane)"))
    if policy.redis.client_url != current.redis.client_url:
        issues.append(PolicyIssue("redis.url", "the running control plane keeps its state in the current Redis; "
                                  "apply this policy with `kvgate up` (it restarts the control plane)"))
    if issues:
        raise PolicyError("policy", issues)


def files_base_of(plane: ControlPlane, files_base: str | None) -> str | None:
    """The folder a policy's relative file names are read from: ``files_base`` (the folder of
    the file applied: ``kvgate apply FILE`` sends it), else the running policy's (a text without a
    file, such as the admin page's editor, names files as the running policy does), else None."""
    return files_base or plane.files_base


def check_files(policy: Policy, files_base: str | None) -> Policy:
    """The pools' ``semantic.static_answers`` files read and validated (relative names against
    ``files_base``), and the ``gateway.tls`` / ``control.tls`` pairs (:mod:`kvgate.policy.tls`), as
    ``kvgate validate`` does. Returns ``policy`` with its relative TLS paths made absolute
    (:func:`kvgate.policy.tls.resolve_tls`). Raises PolicyError naming
    ``pools[i].semantic.static_answers`` and the file's row or field, or the TLS field."""
    from pathlib import Path

    from ..policy.loader import static_answers_issues

    issues: list[PolicyIssue] = []
    unplaced = [i for i, p in enumerate(policy.pools)
                if p.semantic.static_answers and not Path(p.semantic.static_answers).is_absolute()]
    if files_base is None and unplaced:
        issues = [PolicyIssue(f"pools[{i}].semantic.static_answers",
                              f"{policy.pools[i].semantic.static_answers}: a relative path, but no folder is known to "
                              "read it from: apply the policy file (`kvgate apply FILE`: relative to FILE's folder) "
                              "or name the file by an absolute path") for i in unplaced]
    else:
        issues = static_answers_issues(policy, Path(files_base or "/"))
    policy = resolve_tls(policy, files_base)
    issues += [PolicyIssue(p, r) for p, r in tls_problems(policy)]  # gateway.tls, control.tls (docs/tls.md)
    if issues:
        raise PolicyError("policy", issues)
    return policy


def validate(plane: ControlPlane, text: str, files_base: str | None = None) -> Policy:
    """Parse and check a policy text, including its static answers files (relative to
    :func:`files_base_of`), ``nginx -t`` of its render and the fields a running control plane
    cannot change (its address, its Redis). Raises PolicyError (field paths) or ApplyError (nginx
    refused the rendered config)."""
    from ..render import render

    policy = parse_policy_text(text, "policy")
    if plane.policy is not None:
        check_restart_fields(plane.policy, policy)
    policy = check_files(policy, files_base_of(plane, files_base))
    try:
        plane.nginx.test(render(policy, plane.nginx.lua_dir, plane.applied))
    except (NginxError, ValueError) as exc:
        raise ApplyError(str(exc)) from None
    return policy


def adopt(plane: ControlPlane, policy: Policy, text: str) -> list[Event]:
    """Make ``policy`` current (the caller holds the plane's locks): create records for new
    nodes (``active`` in a fresh fleet, else ``joining``), drop removed ones, keep the pools'
    states. Returns the ``node_added`` / ``node_removed`` events, for the caller to record (or
    drop, when the policy is refused after all)."""
    first = not plane.nodes
    wanted = {n.id for n in policy.nodes()}
    pending = []
    for node_id in list(plane.nodes):
        if node_id not in wanted:
            plane.nodes.pop(node_id)
            plane.store.delete_node(node_id)
            plane.metrics.forget_node(node_id)
            plane.history.forget(node_id)
            pending.append(event(EventKind.NODE_REMOVED, f"{node_id}: removed from the policy", node=node_id))
    now = time.time()
    for pool in policy.pools:
        for node in pool.nodes:
            rec = plane.nodes.get(node.id)
            if rec is None:
                state, reason = (st.ACTIVE, "initial fleet") if first else (st.JOINING, "added to the policy")
                rec = new_record(node.id, pool.name, node.url, node.weight, state, reason, now)
                pending.append(event(EventKind.NODE_ADDED, f"{node.id}: {reason}, state {state}", node=node.id,
                                     pool=pool.name))
            rec = rec.evolve(pool=pool.name, url=node.url)
            plane.nodes[node.id] = rec
            plane.put_record(rec)
    plane.pools = {p.name: plane.pools.get(p.name)
                   or PoolState.from_json(plane.store.pools([p.name]).get(p.name)) for p in policy.pools}
    plane.policy = policy
    plane.policy_text = text
    return pending


def apply_policy(plane: ControlPlane, text: str, source: str, force: bool = False,
                 base_version: int | None = None, files_base: str | None = None) -> dict[str, Any]:
    """Validate and apply a policy as one transaction.

    ``files_base``: the folder of the policy file applied (absolute), where its relative
    ``static_answers`` are read from; None (a text without a file: the admin page's editor, an
    API client that sends no ``X-Kvgate-Policy-Dir``) keeps the running policy's folder. The files
    are validated before anything changes, and the folder is recorded with the version (the
    semantic service reads the files from it).

    A policy that drops a node that still has work (:func:`removal_work`, on figures read
    before any lock of the plane is taken here) is refused unless ``force``; a forced removal
    says in its ``node_removed`` event what was in flight.

    ``base_version``: the version the text was edited from; when another one runs by the time
    the plane's locks are taken, nothing is applied (a check and an apply in one critical section
    without the caller holding ``plane.lock`` over the figures' I/O).

    Returns ``{"version": n, "result": "pushed"|"reloaded"|"unchanged"|..., "changed": bool}``.

    Raises:
        StaleVersion: ``base_version`` is not the running version (nothing changed).
        PolicyError: invalid (nothing changed; counted as ``invalid``).
        NodeHasWork: it would remove a node with work (nothing changed; counted as ``refused``).
        ApplyError: nginx refused the rendered config or failed to reload (the running
            config keeps serving; an event and ``kvgate_control_reloads_total{result="failed"}``).
        StoreError: Redis is unreachable (refused: the version could not be recorded).
    """
    figures = removal_figures(plane, text)  # network I/O, before any lock of the plane is taken here
    with plane.lock, plane.changing():
        running = (plane.policy_version or {}).get("version")
        if base_version is not None and running is not None and base_version != running:
            raise StaleVersion(f"the running policy changed to version {running} since version {base_version} "
                               "was loaded: review the change against it, then apply again", running)
        if plane.policy is not None and not plane.store.ping():
            # applied but recorded nowhere, it could neither be listed nor rolled back
            raise StoreError("Redis is unreachable: policy changes are refused until the control plane can "
                             "record them as versions (the running policy keeps serving)")
        try:
            policy = parse_policy_text(text, "policy")
            if plane.policy is not None:
                check_restart_fields(plane.policy, policy)
            files_dir = files_base_of(plane, files_base)
            tls_relative = relative_tls(policy)
            policy = check_files(policy, files_dir)  # its relative TLS paths made absolute
        except PolicyError as exc:
            plane.metrics.policy_applies.labels("invalid").inc()
            plane.event(EventKind.POLICY_REJECTED, f"policy from {source} rejected: "
                        + "; ".join(str(i) for i in exc.issues[:5])
                        + (f" (+{len(exc.issues) - 5} more)" if len(exc.issues) > 5 else ""),
                        issues=[{"path": i.path, "reason": i.reason} for i in exc.issues])
            raise
        busy = removal_work(plane.nodes, policy, figures) if plane.policy is not None else []
        if busy and not force:
            plane.metrics.policy_applies.labels("refused").inc()
            message = removal_refusal(busy)
            plane.event(EventKind.POLICY_REJECTED, f"policy from {source} refused: {message.split('; ')[0]}",
                        nodes=busy)
            raise NodeHasWork(f"policy not applied: {message}", busy)
        # records are replaced, never changed in place: shallow copies restore them
        old = (plane.policy, plane.policy_text, dict(plane.nodes), dict(plane.pools))
        try:
            pending = adopt(plane, policy, text)
            for rec in list(plane.nodes.values()):
                base = policy.node(rec.id).weight
                if rec.base_weight != base:
                    plane.nodes[rec.id] = rec.evolve(base_weight=base, target_weight=None)
            plane.update_targets(time.time())
            result = plane.apply_runtime(force=True)
        except (ApplyError, StoreError) as exc:
            # nothing of the refused policy stays: memory, Redis records and nginx as before
            if isinstance(exc, ApplyError):
                plane.metrics.policy_applies.labels("failed").inc()
                plane.event(EventKind.POLICY_REJECTED, f"policy from {source} not applied: {str(exc).splitlines()[0]}")
            plane.policy, plane.policy_text, plane.nodes, plane.pools = old
            for rec in plane.nodes.values():
                plane.put_record(rec)
            for node_id in {n.id for n in policy.nodes()} - set(plane.nodes):
                try:  # records adopt created for the refused policy's new nodes
                    plane.store.delete_node(node_id)
                except StoreError as store_exc:
                    log.warning("%s", store_exc)
            raise
        forced = {b["id"]: b for b in busy}
        for ev in pending:
            message = ev.message
            if ev.kind == EventKind.NODE_REMOVED and ev.node in forced:
                message += f" (forced while it still had work: {work_text(forced[ev.node])})"
            plane.event(ev.kind, message, ev.node, ev.pool, **ev.data)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        relative = tls_relative or any(p.semantic.static_answers and not os.path.isabs(p.semantic.static_answers)
                                       for p in policy.pools)
        try:
            latest = plane.store.latest_version()
            # the same text from another folder names other files: a new version
            changed = not latest or latest["yaml"] != text or (relative and latest.get("files_base") != files_dir)
            if changed:
                plane.policy_version = plane.store.add_version(text, digest, source, keep=policy.control.versions_kept,
                                                               files_base=files_dir)
                plane.event(EventKind.POLICY_APPLIED, f"policy version {plane.policy_version['version']} applied "
                            f"from {source} (nginx {result})", version=plane.policy_version["version"])
            else:
                plane.policy_version = latest
        except StoreError as exc:
            # nginx already runs the new policy: say so, even though its version is not recorded
            log.warning("policy applied but not recorded as a version: %s", exc)
            changed = True
            plane.policy_version = {"version": None, "yaml": text, "digest": digest, "source": source,
                                    "applied_at": time.time(), "files_base": files_dir}
        plane.files_base = files_dir
        plane.metrics.policy_applies.labels("applied").inc()
        write_running_copy(plane, text)
        return {"version": plane.policy_version["version"], "result": result, "changed": changed}


def invalidate_cache(plane: ControlPlane, source: str) -> dict[str, Any]:
    """Invalidate the whole response cache at once: apply the running policy with
    ``cache.namespace_version`` one above the version in force (``plane.namespace_in_force``;
    a new policy version, the operator's comments kept). Every cache key carries the version
    (``kvgate:resp:v<N>:...``, lua/kvgate/cache_key.lua), so old entries are never read again
    and expire by their TTL.

    Returns ``{"old": n, "new": n + 1, "version": policy version, "result": nginx result}``.
    Raises PolicyError, ApplyError (nothing changed), StoreError (Redis unreachable: refused),
    ValueError (no policy yet)."""
    from ..policy.edit import bump_namespace_version

    with plane.lock:
        text = plane.policy_text
        if plane.policy is None or text is None:
            raise ValueError("no policy is applied yet")
        old = plane.namespace_in_force
        new_text, new = bump_namespace_version(text, at_least=old + 1)
        result = apply_policy(plane, new_text, source)
        plane.event(EventKind.CACHE_INVALIDATED, f"response cache invalidated by {source}: namespace version "
                    f"{old} → {new} (policy version {result['version']})", old=old, new=new,
                    version=result["version"])
        return {"old": old, "new": new, **result}


def rollback(plane: ControlPlane, version: int, by: str | None = None, force: bool = False) -> dict[str, Any]:
    """Apply a stored version again (as a new version). Raises NotFound, PolicyError, NodeHasWork
    (unless ``force``), ApplyError, StoreError. The namespace version in force does not go back
    (see ``plane.namespace_in_force``)."""
    for v in plane.store.versions():
        if v["version"] == version:
            return apply_policy(plane, v["yaml"], f"rollback to version {version}" + (f" by {by}" if by else ""),
                                force=force, files_base=v.get("files_base"))
    raise NotFound(f"no stored policy version {version}")


def write_running_copy(plane: ControlPlane, text: str) -> None:
    """Keep ``run_dir/policy.yaml`` (what ``kvgate up``/``status`` read) in step with the API,
    and the folder its relative file names are read from (``files_base`` in ``state.json``)."""
    if not plane.run_dir or not (plane.run_dir / "policy.yaml").exists():
        return
    tmp = plane.run_dir / "policy.yaml.api"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, plane.run_dir / "policy.yaml")
    from ..rundir import RunDir

    RunDir(plane.run_dir).record_files_base(plane.files_base)
