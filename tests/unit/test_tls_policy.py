"""gateway.tls and control.tls in the policy (docs/tls.md): the fields, the file checks at the
field's path, the render (ssl directives, no http2, the files' digest), with certificates made by
``openssl`` in a temp folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvgate.control.https import base_url, client_verify, self_signed
from kvgate.policy import PolicyError
from kvgate.policy.loader import load_policy, parse_policy
from kvgate.policy.model import is_loopback_listen
from kvgate.policy.tls import files_stamp, resolve_tls, tls_problems
from kvgate.render import default_lua_dir, render

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def _pair(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    return cert, key


def _data(gw_tls=None, control=None) -> dict:
    gateway = {"listen": "0.0.0.0:28443"}
    if gw_tls is not None:
        gateway["tls"] = gw_tls
    return {"version": 1, "gateway": gateway, "control": control or {}, "redis": {"url": "redis://127.0.0.1:28379/0"},
            "pools": [{"name": "p", "models": ["m"], "nodes": [{"id": "a", "url": "http://127.0.0.1:28001"}]}]}


def _paths(exc: PolicyError) -> list[str]:
    return [i.path for i in exc.issues]


def test_protocols_known_paths_relative_to_the_policy_folder() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(_data({"certificate": "certs/gw.pem;", "key": "/k"}), "t")
    assert _paths(err.value) == ["gateway.tls.certificate"]
    rel = parse_policy(_data({"certificate": "certs/gw.pem", "key": "/k"}), "t")
    assert resolve_tls(rel, "/etc/kvgate").gateway.tls.certificate == "/etc/kvgate/certs/gw.pem"
    assert resolve_tls(rel, "/etc/kvgate").gateway.tls.key == "/k"
    # without a folder (a text applied with no file) it is named, not read from the cwd
    assert dict(tls_problems(resolve_tls(rel, None)))["gateway.tls.certificate"].startswith(
        "certs/gw.pem: a relative path, but no folder is known")
    with pytest.raises(ValueError):
        render(rel, default_lua_dir())
    with pytest.raises(PolicyError) as err:
        parse_policy(_data({"certificate": "/c", "key": "/k", "protocols": ["TLSv1.1"]}), "t")
    assert _paths(err.value)[0].startswith("gateway.tls.protocols")
    p = parse_policy(_data({"certificate": "/c", "key": "/k"}), "t")
    assert p.gateway.tls.protocols == ["TLSv1.2", "TLSv1.3"] and p.control.tls is None


def test_require_tls_refuses_a_plain_control_plane_beyond_loopback() -> None:
    # backward compatible: without require_tls a public plain listener is accepted (kvgate control warns)
    assert parse_policy(_data(control={"listen": "0.0.0.0:28090"}), "t").control.tls is None
    parse_policy(_data(control={"listen": "127.0.0.1:28090", "require_tls": True}), "t")
    with pytest.raises(PolicyError) as err:
        parse_policy(_data(control={"listen": "0.0.0.0:28090", "require_tls": True}), "t")
    assert _paths(err.value) == ["control"] and "beyond loopback" in err.value.issues[0].reason
    assert is_loopback_listen("[::1]:1") and is_loopback_listen("localhost:1") and not is_loopback_listen("10.0.0.1:1")


@needs_openssl
def test_the_files_are_checked_at_the_fields_path(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path, "a")
    other_cert, other_key = _pair(tmp_path, "b")
    ok = parse_policy(_data({"certificate": str(cert), "key": str(key)},
                            {"tls": {"certificate": str(other_cert), "key": str(other_key)}}), "t")
    assert tls_problems(ok) == []
    bad = parse_policy(_data({"certificate": str(cert), "key": str(other_key)},
                             {"tls": {"certificate": str(tmp_path / "missing.pem"), "key": str(key)}}), "t")
    issues = dict(tls_problems(bad))
    assert set(issues) == {"gateway.tls.key", "control.tls.certificate"}
    assert "mismatch" in issues["gateway.tls.key"] and "No such file" in issues["control.tls.certificate"]
    # kvgate validate's loader refuses it the same way
    path = tmp_path / "policy.yaml"
    import yaml

    path.write_text(yaml.safe_dump(_data({"certificate": str(cert), "key": str(other_key)})))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert _paths(err.value) == ["gateway.tls.key"]
    # relative names are the policy file's folder's: the loaded policy names them absolutely
    path.write_text(yaml.safe_dump(_data({"certificate": "a.pem", "key": "a.key"})))
    assert load_policy(path).gateway.tls.certificate == str(cert)
    # an encrypted key would make nginx wait for a pass phrase
    enc = tmp_path / "enc.key"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(enc), "-aes256", "-passout", "pass:x"],
                   check=True, capture_output=True, timeout=30)
    issues = tls_problems(parse_policy(_data({"certificate": str(cert), "key": str(enc)}), "t"))
    assert [p for p, _ in issues] == ["gateway.tls.key"] and "encrypted" in issues[0][1]


@needs_openssl
def test_render_serves_tls_http1_and_a_renewal_changes_the_config(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path, "a")
    policy = parse_policy(_data({"certificate": str(cert), "key": str(key)}), "t")
    conf = render(policy, default_lua_dir())["conf/nginx.conf"]
    directives = [ln.strip() for ln in conf.splitlines() if not ln.strip().startswith("#")]
    assert "listen 0.0.0.0:28443 ssl;" in directives and not any("http2" in d for d in directives)
    assert f"ssl_certificate {cert};" in conf and f"ssl_certificate_key {key};" in conf
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in conf and "ssl_session_cache shared:kvgate_tls:10m;" in conf
    # the internal listener stays plain
    assert "listen 127.0.0.1:9080;" in conf
    stamp = files_stamp(policy.gateway.tls)
    _pair(tmp_path, "a")  # renewed in place: same paths, new content
    assert files_stamp(policy.gateway.tls) != stamp
    renewed = render(policy, default_lua_dir())
    assert renewed["conf/nginx.conf"] != conf
    plain = render(parse_policy(_data(), "t"), default_lua_dir())["conf/nginx.conf"]
    assert "ssl" not in plain and "listen 0.0.0.0:28443;" in plain


@needs_openssl
def test_clients_trust_a_self_signed_control_certificate_only(tmp_path: Path, monkeypatch) -> None:
    cert, key = _pair(tmp_path, "a")
    control = parse_policy(_data(control={"listen": "0.0.0.0:28090",
                                          "tls": {"certificate": str(cert), "key": str(key)}}), "t").control
    assert base_url(control) == "https://127.0.0.1:28090"
    monkeypatch.delenv("KVGATE_CA_FILE", raising=False)
    assert self_signed(str(cert)) and client_verify(control) == str(cert)
    monkeypatch.setenv("KVGATE_CA_FILE", "/etc/kvgate/ca.pem")
    assert client_verify(control) == "/etc/kvgate/ca.pem"
    assert not self_signed(str(key))
