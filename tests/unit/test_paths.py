"""kvgate finds its nginx templates and Lua modules through one setting (kvgate.paths:
$KVGATE_HOME, else the package's share/ folder), not through the package's place in a checkout;
the package data of pyproject.toml carries every one of them (and the admin page's files) into
a wheel."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvgate import paths

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "control" / "kvgate"


def test_default_is_the_packages_share_folder() -> None:
    assert (PKG / "share" / "nginx").is_symlink() and (PKG / "share" / "lua").is_symlink()
    assert paths.template_dir() == (REPO / "nginx").resolve()
    assert paths.lua_dir() == (REPO / "lua").resolve()
    assert (paths.lua_dir() / "kvgate" / "gateway.lua").is_file()


def test_kvgate_home_moves_both(tmp_path, monkeypatch) -> None:
    shutil.copytree(REPO / "nginx", tmp_path / "nginx")
    shutil.copytree(REPO / "lua", tmp_path / "lua")
    monkeypatch.setenv("KVGATE_HOME", str(tmp_path))
    assert paths.template_dir() == tmp_path.resolve() / "nginx"
    assert paths.lua_dir() == tmp_path.resolve() / "lua"


def test_a_kvgate_home_without_templates_is_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="KVGATE_HOME"):
        paths.template_dir()


def test_render_reads_the_templates_of_kvgate_home(tmp_path) -> None:
    shutil.copytree(REPO / "nginx", tmp_path / "nginx")
    shutil.copytree(REPO / "lua", tmp_path / "lua")
    conf = tmp_path / "nginx" / "nginx.conf.j2"
    conf.write_text("# from KVGATE_HOME\n" + conf.read_text())
    code = ("from kvgate.policy import load_policy; from kvgate.render import render, default_lua_dir; "
            f"files = render(load_policy({str(REPO / 'policies' / 'demo.yaml')!r}), default_lua_dir()); "
            "print(str(default_lua_dir())); print([v for k, v in files.items() if k.endswith('nginx.conf')][0][:40])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVGATE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lua, head = out.stdout.splitlines()[:2]
    assert lua == str((tmp_path / "lua").resolve())
    assert head.startswith("# from KVGATE_HOME")


def _package_data() -> list[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return data["tool"]["setuptools"]["package-data"]["kvgate"]


def _covered(rel: str, patterns: list[str]) -> bool:
    return any(str((PKG / rel)) in {str(Path(p)) for p in glob.glob(str(PKG / pat), recursive=True)}
               for pat in patterns)


@pytest.mark.parametrize("folder,suffix", [("nginx", ".j2"), ("lua", ".lua")])
def test_package_data_carries_every_template_and_lua_module(folder: str, suffix: str) -> None:
    patterns = _package_data()
    files = [p for p in (REPO / folder).rglob(f"*{suffix}")]
    assert files
    for f in files:
        rel = f"share/{folder}/{f.relative_to(REPO / folder)}"
        assert _covered(rel, patterns), rel


def test_package_data_carries_the_admin_pages_files() -> None:
    patterns = _package_data()
    admin = PKG / "web" / "admin"
    files = list((admin / "templates").rglob("*.html")) + [p for p in (admin / "static").rglob("*")
                                                            if p.is_file() and not p.name.startswith(".")]
    assert len(files) > 10
    for f in files:
        rel = str(f.relative_to(PKG))
        assert _covered(rel, patterns), rel
