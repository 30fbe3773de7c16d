"""The request-body timeouts (issue 9 item 8): policy fields, their validation and rendering."""

from __future__ import annotations

import json

import pytest

from kvgate.policy.loader import PolicyError, parse_policy
from kvgate.render import default_lua_dir, render

POOLS = [{"name": "p", "models": ["m"], "nodes": [{"id": "n1", "url": "http://127.0.0.1:9001"}]}]


def _policy(**gateway):
    return parse_policy({"version": 1, "gateway": gateway, "pools": POOLS}, "test")


def test_defaults_are_bounded_and_ordered() -> None:
    gw = _policy().gateway
    assert 0 < gw.client_body_timeout_s <= 60
    assert gw.client_body_timeout_s <= gw.client_body_deadline_s <= 600


def test_a_deadline_under_the_idle_timeout_is_refused() -> None:
    with pytest.raises(PolicyError, match="client_body_deadline_s"):
        _policy(client_body_timeout_s=30, client_body_deadline_s=10)


@pytest.mark.parametrize("field", ["client_body_timeout_s", "client_body_deadline_s"])
@pytest.mark.parametrize("value", [0, -1, 3601])
def test_out_of_range_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(PolicyError, match=field):
        _policy(**{field: value})


def test_both_are_rendered() -> None:
    files = render(_policy(client_body_timeout_s=1.5, client_body_deadline_s=20), default_lua_dir())
    conf = files["conf/nginx.conf"]
    # nginx's own reader (chunked bodies) has the idle timeout
    assert "client_body_timeout 1500ms;" in conf
    # nginx's own 400s and the Lua reader's 408 answer in OpenAI's format
    assert "error_page 400 /kvgate/errors/400;" in conf
    assert "location = /kvgate/errors/408 {" in conf
    data = json.loads(files["conf/kvgate.json"])
    assert data["client_body_timeout_ms"] == 1500
    assert data["client_body_deadline_ms"] == 20000
