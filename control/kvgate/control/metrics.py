"""The control plane's ``kvgate_control_*`` metrics (served at its ``/metrics``)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ..fleet import states as st
from ..fleet.records import NodeRecord


class ControlMetrics:
    """``kvgate_control_*`` metrics on a private registry (no global state: two planes in one
    process, as in tests, keep their own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reloads = Counter("kvgate_control_reloads", "Gateway config applies by result "
                               "(pushed: the runtime went to the running gateway without a reload; reloaded, "
                               "started, written, unchanged, failed).", ["result"], registry=r)
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

    def observe(self, records: Iterable[NodeRecord], reports: Mapping[str, dict[str, Any]], now: float) -> None:
        """The per-node gauges of a reconciler round: state, target weight, report age."""
        for rec in records:
            for s in st.STATES:
                self.state.labels(rec.id, s).set(1 if rec.state == s else 0)
            if rec.target_weight:
                self.target.labels(rec.id).set(rec.target_weight)
            entry = reports.get(rec.id)
            if entry:
                self.report_age.labels(rec.id).set(max(0.0, now - entry["received_at"]))

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
