"""The Lua↔Python contract: lua/kvgate/keys.lua and kvgate.keys name the same Redis keys,
request-log fields and metrics (luajit dumps keys.lua as JSON)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvgate import keys

REPO = Path(__file__).resolve().parents[2]

DUMP = r"""
package.path = "./lua/?.lua;" .. package.path
local cjson = require "cjson"
local k = require "kvgate.keys"
local metrics = require "kvgate.metrics"
local families = {}
for name in pairs(metrics.FAMILIES) do families[#families + 1] = name end
table.sort(families)
io.write(cjson.encode({
    RESP_PREFIX = k.RESP_PREFIX, LOG_STREAM = k.LOG_STREAM, LOG_MAXLEN = k.LOG_MAXLEN,
    HOT_PREFIX = k.HOT_PREFIX, PREFIX_TEXT_PREFIX = k.PREFIX_TEXT_PREFIX, CONTROL_PREFIX = k.CONTROL_PREFIX,
    LOG_FIELDS = k.LOG_FIELDS, METRICS = k.METRICS, families = families,
    resp = k.resp(7, "default", "ab12"), hot = k.hot("p1", 1800000000.25), prefix_text = k.prefix_text("p1", "f0"),
    NODE_LOAD_PREFIX = k.NODE_LOAD_PREFIX, NODE_LOAD_FIELDS = k.NODE_LOAD_FIELDS, node_load = k.node_load("p1"),
    APIKEY_PREFIX = k.APIKEY_PREFIX, RATELIMIT_PREFIX = k.RATELIMIT_PREFIX, APIKEY_INDEX = k.APIKEY_INDEX, apikey = k.apikey("d1"),
    FLIGHT_PREFIX = k.FLIGHT_PREFIX, TAG_PREFIX = k.TAG_PREFIX, GWLOAD_PREFIX = k.GWLOAD_PREFIX,
}))
"""


@pytest.fixture(scope="module")
def lua() -> dict:
    luajit = shutil.which("luajit")
    assert luajit, "luajit is not installed (apt-get install luajit2)"
    out = subprocess.run([luajit, "-e", DUMP], cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def test_redis_keys_match(lua: dict) -> None:
    for name in ("RESP_PREFIX", "LOG_STREAM", "LOG_MAXLEN", "HOT_PREFIX", "PREFIX_TEXT_PREFIX", "CONTROL_PREFIX"):
        assert lua[name] == getattr(keys, name), name
    assert lua["resp"] == keys.resp_key(7, "default", "ab12") == "kvgate:resp:v7:default:ab12"
    assert lua["hot"] == keys.hot_key("p1", 1800000000 // 60) == "kvgate:hot:p1:30000000"
    assert lua["prefix_text"] == keys.prefix_text_key("p1", "f0") == "kvgate:prefix:p1:f0"
    assert lua["NODE_LOAD_PREFIX"] == keys.NODE_LOAD_PREFIX
    assert tuple(lua["NODE_LOAD_FIELDS"]) == keys.NODE_LOAD_FIELDS
    assert lua["APIKEY_PREFIX"] == keys.APIKEY_PREFIX and lua["APIKEY_INDEX"] == keys.APIKEY_INDEX
    assert lua["apikey"] == keys.apikey_key("d1")
    assert lua["RATELIMIT_PREFIX"] == keys.RATELIMIT_PREFIX
    assert lua["FLIGHT_PREFIX"] == keys.FLIGHT_PREFIX and lua["TAG_PREFIX"] == keys.TAG_PREFIX
    assert lua["GWLOAD_PREFIX"] == keys.GWLOAD_PREFIX
    assert lua["node_load"] == keys.node_load_key("p1") == "kvgate:load:p1"


def test_request_log_fields_match(lua: dict) -> None:
    assert tuple(lua["LOG_FIELDS"]) == keys.LOG_FIELDS
    assert "node" in keys.LOG_FIELDS and "home" in keys.LOG_FIELDS


def test_metric_names_match(lua: dict) -> None:
    assert lua["METRICS"] == keys.METRICS
    # every family /metrics renders is in the contract (config.lua adds its three at load)
    assert set(lua["families"]) <= set(keys.METRICS.values())
    config_only = {keys.METRICS["config_loads"], keys.METRICS["config_version"], keys.METRICS["config_pushes"]}
    assert set(keys.METRICS.values()) - set(lua["families"]) <= config_only
