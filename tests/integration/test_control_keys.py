"""``kvgate keys create|list|revoke`` as the real CLI against a real stack (``kvgate up``) with
tenants, and the keys at its gateway (issue 12 item 1)."""

from __future__ import annotations

import json
import time
from typing import Callable

import pytest
import requests

from ctlfixtures import MODEL, Fleet

pytestmark = pytest.mark.integration

TENANTS = "tenants: [{id: default, name: Everyone}, {id: t1, name: Team one}]"


def chat(f: Fleet, secret: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return requests.post(f.gateway + "/v1/chat/completions", headers=headers, timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def test_keys_from_the_cli_work_at_the_gateway_and_revoke(control_fleet: Callable[..., Fleet]) -> None:
    f = control_fleet(n=1, gateway_extra=", auth: optional", extra=TENANTS)
    made = f.kvgate("keys", "create", "--tenant", "t1", "--name", "ci job")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("kvg-") and len(secret) == 47 and "shown once" in made.stderr
    assert chat(f, secret).status_code == 200
    assert chat(f, None).status_code == 200  # optional: keyless is the default tenant's

    listed = f.kvgate("keys", "list", "--json")
    assert listed.returncode == 0 and secret not in listed.stdout
    [key] = json.loads(listed.stdout)
    assert key["tenant"] == "t1" and key["name"] == "ci job" and not key["revoked"]
    table = f.kvgate("keys", "list")
    assert key["id"] in table.stdout and "active" in table.stdout

    tenants = f.api("GET", "/api/v1/tenants").json()
    assert tenants["auth"] == "optional"
    assert {t["id"]: t["keys"] for t in tenants["tenants"]} == {"default": 0, "t1": 1}

    bad = f.kvgate("keys", "create", "--tenant", "nobody")
    assert bad.returncode == 2 and "unknown tenant 'nobody'" in bad.stderr

    gone = f.kvgate("keys", "revoke", key["id"])
    assert gone.returncode == 0, gone.stderr
    deadline = time.monotonic() + 8  # auth_cache_ttl_s defaults to 5 s
    while (r := chat(f, secret)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert f.kvgate("keys", "revoke", "key_000000000000").returncode == 2

    # last use reached Redis (the gateways write it every few seconds); the secret is nowhere
    deadline = time.monotonic() + 8
    while not (k := json.loads(f.kvgate("keys", "list", "--json").stdout)[0])["last_used"] and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert k["last_used"] and k["revoked"]
    kinds = [e["kind"] for e in f.events(limit=50)]
    assert "apikey_created" in kinds and "apikey_revoked" in kinds
    for log in (f.run_dir / "logs").glob("*"):
        if log.is_file():
            assert secret not in log.read_text(errors="replace"), log


def test_the_tenants_page_shows_limits_use_and_keys(control_fleet: Callable[..., Fleet]) -> None:
    limits = ("tenants: [{id: default}, {id: t1, name: Team one, limits: {rpm: 100, tpm: 100000, concurrency: 5}}]")
    f = control_fleet(n=1, gateway_extra=", auth: optional", extra=limits)
    bearer = {"Authorization": f"Bearer {f.token}", "Accept": "application/json"}
    made = requests.post(f.control + "/admin/tenants/t1/keys", headers=bearer, data={"name": "page"}, timeout=10)
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    for _ in range(3):
        assert chat(f, secret).status_code == 200
    page = requests.get(f.control + "/admin/tenants", headers=bearer, timeout=10).json()
    assert page["auth"] == "optional" and not page["error"], page
    t1 = next(t for t in page["tenants"] if t["id"] == "t1")
    assert dict(map(tuple, t1["limits"])) == {"rpm": 100, "tpm": 100000, "concurrency": 5}
    assert 2.5 <= t1["use"]["rpm"] <= 3.5  # three requests, a second's refill at most
    assert t1["use"]["concurrency"] == 0
    [key] = t1["keys"]
    html = requests.get(f.control + "/admin/tenants", headers={"Authorization": f"Bearer {f.token}"}, timeout=10)
    assert html.status_code == 200 and key["id"] in html.text and secret not in html.text
    # the 15-minute figures come from the control plane's scrapes of the gateway
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        t1 = next(t for t in requests.get(f.control + "/admin/tenants", headers=bearer, timeout=10).json()["tenants"]
                  if t["id"] == "t1")
        if t1["requests_15m"] >= 3:
            break
        time.sleep(0.5)
    assert t1["requests_15m"] >= 3
    gone = requests.post(f.control + f"/admin/keys/{key['id']}/revoke", headers=bearer, timeout=10)
    assert gone.status_code == 200 and gone.json()["key"]["revoked"]
