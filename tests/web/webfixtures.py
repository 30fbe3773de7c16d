"""Fake services for the in-process web tests (tests/web/conftest.py has the fixtures).

``FakePlane`` has the methods and attributes the views call on the control plane (the same
names as :class:`kvgate.control.plane.ControlPlane`); ``plane.fail(method, exc)`` makes the
next call of ``method`` raise ``exc``, and ``plane.calls`` records what the views asked for, so
a test can assert that a refused request changed nothing.
"""

from __future__ import annotations

import re
import threading
import types
from typing import Any

from kvgate.policy import parse_policy_text
from kvgate.web.admin.history import History

TOKEN = "test-admin-token"

POLICY_YAML = """
gateway: {listen: "127.0.0.1:18080"}
redis: {url: "redis://127.0.0.1:1/0"}
control: {listen: "127.0.0.1:19090"}
pools:
  - name: p1
    models: [m]
    nodes:
      - {id: n1, url: "http://127.0.0.1:18001"}
      - {id: n2, url: "http://127.0.0.1:18002"}
"""


class FakeStore:
    """The part of kvgate.control.store.Store the views use."""

    def __init__(self) -> None:
        self.revoked: set[str] = set()
        self.events_list = [{"id": f"17000000000{i:02d}-0", "ts": 1_700_000_000.0 + i, "kind": "state",
                             "node": "n1", "message": f"event {i}"} for i in range(3)][::-1]
        self.version_list = [{"version": 1, "yaml": POLICY_YAML, "source": "test", "applied_at": 1_700_000_000.0,
                              "digest": "d1"}]

    def ping(self) -> bool:
        return True

    def versions(self) -> list[dict[str, Any]]:
        return list(self.version_list)

    def events(self, limit: int = 100, node: str | None = None, kind: str | None = None,
               before: str | None = None) -> list[dict[str, Any]]:
        evs = [e for e in self.events_list if (node is None or e["node"] == node)
               and (kind is None or e["kind"].startswith(kind))]
        return evs[:limit]

    def session_revoked(self, sid: str) -> bool:
        return sid in self.revoked

    def revoke_session(self, sid: str, ttl_s: int) -> None:
        self.revoked.add(sid)


class FakeMetrics:
    def render(self) -> bytes:
        return b"# TYPE kvgate_control_up gauge\nkvgate_control_up 1.0\n"


class FakeTraffic:
    """Stands in for kvgate.web.admin.fleet.TrafficCache (which reads the request log in Redis)."""

    def get(self, plane: Any, cache_stats: bool = False) -> dict[str, Any]:
        return {"pools": {}, "cache": {"entries": 0, "bytes": 0, "stale_entries": 0, "stale_bytes": 0, "estimated": False}
                if cache_stats else None, "error": None}

    def reset(self) -> None:
        pass


class FakePlane:
    """Fake services for the views; real Policy and History, everything else in memory."""

    def __init__(self) -> None:
        self.policy = parse_policy_text(POLICY_YAML)
        self.policy_version: dict[str, Any] | None = {"version": 1, "yaml": POLICY_YAML, "source": "test",
                                                      "applied_at": 1_700_000_000.0, "digest": "d1"}
        self.store = FakeStore()
        self.metrics = FakeMetrics()
        self.history = History()
        self.lock = threading.RLock()
        self.gateway_ok = True
        self.namespace_in_force = 1
        self.nodes: dict[str, dict[str, Any]] = {
            n.id: {"id": n.id, "pool": "p1", "url": n.url, "state": "active", "reason": "", "since": 1_700_000_000.0,
                   "target_weight": 100, "base_weight": 1}
            for n in self.policy.nodes()}
        self.calls: list[tuple[str, tuple, dict]] = []
        self._fail: dict[str, BaseException] = {}
        # the plane's published state (kvgate.control.views.Snapshot); views read its gateway scrape
        self.snapshot = types.SimpleNamespace(gateway={"ok": True, "breaker": {}})
        # the gateway members (kvgate.control.gateways): one, the plane's own (the Fleet page shows no table)
        self.gateways = types.SimpleNamespace(view=lambda: [{"id": "local", "local": True}], sync_s=lambda: 1.0)

    # -------------------------------------------------------------- test hooks
    def fail(self, method: str, exc: BaseException) -> None:
        """The next call of ``method`` raises ``exc``."""
        self._fail[method] = exc

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        exc = self._fail.pop(method, None)
        if exc is not None:
            raise exc
        self.calls.append((method, args, kwargs))

    def last(self, method: str) -> tuple[str, tuple, dict]:
        """The latest recorded call of ``method``."""
        return [c for c in self.calls if c[0] == method][-1]

    def mutations(self) -> list[str]:
        return [c[0] for c in self.calls if c[0] not in ("node_view", "nodes_view", "pools_view", "validate")]

    # ------------------------------------------------------------------- views
    def node_view(self, node_id: str) -> dict[str, Any]:
        self._call("node_view", node_id)
        from kvgate.control.plane import NotFound

        if node_id not in self.nodes:
            raise NotFound(f"no node {node_id!r}")
        return {**self.nodes[node_id], "weight": 100, "serving": True, "report": None, "report_age_s": None,
                "has_agent": False, "inflight_gateway": 0.0}

    def nodes_view(self) -> list[dict[str, Any]]:
        self._call("nodes_view")
        return [self.node_view(i) for i in self.nodes]

    def pools_view(self) -> list[dict[str, Any]]:
        self._call("pools_view")
        return [{"name": p.name, "models": p.models, "balancer": p.balancer, "balancer_in_force": p.balancer,
                 "degraded": False, "degraded_since": None, "mean_waiting": None,
                 "nodes": [n.id for n in p.nodes], "failovers": 0} for p in self.policy.pools]

    def serving_weights(self) -> dict[str, int]:
        return {i: 100 for i in self.nodes}

    # ----------------------------------------------------------------- actions
    def report(self, node_id: str, report: dict[str, Any]) -> dict[str, Any]:
        self._call("report", node_id)
        return {"ok": True}

    def drain(self, node_id: str, reason: str | None = None, force: bool = False) -> dict[str, Any]:
        self._call("drain", node_id, reason=reason, force=force)
        view = self.node_view(node_id)
        self.nodes[node_id]["state"] = "draining"
        return {**view, "state": "draining"}

    def undrain(self, node_id: str, reason: str | None = None) -> dict[str, Any]:
        self._call("undrain", node_id, reason=reason)
        return self.node_view(node_id)

    def warm(self, node_id: str, reason: str | None = None) -> dict[str, Any]:
        self._call("warm", node_id, reason=reason)
        return self.node_view(node_id)

    files_base: str | None = None  # the running policy's folder (ControlPlane.files_base)

    def validate(self, text: str, files_base: str | None = None):
        self._call("validate")
        return parse_policy_text(text)

    def apply_policy(self, text: str, source: str, force: bool = False, base_version: int | None = None,
                     files_base: str | None = None) -> dict[str, Any]:
        self._call("apply_policy", source=source, force=force)
        parse_policy_text(text)
        return {"version": 2, "changed": True, "result": "reloaded"}

    def rollback(self, version: int, by: str | None = None, force: bool = False) -> dict[str, Any]:
        self._call("rollback", version, by=by, force=force)
        return {"version": 3, "changed": True, "result": "reloaded"}

    def invalidate_cache(self, source: str) -> dict[str, Any]:
        self._call("invalidate_cache", source)
        return {"old": 1, "new": 2, "version": 2, "changed": True, "result": "pushed"}

    def bump_knowledge(self, pool: str, source: str) -> dict[str, Any]:
        self._call("bump_knowledge", pool, source)
        return {"pool": pool, "old": 1, "new": 2, "result": "pushed"}

    def invalidate_tag(self, tag: str, source: str) -> dict[str, Any]:
        self._call("invalidate_tag", tag, source)
        return {"tag": tag, "removed_exact": 0, "removed_semantic": None, "semantic_error": None}

    def event(self, kind: Any, message: str, node: str | None = None, pool: str | None = None,
              **data: Any) -> None:
        self._call("event", str(kind), message)


BEARER = {"Authorization": f"Bearer {TOKEN}"}


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token"[^>]*value="([^"]+)"', html) or re.search(r'value="([^"]+)"[^>]*name="csrf_token"', html)
    assert m, "no CSRF token on the page"
    return m.group(1)
