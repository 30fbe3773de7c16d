"""The admin page in a real browser: Debian's Chromium (``/usr/bin/chromium``, apt package
``chromium``) driven headless by Playwright for Python, against a real stack of 4 simulated
nodes under live traffic (``kvgate up``: Redis, simulators, nginx, control plane, agents).

Acceptance of issue 4: sign in; the 4 nodes with live figures (refreshed without a page
reload); drain one and watch it reach ``drained``; warm and undrain it; a policy with an error
shows the error at its field; fixed, it shows the diff, applies, and the event appears. The
same drain also works with JavaScript off (plain forms). Screenshots of Fleet and Policy go
to ``$KVGATE_SCREENSHOTS`` (``make screenshots`` sets ``docs/images``), else to a temp folder.

Never ``playwright install``: the browser is Debian's (PLATFORM.md §9).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests

from ctlfixtures import MODEL, Fleet

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

SYSTEM = ("You are a support assistant for an online store. Answer briefly, cite the order number, never invent "
          "policies, and escalate refunds above 500 dollars to a human. ") * 6


class Traffic(threading.Thread):
    """Conversations through the gateway while the test runs: each turn resends the whole
    conversation (what chat clients do), so the engines' prefix caches get hits."""

    def __init__(self, gateway: str, conversations: int = 10):
        super().__init__(daemon=True, name="traffic")
        self.gateway, self.conversations = gateway, conversations
        self.stop = threading.Event()
        self.sent = self.failed = 0

    def run(self) -> None:
        history: dict[int, list[dict[str, str]]] = {i: [] for i in range(self.conversations)}
        s = requests.Session()
        turn = 0
        while not self.stop.is_set():
            conv = turn % self.conversations
            msgs = history[conv]
            msgs.append({"role": "user", "content": f"conversation {conv} question {len(msgs)}: where is my order?"})
            try:
                r = s.post(self.gateway + "/v1/chat/completions", timeout=30,
                           headers={"X-Session-Id": f"browser-{conv}", "Cache-Control": "no-store"},
                           json={"model": MODEL, "max_tokens": 4,
                                 "messages": [{"role": "system", "content": SYSTEM}, *msgs]})
                self.sent += 1
                if r.status_code != 200:
                    self.failed += 1
                else:
                    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            except requests.RequestException:
                self.failed += 1
            if len(msgs) > 16:
                msgs.clear()
            turn += 1
            self.stop.wait(0.05)


@pytest.fixture(scope="module")
def cf(control_fleet_module: Callable[..., Fleet]) -> Iterator[Fleet]:
    fleet = control_fleet_module(n=4)
    fleet.wait_reports(timeout=60)
    yield fleet


@pytest.fixture(scope="module")
def traffic(cf: Fleet) -> Iterator[Traffic]:
    t = Traffic(cf.gateway)
    t.start()
    yield t
    t.stop.set()
    t.join(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium package (browser tests)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ.get("KVGATE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def sign_in(page, f: Fleet, path: str = "/admin/") -> None:
    page.goto(f.control + path)
    assert "/admin/login" in page.url, page.url  # no session: the sign-in page
    page.get_by_label("Admin token").fill(f.token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{f.control}{path}")


def test_operator_flow_in_chromium(cf: Fleet, traffic: Traffic, browser, shots: Path):
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, cf)

    # ------------------------------------------------ 4 nodes, live figures
    rows = page.locator("#fleet tbody tr")
    expect(rows).to_have_count(4)
    assert [rows.nth(i).get_attribute("data-node") for i in range(4)] == ["n1", "n2", "n3", "n4"]
    expect(page.locator("#refresh-status")).to_contain_text("Live: updated", timeout=15000)
    page.evaluate("window.__kvgateNoReload = 1")
    first = {n: page.locator(f'#fleet tr[data-node="{n}"] [data-field="req_s"]').inner_text() for n in ("n1", "n2")}
    stamp = page.locator("#refresh-status").inner_text()
    # the figures move with the traffic, refreshed in place (the marker survives: no page load)
    page.wait_for_function(
        """([first, stamp]) => {
             const cell = n => document.querySelector(`#fleet tr[data-node="${n}"] [data-field="req_s"]`).textContent;
             return document.querySelector('#refresh-status').textContent !== stamp &&
                    (cell('n1') !== first.n1 || cell('n2') !== first.n2);
           }""", arg=[first, stamp], timeout=30000)
    assert page.evaluate("window.__kvgateNoReload") == 1
    for n in ("n1", "n2", "n3", "n4"):
        row = page.locator(f'#fleet tr[data-node="{n}"]')
        expect(row.locator('[data-field="state"]')).to_have_text("active")
        expect(row.locator('[data-field="gpu_mem"]')).to_have_text("no GPU")  # no NVML here
        age = row.locator('[data-field="report_age"]').inner_text()
        assert age.endswith(" s"), age
        assert float(age.split()[0]) < 10, age
    # prefix-cache hit ratio per node: the conversations hit their node's cache
    page.wait_for_function(
        """() => [...document.querySelectorAll('#fleet [data-field="prefix_hit"]')]
                 .some(td => parseFloat(td.textContent) > 0)""", timeout=30000)
    # the charts are drawn by uPlot (a <canvas> per chart)
    page.wait_for_function("() => document.querySelectorAll('.chart canvas').length === 8", timeout=20000)

    # ------------------------------------------------ drain n2 → drained
    row = page.locator('#fleet tr[data-node="n2"]')
    row.get_by_role("link", name="Drain n2", exact=True).click()
    dialog = page.locator("#confirm-dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("Drain n2?")
    page.locator("#confirm-ok").click()
    expect(row.locator('[data-field="state"]')).to_have_text("drained", timeout=60000)
    expect(page.locator("#toasts")).to_contain_text("n2: drained after")
    expect(row.get_by_role("link", name="Undrain n2", exact=True)).not_to_have_class("disabled")
    assert cf.node("n2")["state"] == "drained"

    # ------------------------------------------------ warm n2 (stays drained)
    row.get_by_role("link", name="Warm n2", exact=True).click()
    expect(dialog).to_contain_text("Warm n2 now?")
    page.locator("#confirm-ok").click()
    # "partial" when one of the prompts failed under this test's own traffic: still a finished warm-up
    expect(page.locator("#toasts")).to_contain_text(re.compile(r"n2: warm-up (ok|partial) after"), timeout=60000)
    expect(row.locator('[data-field="progress"]')).to_contain_text(re.compile(r"last warm-up (ok|partial)"),
                                                                    timeout=10000)
    expect(row.locator('[data-field="state"]')).to_have_text("drained")

    # ------------------------------------------------ undrain n2 → warming → ramping → active
    row.get_by_role("link", name="Undrain n2", exact=True).click()
    page.locator("#confirm-ok").click()
    expect(row.locator('[data-field="state"]')).to_have_text("active", timeout=60000)
    expect(page.locator("#toasts")).to_contain_text("n2: active after")
    page.wait_for_timeout(2500)  # a few more refreshes, so the screenshot has every figure
    page.screenshot(path=str(shots / "admin-fleet.png"), full_page=True)

    # ------------------------------------------------ policy: inline error, fix, diff, apply, event
    page.get_by_role("link", name="Policy", exact=True).click()
    editor = page.get_by_label("Policy YAML")
    running = editor.input_value()
    version = cf.api("GET", "/api/v1/policy").json()["version"]
    assert "balancer: chash" in running
    # the editor round-trips the running text exactly (a textarea drops a leading newline)
    page.get_by_role("button", name="Check").click()
    expect(page.locator("#check-result")).to_contain_text("the same as the running policy")
    editor = page.get_by_label("Policy YAML")
    editor.fill(running.replace("balancer: chash", "balancer: ketama"))
    page.get_by_role("button", name="Check").click()
    error = page.locator('.field-error[data-path="pools[0].balancer"]')
    expect(error).to_be_visible()
    expect(error).to_contain_text("pools[0].balancer")
    # the error sits in the listing right at the bad line
    bad_line = page.locator("#annotated li.bad")
    expect(bad_line).to_have_count(1)
    expect(bad_line.locator("code").first).to_contain_text("balancer: ketama")
    assert page.locator("#policy-apply").count() == 0
    page.screenshot(path=str(shots / "admin-policy-error.png"), full_page=True)

    fixed = running.replace("drain: {timeout_s: 120}", "drain: {timeout_s: 90}")
    assert fixed != running
    page.get_by_label("Policy YAML").fill(fixed)
    page.get_by_role("button", name="Check").click()
    diff = page.locator("#diff")
    expect(diff).to_contain_text("-drain: {timeout_s: 120}")
    expect(diff).to_contain_text("+drain: {timeout_s: 90}")
    page.screenshot(path=str(shots / "admin-policy.png"), full_page=True)
    page.get_by_role("button", name="Apply").click()
    expect(page.locator(".flash-ok")).to_contain_text(f"Policy version {version + 1} applied")
    expect(page.locator("#policy-events")).to_contain_text(f"policy version {version + 1} applied from admin page")
    assert cf.api("GET", "/api/v1/policy").json()["yaml"] == fixed
    page.get_by_role("link", name="Events", exact=True).click()
    page.get_by_label("Kind").select_option("policy_applied")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#events tbody tr").first).to_contain_text(f"policy version {version + 1} applied")

    assert not errors, errors
    assert traffic.sent > 50 and traffic.failed == 0, (traffic.sent, traffic.failed)
    context.close()
    assert cf.api("PUT", "/api/v1/policy", data=running).status_code == 200


def test_drain_and_undrain_without_javascript(cf: Fleet, traffic: Traffic, browser):
    """Progressive enhancement: with JavaScript off the same buttons lead to a confirmation page
    whose plain form does the action."""
    from playwright.sync_api import expect

    context = browser.new_context(java_script_enabled=False, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sign_in(page, cf)
    page.get_by_role("link", name="Drain n3", exact=True).click()
    expect(page.locator("h1")).to_have_text("Drain n3")
    page.get_by_role("button", name="Drain n3").click()
    expect(page.locator(".flash-ok")).to_contain_text("n3: drain started")
    cf.wait_state("n3", "drained", timeout=60)
    page.reload()
    expect(page.locator('#fleet tr[data-node="n3"] [data-field="state"]')).to_have_text("drained")
    page.get_by_role("link", name="Undrain n3", exact=True).click()
    page.get_by_role("button", name="Undrain n3").click()
    expect(page.locator(".flash-ok")).to_contain_text("n3: undrain started")
    cf.wait_state("n3", "active", timeout=60)
    context.close()
    assert traffic.failed == 0


PRICES = ("    prices: {input_usd_per_1m_tokens: 0.20, cached_input_usd_per_1m_tokens: 0.02, "
          "output_usd_per_1m_tokens: 0.60}")


def test_costs_page_in_chromium_equals_kvgate_costs_json(cf: Fleet, traffic: Traffic, browser, shots: Path):
    """The Costs page (issue 13 item 5): with prices in the policy and known traffic, every figure
    of its table is the one ``kvgate costs --json`` prints, its quadrant view counts the last hour's
    priced log entries, and both charts are drawn. The screenshot goes to admin-costs.png."""
    import json
    import time

    import redis
    from playwright.sync_api import expect

    from ctlfixtures import wait_until
    from kvgate import keys
    from kvgate.costs.rollup import GROUP
    from kvgate.web.admin.costs import fmt_usd

    traffic.stop.set()  # the figures must hold still between the page and the CLI
    traffic.join(timeout=30)
    running = cf.api("GET", "/api/v1/policy").json()["yaml"]
    priced = cf.render(pool_extra=PRICES)
    assert cf.api("PUT", "/api/v1/policy", data=priced).status_code == 200
    try:
        for tenant_turn in range(24):  # a spread of prompt lengths and completions: four non-empty quadrants
            r = requests.post(cf.gateway + "/v1/chat/completions", timeout=30,
                              headers={"X-Session-Id": f"cost-{tenant_turn % 6}"},
                              json={"model": MODEL, "max_tokens": 2 + 7 * (tenant_turn % 4),
                                    "messages": [{"role": "system", "content": SYSTEM[: 80 * (1 + tenant_turn % 5)]},
                                                 {"role": "user", "content": f"question {tenant_turn}"}]})
            assert r.status_code == 200, r.text
        rr = redis.Redis(port=cf.redis_port, decode_responses=True)

        def caught_up() -> bool:
            info = {g["name"]: g for g in rr.xinfo_groups(keys.LOG_STREAM)}.get(GROUP)
            return bool(info) and info["pending"] == 0 and \
                info["last-delivered-id"] == rr.xinfo_stream(keys.LOG_STREAM)["last-generated-id"]

        # caught up and still: no log entry written by a late log-phase timer or the control plane's
        # own requests after the last one (the page and the CLI must read the same rollups)
        still = {"n": -1, "since": 0.0}

        def settled() -> bool:
            n, now = rr.xlen(keys.LOG_STREAM), time.monotonic()
            if n != still["n"] or not caught_up():
                still.update(n=n, since=now)
                return False
            return now - still["since"] >= 3

        wait_until(settled, "the control plane's usage consumer to acknowledge every log entry", 60)
        out = cf.kvgate("costs", "--json", "--since", "24h", "--control-url", cf.control, "--token", cf.token)
        assert out.returncode == 0, out.stderr
        cli = json.loads(out.stdout)
        assert cli["total"]["cost_usd"] > 0, cli["total"]

        context = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        sign_in(page, cf, "/admin/costs")
        expect(page.locator("h1")).to_have_text("Costs")
        rows = page.locator("#costs tbody tr")
        expect(rows).to_have_count(len(cli["rows"]) + 1)
        for want in cli["rows"] + [cli["total"]]:
            row = page.locator(f'#costs tr[data-tenant="{want["key"]}"]')
            for f in ("requests", "ok", "failed", "prompt", "cached", "completion"):
                assert int(row.locator(f'[data-field="{f}"]').inner_text()) == want[f], (want["key"], f)
            assert float(row.locator('[data-field="cost_usd"]').get_attribute("data-usd")) == want["cost_usd"]
            assert row.locator('[data-field="cost_usd"]').inner_text() == fmt_usd(want["cost_usd"])
            for lever in ("cache", "prefix", "affinity", "batch"):
                cell = row.locator(f'[data-field="saved_{lever}"]')
                assert float(cell.get_attribute("data-usd")) == want["saved_usd"][lever], (want["key"], lever)
            per_ok = row.locator('[data-field="cost_per_ok_usd"]')
            assert per_ok.inner_text() == fmt_usd(want["cost_per_ok_usd"]), want["key"]
            assert float(per_ok.get_attribute("data-usd")) == want["cost_per_ok_usd"]
        # the quadrant view: every priced entry of the last hour, shares summing to 1
        since_ms = int((time.time() - 3600) * 1000)
        priced_n = sum(1 for _i, e in rr.xrange(keys.LOG_STREAM, min=str(since_ms))
                       if e.get("prompt", "").isdigit() and e.get("cost", "").isdigit())
        assert int(page.locator("#quadrant-n").inner_text()) == priced_n > 0
        shares = [float(page.locator(f'[data-quadrant="{q}"]').get_attribute("data-share"))
                  for q in ("short_cheap", "short_expensive", "long_cheap", "long_expensive")]
        assert abs(sum(shares) - 1) < 1e-9 and shares[3] > 0, shares
        page.wait_for_function("() => document.body.dataset.chartsReady === '1'", timeout=15000)
        assert page.locator("#chart-cost canvas").count() == 1 and page.locator("#chart-quadrants canvas").count() == 1
        page.screenshot(path=str(shots / "admin-costs.png"), full_page=True)
        assert not errors, errors
        context.close()
    finally:
        assert cf.api("PUT", "/api/v1/policy", data=running).status_code == 200


def test_batches_page_in_chromium(cf: Fleet, browser, shots: Path):
    """The Batches page (issue 14 item 5): a finished batch with its progress bar and output
    download, a running one cancelled through the confirmation page; the screenshot goes to
    admin-batches.png."""
    import io
    import json

    import openai
    from playwright.sync_api import expect

    from ctlfixtures import wait_until

    client = openai.OpenAI(base_url=cf.gateway + "/v1", api_key="unused: gateway.auth is off", max_retries=0)

    def submit(n: int, max_tokens: int, tag: str) -> str:
        data = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": MODEL, "max_tokens": max_tokens,
                                            "messages": [{"role": "user", "content": f"{tag} question {i}"}]}}) + "\n"
                       for i in range(n)).encode()
        f = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
        return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata={"job": tag}).id

    done_id = submit(6, 4, "summaries")
    wait_until(lambda: client.batches.retrieve(done_id).status == "completed", "the short batch to complete", 60)
    # long enough that the cancel below always finds it running: 200 lines of 4,000 tokens at
    # time_scale 0.05 (1 ms a token) is ~50 s at batch.max_in_flight 16 (80 × 400 finished in
    # ~2 s, before the page got to it, in one run)
    running_id = submit(200, 4000, "nightly-eval")
    wait_until(lambda: client.batches.retrieve(running_id).request_counts.completed >= 1, "the long batch to start", 60)

    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, cf, "/admin/batches")
    expect(page.locator("h1")).to_have_text("Batches")
    done_row = page.locator(f'tr[data-batch="{done_id}"]')
    expect(done_row).to_have_attribute("data-status", "completed")
    assert done_row.locator("progress").get_attribute("value") == "6"
    expect(done_row.locator('[data-field="completed"]')).to_have_text("6")
    # the output file, downloaded with the page's session
    href = done_row.get_by_role("link", name="output").get_attribute("href")
    out = page.request.get(cf.control + href)
    assert out.status == 200
    assert sorted(json.loads(x)["custom_id"] for x in out.text().splitlines()) == sorted(f"summaries-{i}" for i in range(6))
    page.screenshot(path=str(shots / "admin-batches.png"), full_page=True)

    row = page.locator(f'tr[data-batch="{running_id}"]')
    expect(row).to_have_attribute("data-status", "in_progress")
    row.get_by_role("link", name="Cancel…").click()
    expect(page.locator("h1")).to_contain_text("Cancel the batch")
    expect(page.locator(".confirm")).to_contain_text(running_id)
    page.get_by_role("button", name="Cancel the batch").click()
    page.wait_for_url(f"{cf.control}/admin/batches")
    expect(page.locator(".flash")).to_contain_text(f"Batch {running_id} is cancelling")

    def cancelled() -> bool:
        page.reload()
        return page.locator(f'tr[data-batch="{running_id}"]').get_attribute("data-status") == "cancelled"

    wait_until(cancelled, "the cancelled batch to end", 60)
    b = client.batches.retrieve(running_id)
    assert b.status == "cancelled" and 1 <= b.request_counts.completed < 200
    assert not page.locator(f'tr[data-batch="{running_id}"]').get_by_role("link", name="Cancel…").count()
    assert not errors, errors
    context.close()
