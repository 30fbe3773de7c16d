"""An in-process control plane on a real Redis (its nginx config written, no gateway started):
the reconciler and the views never wait for the operator lock (held, e.g., by the admin page
around a check and an apply while the removal figures are read), a stale base version refuses
an apply, and the records in Redis keep the JSON field names of before."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gwfixtures import free_port
from kvgate.control.plane import ControlPlane, StaleVersion
from kvgate.control.store import Store
from kvgate.nginxctl import Nginx

pytestmark = pytest.mark.integration


def policy_text(redis_url: str, ports: list[int], comment: str = "") -> str:
    nodes = "\n".join(f"  - {{id: n{i + 1}, url: \"http://127.0.0.1:{p}\"}}" for i, p in enumerate(ports))
    return (f"# {comment}\nversion: 1\n"
            f"gateway: {{listen: \"127.0.0.1:{free_port()}\", internal_listen: \"127.0.0.1:{free_port()}\"}}\n"
            f"redis: {{url: \"{redis_url}\", managed: false}}\n"
            f"pools:\n- name: default\n  models: [m]\n  nodes:\n{nodes}\n")


@pytest.fixture
def plane(start_redis, tmp_path: Path):
    redis = start_redis()
    p = ControlPlane(Store(redis.url), Nginx(tmp_path / "nginx"), external_gateway=True)
    p.start(policy_text(redis.url, [free_port(), free_port()]), "test")  # engines that are not there
    yield p
    p.stop()


def ticks(plane: ControlPlane) -> float:
    return plane.metrics.registry.get_sample_value("kvgate_control_ticks_total") or 0.0


def test_views_and_ticks_do_not_wait_for_the_operator_lock(plane: ControlPlane) -> None:
    before = ticks(plane)
    held, release = threading.Event(), threading.Event()

    def operator() -> None:
        with plane.lock:  # what the admin page holds around its base check and the apply
            held.set()
            release.wait(10)

    t = threading.Thread(target=operator)
    t.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        nodes = plane.nodes_view()
        pools = plane.pools_view()
        weights = plane.serving_weights()
        assert time.monotonic() - started < 1.0
        assert [n["id"] for n in nodes] == ["n1", "n2"] and pools[0]["name"] == "default"
        assert weights == {"n1": 100, "n2": 100}
        deadline = time.monotonic() + 10
        while ticks(plane) < before + 2:  # the reconciler goes on meanwhile
            assert time.monotonic() < deadline, "no reconciler round while the operator lock was held"
            time.sleep(0.05)
    finally:
        release.set()
        t.join()


def test_a_stale_base_version_applies_nothing(plane: ControlPlane) -> None:
    v1 = plane.policy_version["version"]
    assert plane.policy_text is not None and plane.policy_text.startswith("# \n")
    edited = plane.policy_text.replace("# \n", "# edited\n", 1)
    out = plane.apply_policy(edited, "test", base_version=v1)
    assert out["changed"] and out["version"] == v1 + 1
    with pytest.raises(StaleVersion) as err:
        plane.apply_policy(edited.replace("# edited", "# again"), "test", base_version=v1)
    assert err.value.running == v1 + 1 and plane.policy_version["version"] == v1 + 1
    assert plane.policy_text == edited


def test_stored_records_keep_their_field_names(plane: ControlPlane) -> None:
    stored = plane.store.nodes()
    assert set(stored) == {"n1", "n2"}
    rec = stored["n1"]
    assert rec["state"] == "active" and rec["reason"] == "initial fleet" and rec["pool"] == "default"
    assert {"base_weight", "target_weight", "health", "ramp", "drain", "warmup", "engine_start_time",
            "resume_state", "has_agent", "last_weight_change"} <= set(rec)
    view = plane.node_view("n1")
    assert view["state"] == "active" and view["serving"] is True and "engine_start_time_at_eject" not in view


def test_views_do_not_wait_for_a_ticks_gateway_apply(plane: ControlPlane) -> None:
    """Review of issue 10 (item 4: views read snapshots, never the plane's lock): a tick holds the
    records' lock across its gateway apply (a reload transaction waits up to 10 s for the new
    config and 10 s more for its runtime; a push sleeps PUSH_SETTLE_S), and the views read the
    snapshot under that lock, so every admin page and API read stalled behind it."""
    entered, release = threading.Event(), threading.Event()
    real = plane.push.nginx.apply

    def slow_apply(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    plane.push.nginx.apply = slow_apply  # type: ignore[method-assign]
    plane.push.applied = None  # the next tick sends the runtime again
    try:
        assert entered.wait(10), "no tick applied the runtime"
        started = time.monotonic()
        nodes = plane.nodes_view()
        pools = plane.pools_view()
        assert time.monotonic() - started < 1.0, "a view waited for the tick's gateway apply"
        assert [n["id"] for n in nodes] == ["n1", "n2"] and pools[0]["name"] == "default"
    finally:
        release.set()
        plane.push.nginx.apply = real  # type: ignore[method-assign]
