"""The runtime's way to the gateway (:class:`kvgate.control.push.RuntimePush`): a push is an event
``runtime_pushed`` (not ``reload``) and ``kvgate_control_reloads_total{result="pushed"}``; a
failure is retried only after the back-off. ``Nginx.apply`` is stood in for by a recorder (its
own tests run real nginx: tests/integration/test_control_dynamic.py)."""

from __future__ import annotations

import pytest

from kvgate.control.exceptions import ApplyError
from kvgate.control.metrics import ControlMetrics
from kvgate.control.push import RuntimePush
from kvgate.nginxctl import NginxError
from kvgate.policy.loader import parse_policy
from kvgate.render import Runtime

POLICY = parse_policy({"version": 1, "pools": [{"name": "p", "models": ["m"], "nodes": [
    {"id": "a", "url": "http://127.0.0.1:9001"}]}]})


class Gateway:
    """Answers ``Nginx.apply`` with the next of ``results`` (an exception is raised)."""

    def __init__(self, *results):
        self.results, self.calls = list(results), []

    def apply(self, policy, runtime, start=True):
        self.calls.append((runtime, start))
        r = self.results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


def push_with(*results):
    events: list[tuple[str, str, dict]] = []
    metrics = ControlMetrics()
    gw = Gateway(*results)
    push = RuntimePush(gw, metrics, lambda kind, message, **data: events.append((kind, message, data)), start=False)
    return push, gw, events, metrics


def count(metrics: ControlMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("kvgate_control_reloads_total", {"result": result}) or 0.0


def test_a_push_is_a_runtime_pushed_event() -> None:
    push, gw, events, metrics = push_with("pushed", "reloaded")
    rt = Runtime(weights={"a": 0})
    assert push.apply(POLICY, rt) == "pushed" and push.applied == rt and gw.calls == [(rt, False)]
    assert [(k, m) for k, m, _ in events] == [("runtime_pushed", "gateway runtime pushed (no reload)")]
    assert events[0][2] == {"result": "pushed", "weights": {"a": 0}, "balancers": {}}
    assert count(metrics, "pushed") == 1
    assert metrics.registry.get_sample_value("kvgate_control_node_weight", {"node": "a"}) == 0
    # the same runtime again: nothing sent unless forced
    assert push.apply(POLICY, rt) == "unchanged" and len(gw.calls) == 1
    assert push.apply(POLICY, rt, force=True) == "reloaded"
    assert events[-1][0] == "reload" and events[-1][1] == "gateway config reloaded"


def test_a_failure_is_recorded_and_retried_after_the_back_off() -> None:
    push, gw, events, metrics = push_with(NginxError("nginx -t failed\nline 2"), "pushed")
    rt = Runtime(weights={"a": 100})
    with pytest.raises(ApplyError):
        push.apply(POLICY, rt)
    assert events[0][0] == "reload_failed" and events[0][1].endswith("nginx -t failed")
    assert count(metrics, "failed") == 1 and push.applied is None
    assert push.apply(POLICY, rt) == "failed" and len(gw.calls) == 1  # within the back-off
    assert push.apply(POLICY, rt, force=True) == "pushed"  # operator actions try at once
