"""Runs the pure-Lua unit tests (tests/lua/test_*.lua) under plain luajit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LUA_TESTS = sorted((REPO / "tests" / "lua").glob("test_*.lua"))


def test_lua_tests_exist() -> None:
    assert LUA_TESTS, "no tests/lua/test_*.lua found"


@pytest.mark.parametrize("path", LUA_TESTS, ids=[p.name for p in LUA_TESTS])
def test_lua(path: Path) -> None:
    luajit = shutil.which("luajit")
    assert luajit, "luajit is not installed (apt-get install luajit2)"
    res = subprocess.run([luajit, str(path.relative_to(REPO))], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"{path.name} failed:\n{res.stdout}\n{res.stderr}"
    assert " 0 failed" in res.stdout
