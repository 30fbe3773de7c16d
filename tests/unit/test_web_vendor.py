"""The admin page's chart library: uPlot, pinned by web/package-lock.json and vendored by
scripts/build-web (run by scripts/setup, hence by `make setup` / `make test`) into
control/kvgate/web/admin/static/vendor/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "web"
VENDOR = REPO / "control" / "kvgate" / "web" / "admin" / "static" / "vendor"
BUILD_WEB = REPO / "scripts" / "build-web"
UPLOT_VERSION = "1.6.32"
NOT_BUILT = "not vendored: run scripts/build-web (scripts/setup and `make setup` run it)"


def lock() -> dict:
    return json.loads((WEB / "package-lock.json").read_text())


def test_package_json_depends_on_exactly_the_pinned_uplot() -> None:
    pkg = json.loads((WEB / "package.json").read_text())
    assert pkg["private"] is True
    assert pkg["dependencies"] == {"uplot": UPLOT_VERSION}, "an exact version, no range"


def test_lock_file_pins_uplot_with_an_integrity_hash() -> None:
    data = lock()
    assert data["lockfileVersion"] >= 2, "npm ci of npm 7+ (Debian 12 has npm 9)"
    assert data["packages"][""]["dependencies"] == {"uplot": UPLOT_VERSION}
    entry = data["packages"]["node_modules/uplot"]
    assert entry["version"] == UPLOT_VERSION
    assert re.fullmatch(r"sha512-[A-Za-z0-9+/]{86}==", entry["integrity"]), entry
    # uPlot has no dependencies: nothing else is fetched
    assert set(data["packages"]) == {"", "node_modules/uplot"}
    # no `resolved` URL of a private mirror pinned in the lock (npm then uses the configured registry)
    assert "resolved" not in entry or entry["resolved"].startswith("https://registry.npmjs.org/")


def test_vendored_files_are_the_real_uplot_of_the_lock() -> None:
    js = VENDOR / "uPlot.iife.min.js"
    assert js.is_file(), NOT_BUILT
    text = js.read_text()
    version = lock()["packages"]["node_modules/uplot"]["version"]
    # the build's banner, and the global the page uses
    assert text.startswith(f"/*! https://github.com/leeoniya/uPlot (v{version}) */")
    assert "var uPlot=" in text and len(text) > 20_000
    assert ".uplot" in (VENDOR / "uPlot.min.css").read_text()
    licence = (VENDOR / "uPlot.LICENSE").read_text()
    assert "MIT License" in licence and "Leon Sorokin" in licence
    # and scripts/build-web agrees they are up to date
    proc = subprocess.run(["bash", str(BUILD_WEB), "--check"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def _copy_tree(tmp_path: Path) -> Path:
    """A minimal copy of the repository for scripts/build-web: the script, web/ and the vendor folder."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(BUILD_WEB, root / "scripts" / "build-web")
    (root / "web").mkdir()
    for name in ("package.json", "package-lock.json"):
        shutil.copy2(WEB / name, root / "web" / name)
    if VENDOR.is_dir():
        shutil.copytree(VENDOR, root / "control" / "kvgate" / "web" / "admin" / "static" / "vendor")
    return root


def test_build_web_check_follows_the_lock_file_content_not_timestamps(tmp_path: Path) -> None:
    if not (VENDOR / "uPlot.iife.min.js").is_file():
        pytest.fail(NOT_BUILT)
    root = _copy_tree(tmp_path)
    script = root / "scripts" / "build-web"
    vendor = root / "control" / "kvgate" / "web" / "admin" / "static" / "vendor"
    # a Docker COPY or a checkout gives new mtimes: still up to date
    os.utime(root / "web" / "package-lock.json", (2_000_000_000, 2_000_000_000))
    for f in vendor.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    assert subprocess.run(["bash", str(script), "--check"], capture_output=True, timeout=30).returncode == 0
    # another lock file: out of date
    lock_file = root / "web" / "package-lock.json"
    lock_file.write_text(lock_file.read_text() + "\n")
    proc = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "build-web" in proc.stderr


def test_build_web_says_so_when_npm_is_missing(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    shutil.rmtree(root / "control", ignore_errors=True)          # nothing vendored: must fetch
    bin_dir = tmp_path / "bin"                                     # a PATH without npm
    bin_dir.mkdir()
    for tool in ("dirname", "sha256sum"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run([shutil.which("bash"), str(root / "scripts" / "build-web")], capture_output=True,
                          text=True, timeout=30, env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert proc.returncode == 1
    assert "npm is not installed" in proc.stderr and "scripts/setup" in proc.stderr


def test_scripts_setup_vendors_the_chart_library() -> None:
    text = (REPO / "scripts" / "setup").read_text()
    assert "bash scripts/build-web --check" in text and "apt_install npm" in text
    # after the venv, and not only when the venv needed installing (no early exit before it)
    venv = text.index("# ---------------------------------------------------------------- the venv")
    web = text.index("bash scripts/build-web")
    assert venv < web and "exit 0" not in text[venv:web].replace('[ "$WANT_WEB" = 1 ] || exit 0', "")
