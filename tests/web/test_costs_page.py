"""The admin page's Costs page (issue 13 item 5) in process, over the fake plane of webfixtures
with a real Redis (``redis-server`` on a free port) holding usage rollups and request-log entries:
the table's figures are the report's (kvgate.costs.report.build_report, what ``kvgate costs --json``
prints), the four-quadrant shares are counted at the medians, and a bad ``since`` is a 400."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis

from kvgate import keys
from kvgate.costs.report import build_report
from kvgate.costs.rollup import HOURS
from kvgate.web.admin.costs import fmt_usd, quadrants

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
def r(plane, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    plane.store.r = client
    yield client
    proc.terminate()
    proc.wait(5)


def bucket(r, hour: int, tenant: str, **fields: int) -> None:
    key = f"kvgate:usage:h:{hour}:{tenant}:m:p"
    r.hset(key, mapping=fields)
    r.zadd(HOURS, {key: hour})


def log(r, prompt: str, cost: str) -> None:
    r.xadd(keys.LOG_STREAM, {f: "" for f in keys.LOG_FIELDS} | {"prompt": prompt, "cost": cost})


def test_quadrants_split_at_the_medians():
    pts = [(100, 10), (200, 20), (300, 30), (400, 40), (1000, 5)]   # medians: 300 tokens, 20 n$
    q = quadrants(pts)
    assert q["split"] == {"tokens": 300.0, "cost_usd": 20e-9}
    assert q["shares"] == {"short_cheap": 0.4, "short_expensive": 0.2, "long_cheap": 0.2, "long_expensive": 0.2}
    assert quadrants([])["shares"] is None


def test_dollars_on_the_page():
    assert [fmt_usd(v) for v in (None, 0.0, 1234.5, 0.25, 0.003 / 9, 7.79e-6)] == \
        ["-", "$0.00", "$1,234.50", "$0.2500", "$0.000333", "$0.00000779"]


def test_costs_page_shows_the_report(admin, r):
    hour = int(time.time()) // 3600 * 3600
    bucket(r, hour - 3600, "team-a", requests=10, ok=9, failed=1, prompt=5000, cached=2000, completion=700,
           cost=3_000_000, saved_cache=400_000, saved_prefix=100_000, rr_cached=1000, saved_batch=0)
    bucket(r, hour, "team-b", requests=4, ok=2, failed=2, prompt=800, cached=0, completion=100, cost=1_000_000)
    for p, c in (("100", "10"), ("200", "20"), ("300", "30"), ("400", "40"), ("", "")):
        log(r, p, c)
    page = admin.get("/admin/costs")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert 'aria-current="page">Costs' in html
    rep = build_report(r, "tenant", 86400)
    data = admin.get("/admin/costs.json").get_json()
    assert data["report"]["rows"] == rep["rows"] and data["report"]["total"] == rep["total"]
    a = next(x for x in rep["rows"] if x["key"] == "team-a")
    assert a["cost_usd"] == 0.003 and a["saved_usd"]["affinity"] == 0.00005
    assert '>$0.000333</td>' in html                    # team-a: 0.003 / 9 successful
    assert '>$0.000500</td>' in html                    # team-b: 0.001 / 2 (failed ones paid by the ok ones)
    assert data["quadrants"]["n"] == 4 and data["unknown"] == 1
    assert data["quadrants"]["shares"]["long_expensive"] == 0.5
    assert 'data-share="0.5"><strong>50.0%</strong> expensive and long' in html


def test_bad_since_is_400(admin, r):
    assert admin.get("/admin/costs?since=forever").status_code == 400
    bad = admin.get("/admin/costs.json?since=forever")
    assert bad.status_code == 400 and bad.get_json()["error"]["code"] == "bad_request"


def test_redis_down_is_503(admin, plane):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    plane.store.r = redis.Redis(port=port, socket_connect_timeout=1)
    page = admin.get("/admin/costs")
    assert page.status_code == 503 and "the cost report could not be read" in page.get_data(as_text=True)
    js = admin.get("/admin/costs.json")
    assert js.status_code == 503 and js.get_json()["error"]["code"] == "redis_unavailable"


def test_costs_page_needs_sign_in(client, r):
    assert client.get("/admin/costs").status_code in (302, 303, 401)
