"""`kvgate bench bill` end to end on a real stack (nginx, Redis, control plane, batch worker,
simulators): a tiny mixed workload, baseline then kvgate, and the bill it writes (issue 16)."""

import json

import pytest
import yaml

from ctlfixtures import MIX_TENANTS, control_fleet  # noqa: F401 - fixture
from kvgate.bench.bill import LEVERS, PARTS

pytestmark = pytest.mark.integration

PRICES = """    prices: {input_usd_per_1m_tokens: 0.20, cached_input_usd_per_1m_tokens: 0.02,
             output_usd_per_1m_tokens: 0.60, batch_discount: 0.5}"""
RUN_KEYS = {"cost_usd", "engine_prefill_tokens", "engine_output_tokens", "requests_failed", "multi_turn_ttft_p50_s",
            "cost_per_ok_usd", "engine_busy_s", "live_ttft_p50_s", "live_ttft_p99_s", "answered_without_engine",
            "rollups"}


def test_bill_on_a_real_stack(control_fleet, tmp_path):  # noqa: F811
    fleet = control_fleet(n=2, balancer="chash_bounded", pool_extra=PRICES, extra=MIX_TENANTS,
                          gateway_extra=", auth: required", sim="time_scale: 0.05, stream_interval: 4")
    before = fleet.api("GET", "/api/v1/policy").json()["yaml"]
    out, chart = tmp_path / "report.json", tmp_path / "bill.png"
    out.write_text(json.dumps({"replay": {"kept": True}}))  # another report's key survives
    r = fleet.kvgate("bench", "bill", "--scale", "0.03", "--speedup", "20", "--json", str(out),
                     "--chart", str(chart), timeout=400)
    # exit 0: nothing failed and the levers add up; the seeds' targets are printed either way
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prefix affinity" in r.stdout and "cost: multi-turn chat" in r.stdout
    assert "✓ failed requests: baseline 0, kvgate 0" in r.stderr and "target: kvgate's cost" in r.stderr
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert data["replay"] == {"kept": True}
    bill = data["bill"]
    b, k = bill["baseline"], bill["kvgate"]
    assert RUN_KEYS <= set(b) and RUN_KEYS <= set(k)
    assert b["requests_failed"] == k["requests_failed"] == 0 and b["requests_ok"] == k["requests_ok"] > 0
    # the engines computed every request of the baseline and fewer prefill tokens under kvgate
    assert b["answered_without_engine"] == {"exact": 0, "semantic": 0, "static": 0}
    assert k["answered_without_engine"]["exact"] > 0  # the FAQ's repeats (no semantic service here)
    assert 0 < k["engine_prefill_tokens"] < b["engine_prefill_tokens"]
    assert k["batch"]["status"] == "completed" and k["batch"]["failed"] == 0 and b["batch"]["id"] is None
    # cost = what the usage rollups (kvgate costs) add; the levers add up to the saving
    assert 0 < k["cost_usd"] < b["cost_usd"]
    assert set(bill["levers"]) == set(LEVERS)
    assert bill["levers"]["batch_discount"] > 0 and bill["levers"]["cache_exact"] > 0
    assert abs(sum(bill["levers"].values()) - bill["saving_usd"]) <= 0.01 * bill["saving_usd"]
    assert bill["cost_ratio"] == round(k["cost_usd"] / b["cost_usd"], 3)
    # the parts add up to each run's cost, each on its own tenants
    assert set(bill["by_part"]) == {p for p, _ in PARTS}
    for run, key in ((b, "baseline_usd"), (k, "kvgate_usd")):
        assert abs(sum(x[key] for x in bill["by_part"].values()) - run["cost_usd"]) < 1e-5
    assert bill["by_part"]["trace"]["tenants"] == ["chat-a", "chat-b"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the running policy is restored (the baseline's round robin and cache off are gone) but for
    # the response cache's namespace, retired once before the kvgate run; the bench's API keys
    # are revoked
    after = yaml.safe_load(fleet.api("GET", "/api/v1/policy").json()["yaml"])
    assert after.pop("cache") == {"namespace_version": 2}
    assert after == yaml.safe_load(before)
    made = [x for x in fleet.api("GET", "/api/v1/keys").json()["keys"] if x["name"].startswith("kvgate bench")]
    assert len(made) == 5 and all(x["revoked"] for x in made), made
