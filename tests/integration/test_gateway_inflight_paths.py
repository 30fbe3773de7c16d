"""The in-flight gauge comes back to 0 on every path a request can take (review of issue 10:
the count is taken by the balancer, moved by a failover and released in the log phase or in
@kvgate_upstream_error): a cache hit, a request refused before the balancer, a failover to the
next node, and every node failing (nginx's own 502 through the error location)."""

from __future__ import annotations

import requests

from gwfixtures import Gateway, _wait, wait_cached

GAUGE = "kvgate_upstream_inflight"


def _gauge(gw: Gateway) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in gw.metrics().items():
        if key.startswith(GAUGE + "{"):
            node = key.split('node="', 1)[1].split('"', 1)[0]
            out[node] = out.get(node, 0.0) + value
    return out


def _all_zero(gw: Gateway, why: str) -> None:
    # the log phase runs after the client has its answer, possibly in the other worker
    _wait(lambda: all(v == 0 for v in _gauge(gw).values()), 5, f"in-flight back at 0 after {why}: {_gauge(gw)}")


def test_inflight_returns_to_0_on_every_path(start_sims, start_redis, start_gateway) -> None:
    sims = start_sims(2, prefix="q")
    gw = start_gateway(sims, start_redis())
    assert gw.chat("cache me", max_tokens=1, temperature=0).status_code == 200
    wait_cached(gw)
    r = gw.chat("cache me", max_tokens=1, temperature=0)
    assert r.status_code == 200 and r.headers["X-Kvgate-Cache"] == "HIT"
    _all_zero(gw, "a miss and a hit")
    r = requests.post(gw.url + "/v1/chat/completions", data=b"{nope", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = gw.chat("no model", model="unknown-model")
    assert r.status_code in (400, 404)
    _all_zero(gw, "refusals before the balancer")
    sims[0].stop()
    served = [gw.chat(f"failover {i}", max_tokens=1, headers={"X-Session-Id": f"s{i}"}) for i in range(12)]
    assert all(r.status_code == 200 for r in served), [r.status_code for r in served]
    assert gw.metric_sum("kvgate_failovers_total") >= 1
    _all_zero(gw, "failovers")
    sims[1].stop()
    for i in range(6):
        r = gw.chat(f"nobody {i}", max_tokens=1, headers={"X-Session-Id": f"d{i}"})
        assert r.status_code == 502, r.text
    _all_zero(gw, "every node failing")
