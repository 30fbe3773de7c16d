"""docs/grafana/kvgate-costs.json (issue 13 item 5): a Grafana dashboard whose queries name only
counters the gateway exports (lua/kvgate/metrics.lua) with labels they carry, every panel on the
``$datasource`` variable (a Prometheus data source chosen at import), panels not overlapping."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASH = json.loads((ROOT / "docs/grafana/kvgate-costs.json").read_text())

LABELS = {  # the issue 13 contract (CONTRACT: Gateway Prometheus counters) and kvgate_requests_total's labels
    "kvgate_tokens_total": {"tenant", "pool", "kind"},
    "kvgate_tokens_avoided_total": {"tenant", "pool", "kind"},
    "kvgate_cost_usd_total": {"tenant", "pool"},
    "kvgate_saved_usd_total": {"tenant", "pool", "lever"},
    "kvgate_requests_total": {"tenant", "pool", "node", "status", "cache", "route_key_kind"},
}
SELECTOR = re.compile(r"(kvgate_[a-z_]+)(\{([^}]*)\})?")


def exprs() -> list[str]:
    return [t["expr"] for p in DASH["panels"] for t in p["targets"]]


def test_the_metrics_exist_on_the_gateway_with_those_labels():
    exported = set(re.findall(r"^\s*(kvgate_[a-z_]+)\s*=\s*\{", (ROOT / "lua/kvgate/metrics.lua").read_text(), re.M))
    used = set()
    for e in exprs():
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        for name, _sel, body in SELECTOR.findall(e):
            used.add(name)
            assert name in exported, name
            for label in re.findall(r"([a-z_]+)\s*=~?", body or ""):
                assert label in LABELS[name], (name, label)
        for by in re.findall(r"by \(([^)]*)\)", e):
            metric = SELECTOR.search(e[e.index(by):]).group(1)
            assert {b.strip() for b in by.split(",")} <= LABELS[metric], (e, by)
    assert used == set(LABELS)


def test_every_panel_on_the_prometheus_datasource_variable():
    var = {v["name"]: v for v in DASH["templating"]["list"]}
    assert var["datasource"]["type"] == "datasource" and var["datasource"]["query"] == "prometheus"
    for p in DASH["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    for name in ("tenant", "pool"):
        assert var[name]["datasource"]["uid"] == "${datasource}" and var[name]["allValue"] == ".*"


def test_the_panels_the_issue_asks_for_and_no_overlap():
    titles = [p["title"] for p in DASH["panels"]]
    for want in ("Cost rate by tenant", "Savings by lever", "Tokens by kind", "Cache-hit share",
                 "Cost per successful request"):
        assert any(t.startswith(want) for t in titles), want
    ids = [p["id"] for p in DASH["panels"]]
    assert len(set(ids)) == len(ids) and DASH["uid"] == "kvgate-costs"
    cells = set()
    for p in DASH["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
