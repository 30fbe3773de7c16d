"""Live weights: load factor, capacities, damping, ramp steps; and how a control-plane
:class:`~kvgate.render.Runtime` renders (``down`` servers, a balancer switch) and passes ``nginx -t``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvgate.control.plane import runtime_for
from kvgate.fleet.weights import (
    CAPACITY_MAX,
    CAPACITY_MIN,
    KV_FREE,
    Damper,
    capacities,
    capacity_of,
    computed_weight,
    load_factor,
    ramp_weight,
)
from kvgate.nginxctl import Nginx
from kvgate.policy.loader import parse_policy
from kvgate.policy.model import WeightsConfig
from kvgate.render import WEIGHT_SCALE, Runtime, default_lua_dir, render, runtime_document

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None and shutil.which("nginx", path="/usr/sbin") is None,
                                 reason="nginx not installed")

CFG = WeightsConfig()  # queue_high 16, kv_high 0.95, min_factor 0.25


def engine(**kw) -> dict:
    return {"engine": kw}


# ------------------------------------------------------------------ load factor
def test_defaults_used_below() -> None:
    assert (CFG.queue_high, CFG.kv_high, CFG.min_factor, CFG.change_threshold, CFG.min_interval_s) == \
        (16.0, 0.95, 0.25, 0.2, 30.0)
    assert WEIGHT_SCALE == 100 and KV_FREE == 0.7


@pytest.mark.parametrize("report", [None, {}, {"engine": None}, engine(), engine(waiting=0, kv_cache_usage=0.0)])
def test_idle_or_unknown_node_has_full_factor(report) -> None:
    assert load_factor(report, CFG) == 1.0


@pytest.mark.parametrize(("waiting", "factor"), [(4, 1 - 0.75 * 0.25), (8, 1 - 0.75 * 0.5), (16, 0.25), (100, 0.25)])
def test_queue_pressure(waiting: float, factor: float) -> None:
    assert load_factor(engine(waiting=waiting, kv_cache_usage=0.0), CFG) == pytest.approx(factor)


@pytest.mark.parametrize("kv", [0.0, 0.3, 0.5, 0.69, 0.7])
def test_kv_use_below_0_7_costs_nothing(kv: float) -> None:
    assert load_factor(engine(waiting=0, kv_cache_usage=kv), CFG) == 1.0


@pytest.mark.parametrize(("kv", "factor"), [(0.825, 0.625), (0.95, 0.25), (1.0, 0.25)])
def test_kv_pressure_mid_and_full(kv: float, factor: float) -> None:
    assert load_factor(engine(waiting=0, kv_cache_usage=kv), CFG) == pytest.approx(factor)


def test_pressure_is_the_worse_of_queue_and_kv() -> None:
    # queue at 1/4 (factor 0.8125), KV at 1/2 (0.625): the KV side wins, and the other way round
    assert load_factor(engine(waiting=4, kv_cache_usage=0.825), CFG) == pytest.approx(0.625)
    assert load_factor(engine(waiting=12, kv_cache_usage=0.825), CFG) == pytest.approx(1 - 0.75 * 0.75)


def test_load_factor_clamps_and_follows_config() -> None:
    assert load_factor(engine(waiting=-5), CFG) == 1.0  # nonsense below zero counts as idle
    cfg = WeightsConfig(queue_high=4, min_factor=0.5)
    assert load_factor(engine(waiting=2), cfg) == pytest.approx(0.75)
    assert load_factor(engine(waiting=400), cfg) == pytest.approx(0.5)
    # kv_high at (or below) the free mark: KV use never counts (no division by zero)
    assert load_factor(engine(kv_cache_usage=1.0), WeightsConfig(kv_high=0.7)) == 1.0
    assert load_factor(engine(kv_cache_usage=1.0), WeightsConfig(kv_high=0.5)) == 1.0


# ------------------------------------------------------------------ capacity
def gpu(*totals: int, status: str = "ok", blocks: int | None = None) -> dict:
    rep: dict = {"gpu": {"status": status, "devices": [{"memory_total_bytes": t} for t in totals]}}
    if blocks is not None:
        rep["engine"] = {"num_gpu_blocks": blocks}
    return rep


def blocks(n: int | None) -> dict:
    return {"gpu": {"status": "unavailable", "reason": "NVML Shared Library Not Found"},
            "engine": {"num_gpu_blocks": n}}


def test_capacity_figure_of_one_node() -> None:
    assert capacity_of(None) is None and capacity_of({}) is None
    assert capacity_of(gpu(80 * 2**30, 80 * 2**30)) == 160 * 2**30  # summed over the node's GPUs
    assert capacity_of(blocks(65536)) == 65536.0
    assert capacity_of(blocks(None)) is None
    assert capacity_of(gpu(80 * 2**30, blocks=1000)) == 80 * 2**30  # GPU memory wins over blocks
    assert capacity_of(gpu(status="ok", blocks=1000)) == 1000.0  # no devices: falls back to blocks


def test_capacities_from_gpu_memory() -> None:
    caps = capacities({"a": gpu(80 * 2**30), "b": gpu(40 * 2**30), "c": gpu(40 * 2**30, 80 * 2**30)})
    mean = (80 + 40 + 120) / 3
    assert caps == pytest.approx({"a": 80 / mean, "b": 40 / mean, "c": 120 / mean})


def test_capacities_from_kv_blocks() -> None:
    caps = capacities({"a": blocks(30000), "b": blocks(10000), "c": blocks(None)})
    assert caps == pytest.approx({"a": 1.5, "b": 0.5, "c": 1.0})  # c has no figure: neutral


def test_mixed_kinds_are_not_compared() -> None:
    caps = capacities({"a": gpu(80 * 2**30), "b": blocks(65536), "c": None})
    assert caps == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_gpu_without_memory_figure_counts_as_blocks() -> None:
    # NVML answers but reports no memory: the node's figure is its KV blocks, so it is
    # compared with the other block figures (not with bytes)
    caps = capacities({"a": gpu(status="ok", blocks=30000), "b": blocks(10000)})
    assert caps == pytest.approx({"a": 1.5, "b": 0.5})
    # ...and a pool mixing it with real GPU-memory figures is mixed
    assert capacities({"a": gpu(status="ok", blocks=30000), "b": gpu(80 * 2**30)}) == {"a": 1.0, "b": 1.0}


def test_capacities_clamp() -> None:
    reports = {f"s{i}": blocks(1000) for i in range(9)} | {"big": blocks(1_000_000)}
    caps = capacities(reports)
    assert caps["big"] == CAPACITY_MAX == 4.0
    assert all(caps[f"s{i}"] == CAPACITY_MIN == 0.25 for i in range(9))


def test_capacities_without_figures() -> None:
    assert capacities({}) == {}
    assert capacities({"a": None, "b": {}}) == {"a": 1.0, "b": 1.0}


def test_computed_weight() -> None:
    assert computed_weight(1, 1.0, 1.0) == 100
    assert computed_weight(3, 1.5, 0.5) == 225
    assert computed_weight(1, 0.25, 0.25) == 6
    assert computed_weight(1, 0.0, 0.0) == 1  # never 0: 0 means down


# ------------------------------------------------------------------ damper
def test_damper_first_weight_is_accepted() -> None:
    d = Damper(CFG)
    assert d.accept(None, 37, now=1000.0, last_change=999.0)
    assert d.accept(0, 37, now=1000.0, last_change=999.0)


@pytest.mark.parametrize("computed", [100, 81, 119, 120, 80])
def test_damper_refuses_changes_within_the_threshold(computed: int) -> None:
    assert not Damper(CFG).accept(100, computed, now=1e6, last_change=None)


def test_damper_refuses_a_big_change_too_soon_after_the_last() -> None:
    d = Damper(CFG)
    assert not d.accept(100, 50, now=1000.0, last_change=1000.0 - 29.9)
    assert not d.accept(100, 200, now=1000.0, last_change=1000.0 - 1)


def test_damper_accepts_a_big_change_after_the_interval() -> None:
    d = Damper(CFG)
    assert d.accept(100, 50, now=1000.0, last_change=None)
    assert d.accept(100, 121, now=1000.0, last_change=1000.0 - 30.0)
    assert d.accept(100, 79, now=1000.0, last_change=1000.0 - 31.0)


def test_damper_follows_config() -> None:
    d = Damper(WeightsConfig(change_threshold=0.0, min_interval_s=0))
    assert d.accept(100, 101, now=5.0, last_change=5.0)
    assert not d.accept(100, 100, now=5.0, last_change=None)


# ------------------------------------------------------------------ ramp
@pytest.mark.parametrize(("target", "fraction", "weight"),
                         [(100, 0.25, 25), (100, 1.0, 100), (300, 0.1, 30), (1, 0.1, 1), (3, 0.1, 1), (2, 0.5, 1)])
def test_ramp_weight(target: int, fraction: float, weight: int) -> None:
    assert ramp_weight(target, fraction) == weight
    assert ramp_weight(target, fraction) >= 1


# ------------------------------------------------------------------ runtime and render
def _policy(**pool):
    p = {"name": "p1", "models": ["m1"], "nodes": [
        {"id": "a", "url": "http://127.0.0.1:9001", "weight": 2},
        {"id": "b", "url": "http://127.0.0.1:9002"},
        {"id": "c", "url": "http://127.0.0.1:9003"},
    ]}
    p.update(pool)
    return parse_policy({"version": 1, "pools": [p], "ramp": {"steps": [0.25, 0.5, 1.0]}})


def _upstream(conf: str, name: str = "pool_p1") -> str:
    # up to the block's own closing brace (a balancer_by_lua_block has braces inside)
    m = re.search(r"upstream " + name + r" \{(.*?)\n    \}", conf, re.S)
    assert m, conf
    return m.group(1)


def rec(node_id: str, state: str, base: int = 1, target: int | None = None, **kw) -> dict:
    return {"id": node_id, "state": state, "base_weight": base, "target_weight": target, **kw}


def test_runtime_for_a_fresh_fleet_is_the_base_weights() -> None:
    rt = runtime_for(_policy(), {}, {})
    assert dict(rt.weights) == {"a": 200, "b": 100, "c": 100} and dict(rt.balancers) == {}


def test_runtime_for_states() -> None:
    records = {
        "a": rec("a", "active", base=2, target=180),
        "b": rec("b", "ramping", target=100, ramp={"step": 1}),
        # c has no record while others do: it is joining (0)
    }
    rt = runtime_for(_policy(), records, {"p1": {"degraded": True}})
    assert dict(rt.weights) == {"a": 180, "b": 50, "c": 0}
    assert dict(rt.balancers) == {"p1": "least_conn"}
    # the home ring's weights: the serving weights (kvgate.fleet.weights.serving_weights); the states
    assert dict(rt.home_weights) == {"a": 180, "b": 50, "c": 100}
    assert dict(rt.states) == {"a": "active", "b": "ramping", "c": "joining"}
    drained = runtime_for(_policy(), {**records, "a": rec("a", "drained", base=2, target=180)}, {})
    assert (drained.weights["a"], drained.home_weights["a"], drained.states["a"]) == (0, 180, "drained")
    assert dict(runtime_for(_policy(), {}, {}).states) == {"a": "active", "b": "active", "c": "active"}
    for state in ("joining", "warming", "draining", "drained", "ejected"):
        assert runtime_for(_policy(), {"b": rec("b", state, target=100)}, {}).weights["b"] == 0
    # a base weight that changed in the policy overrides a stale stored target
    assert runtime_for(_policy(), {"a": rec("a", "active", base=1, target=100)}, {}).weights["a"] == 200
    # ramp step past the end is the last step
    assert runtime_for(_policy(), {"b": rec("b", "ramping", target=80, ramp={"step": 9})}, {}).weights["b"] == 80


def test_weight_zero_renders_down() -> None:
    # weights are the runtime's (pushed to the gateway, conf/runtime.json), never nginx.conf's
    runtime = Runtime(weights={"a": 150, "b": 0})
    files = render(_policy(), default_lua_dir(), runtime)
    assert files == render(_policy(), default_lua_dir())
    up = _upstream(files["conf/nginx.conf"])
    assert "weight=" not in up and " down" not in up
    assert re.search(r"^\s*server 127\.0\.0\.1:9002;", up, re.M), up
    nodes = runtime_document(_policy(), runtime)["pools"]["p1"]["nodes"]
    assert nodes["a"] == {"weight": 150, "state": "active", "home_weight": 150}
    assert nodes["b"] == {"weight": 0, "state": "down", "home_weight": 100}
    # c is not in the runtime: its policy weight × WEIGHT_SCALE
    assert nodes["c"]["weight"] == 100
    assert {n: v["weight"] for n, v in nodes.items()} == {"a": 150, "b": 0, "c": 100}


def test_balancer_override_renders_least_conn() -> None:
    # every balancer runs in Lua, chosen by name from the runtime: the override is pushed
    files = render(_policy(), default_lua_dir(), Runtime(balancers={"p1": "least_conn"}))
    up = _upstream(files["conf/nginx.conf"])
    assert "least_conn;" not in up and "hash " not in up and 'require("kvgate.balancer").balance("p1")' in up
    assert runtime_document(_policy(), Runtime(balancers={"p1": "least_conn"}))["pools"]["p1"]["balancer"] == "least_conn"
    # without the override the policy's (default) chash_bounded is in force (the Lua ring)
    assert runtime_document(_policy())["pools"]["p1"]["balancer"] == "chash_bounded"
    assert json.loads(files["conf/kvgate.json"])["pools"]["p1"]["balancer"] == "chash_bounded"  # the default only
    assert 'require("kvgate.balancer").balance("p1")' in _upstream(
        render(_policy(), default_lua_dir())["conf/nginx.conf"])


@needs_nginx
def test_nginx_accepts_a_runtime_with_down_nodes_and_least_conn(tmp_path: Path) -> None:
    runtime = Runtime(weights={"a": 1, "b": 0, "c": 0}, balancers={"p1": "least_conn"})
    Nginx(tmp_path / "prefix").test(render(_policy(), default_lua_dir(), runtime))
    Nginx(tmp_path / "prefix").test(render(_policy(), default_lua_dir(), Runtime(weights={"a": 0, "b": 37, "c": 400})))
