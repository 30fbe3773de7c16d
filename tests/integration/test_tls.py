"""TLS on the client listener and on the control plane (docs/tls.md), with real parts only:
certificates made by ``openssl`` (a test CA, server certificates with serials), the real
``kvgate control`` (cheroot with TLS) driving the real nginx, HTTPS clients (requests, the
``openai`` SDK with a CA bundle, ``ssl`` handshakes) and the ``kvgate`` CLI.

One stack for the module: the tests run in order and each leaves it serving (the renewal tests
change the certificate on disk, the serial only goes up)."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests

from gwfixtures import MODEL, _start_redis, _start_sims, kvgate_cli
from ctlfixtures import wait_until

pytestmark = pytest.mark.integration


def _free_port_28k() -> int:
    """A free port in 28000-28999 (the range these tests may use on a shared machine)."""
    for port in range(28000 + os.getpid() % 500, 29000):
        with closing(socket.socket()) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port
    raise RuntimeError("no free port in 28000-28999")


_TAKEN: set[int] = set()


# ----------------------------------------------------------------------------- certificates
class Pki:
    """A test CA in ``folder`` and server certificates it signs (openssl, RSA 2048)."""

    def __init__(self, folder: Path):
        self.dir = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = folder / "ca.pem"
        self._openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "ca.key"),
                      "-out", str(self.ca), "-days", "2", "-subj", "/CN=kvgate test CA")

    def _openssl(self, *args: str) -> None:
        res = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr

    def key(self, name: str) -> Path:
        path = self.dir / f"{name}.key"
        self._openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(path))
        return path

    def cert(self, key: Path, serial: int, out: Path) -> None:
        """Write a certificate for ``key`` (CN localhost, SAN 127.0.0.1) with ``serial`` to ``out``,
        in place (same path, same inode: a renewal that rewrites the file)."""
        csr, ext, tmp = self.dir / "req.csr", self.dir / "ext.cnf", self.dir / "cert.tmp"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        self._openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", "/CN=localhost")
        self._openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.dir / "ca.key"),
                      "-set_serial", str(serial), "-days", "2", "-out", str(tmp), "-extfile", str(ext))
        with open(out, "w") as fh:  # in place: the watch must notice a rewrite, not only a rename
            fh.write(tmp.read_text())


def served_serial(addr: str, ca: Path) -> int:
    """The serial of the certificate a fresh TLS handshake with ``addr`` presents (verified by ``ca``)."""
    host, port = addr.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        return int(s.getpeercert()["serialNumber"], 16)


# ----------------------------------------------------------------------------- the stack
@dataclass
class TlsStack:
    pki: Pki
    gw_key: Path
    gw_cert: Path
    ctl_key: Path
    ctl_cert: Path
    gateway: str  # HOST:PORT
    control: str
    token: str
    run_dir: Path
    policy_path: Path
    log: Path
    redis_port: int

    @property
    def gateway_url(self) -> str:
        return f"https://{self.gateway}"

    @property
    def control_url(self) -> str:
        return f"https://{self.control}"

    def chat(self, **kw) -> requests.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}
        return requests.post(self.gateway_url + "/v1/chat/completions", json=body, timeout=30, verify=str(self.pki.ca),
                             headers={"Cache-Control": "no-store"})

    def api(self, method: str, path: str, **kw) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kw.pop("headers", {})}
        return requests.request(method, self.control_url + path, headers=headers, verify=str(self.pki.ca), timeout=30,
                                **kw)

    def events(self, kind: str) -> list[dict]:
        return self.api("GET", "/api/v1/events", params={"kind": kind, "limit": 200}).json()["events"]


POLICY = """
version: 1
gateway:
  listen: "{gateway}"
  internal_listen: "127.0.0.1:{internal}"
  debug_headers: true
  tls: {{certificate: "{gw_cert}", key: "{gw_key}"}}
redis: {{url: "{redis}", managed: false}}
control:
  listen: "{control}"
  tick_s: 0.2
  report_interval_s: 0.5
  tls: {{certificate: "{ctl_cert}", key: "{ctl_key}"}}
pools:
  - name: default
    models: [{model}]
    nodes:
      - {{id: n1, url: "{sim}", simulate: false}}
"""


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsStack]:
    base = tmp_path_factory.mktemp("tls")
    pki = Pki(base / "pki")
    gw_key, ctl_key = pki.key("gateway"), pki.key("control")
    gw_cert, ctl_cert = pki.dir / "gateway.pem", pki.dir / "control.pem"
    pki.cert(gw_key, 1, gw_cert)
    pki.cert(ctl_key, 1, ctl_cert)
    with ExitStack() as stack:
        redis = _start_redis(base)
        stack.callback(redis.stop)
        sims = _start_sims(1, base)
        stack.callback(sims[0].stop)
        gateway, control = f"127.0.0.1:{_free_port_28k()}", f"127.0.0.1:{_free_port_28k()}"
        policy_path = base / "policy.yaml"
        policy_path.write_text(POLICY.format(gateway=gateway, internal=_free_port_28k(), gw_cert=gw_cert, gw_key=gw_key,
                                             redis=redis.url, control=control, ctl_cert=ctl_cert, ctl_key=ctl_key,
                                             model=MODEL, sim=sims[0].url))
        run_dir = base / "run"
        log = base / "control.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(run_dir), "control",
                                     "--policy", str(policy_path)], stdout=fh, stderr=subprocess.STDOUT)

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            subprocess.run([sys.executable, "-c", "import sys; from kvgate.nginxctl import Nginx; "
                            "Nginx(sys.argv[1]).stop(timeout=5)", str(run_dir / "nginx")], timeout=30)

        stack.callback(stop)

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return requests.get(f"https://{control}/healthz", verify=str(pki.ca), timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_until(healthy, "kvgate control over https", timeout=30)
        token = (run_dir / "admin.token").read_text().strip()
        yield TlsStack(pki, gw_key, gw_cert, ctl_key, ctl_cert, gateway, control, token, run_dir, policy_path, log,
                       redis.port)


# ----------------------------------------------------------------------------- the client listener
def test_gateway_serves_https_to_requests_and_the_openai_sdk(tls_stack: TlsStack) -> None:
    r = tls_stack.chat()
    assert r.status_code == 200, r.text
    assert r.headers["X-Kvgate-Node"] == "n1"
    ctx = ssl.create_default_context(cafile=str(tls_stack.pki.ca))
    with openai.OpenAI(base_url=tls_stack.gateway_url + "/v1", api_key="unused", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=ctx)) as client:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].message.content
    # HTTP/1.1 only: a client offering h2 first is not given it
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    host, port = tls_stack.gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        assert s.selected_alpn_protocol() in (None, "http/1.1")
        assert s.version() in ("TLSv1.2", "TLSv1.3")
    # the certificate is checked: without the CA the client refuses the gateway
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(tls_stack.gateway_url + "/v1/models", timeout=5)


def test_plain_http_to_the_tls_port_is_told_so(tls_stack: TlsStack) -> None:
    r = requests.get(f"http://{tls_stack.gateway}/v1/models", timeout=5)
    assert r.status_code == 400
    assert "plain HTTP request was sent to HTTPS port" in r.text


def test_a_renewed_certificate_is_served_within_seconds_without_dropping_requests(tls_stack: TlsStack) -> None:
    assert served_serial(tls_stack.gateway, tls_stack.pki.ca) == 1
    # unchanged files: the watch's first look (the running config's files digest) reloads nothing
    assert not any("reloaded" in e["message"] for e in tls_stack.events("reload"))
    failures: list[str] = []
    done = threading.Event()
    counts = {"ok": 0}

    def traffic() -> None:  # one new connection per request, during the whole renewal
        while not done.is_set():
            try:
                r = tls_stack.chat()
                if r.status_code == 200:
                    counts["ok"] += 1
                else:
                    failures.append(f"{r.status_code} {r.text[:200]}")
            except requests.RequestException as exc:
                failures.append(repr(exc))

    stream_out: dict = {}

    def stream() -> None:  # one long stream in flight across the reload
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 200,
                "stream": True}
        try:
            with requests.post(tls_stack.gateway_url + "/v1/chat/completions", json=body, stream=True, timeout=30,
                               verify=str(tls_stack.pki.ca), headers={"Cache-Control": "no-store"}) as r:
                stream_out["status"] = r.status_code
                stream_out["lines"] = [ln for ln in r.iter_lines() if ln.startswith(b"data: ")]
        except requests.RequestException as exc:
            stream_out["error"] = repr(exc)

    threads = [threading.Thread(target=traffic), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    tls_stack.pki.cert(tls_stack.gw_key, 2, tls_stack.gw_cert)
    wait_until(lambda: served_serial(tls_stack.gateway, tls_stack.pki.ca) == 2, "the renewed certificate", timeout=10)
    took = time.monotonic() - t0
    time.sleep(0.3)
    done.set()
    for t in threads:
        t.join(30)
    assert not failures, failures[:5]
    assert counts["ok"] > 0
    assert stream_out.get("status") == 200 and "error" not in stream_out, stream_out
    assert stream_out["lines"][-1] == b"data: [DONE]" and len(stream_out["lines"]) > 10
    assert took < 5, f"renewal served after {took:.1f} s"
    print(f"renewed certificate served {took:.2f} s after the write; {counts['ok']} requests meanwhile, 0 failed")
    assert any("reloaded" in e["message"] for e in tls_stack.events("reload"))


def test_a_renewed_certificate_that_does_not_match_its_key_is_refused(tls_stack: TlsStack) -> None:
    assert served_serial(tls_stack.gateway, tls_stack.pki.ca) == 2
    before = {e["id"] for e in tls_stack.events("reload_failed")}
    other = tls_stack.pki.key("other")
    tls_stack.pki.cert(other, 3, tls_stack.gw_cert)  # a certificate of another key at the same path
    refused = wait_until(lambda: [e for e in tls_stack.events("reload_failed") if e["id"] not in before],
                         "the refusal", timeout=10)
    assert "gateway.tls.key" in refused[0]["message"] and "mismatch" in refused[0]["message"], refused[0]
    assert refused[0]["data"]["issues"][0]["path"] == "gateway.tls.key"
    # the running certificate keeps serving
    time.sleep(0.5)
    assert served_serial(tls_stack.gateway, tls_stack.pki.ca) == 2
    assert tls_stack.chat().status_code == 200
    # a policy naming the mismatched pair is refused at the field's path, through the API over HTTPS
    r = tls_stack.api("POST", "/api/v1/policy/validate", data=tls_stack.policy_path.read_bytes(),
                      headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422, r.text
    assert [i["path"] for i in r.json()["error"]["issues"]] == ["gateway.tls.key"]
    # the key renewed too (the second half of a two-file renewal): the pair loads
    tls_stack.pki.cert(tls_stack.gw_key, 4, tls_stack.gw_cert)
    wait_until(lambda: served_serial(tls_stack.gateway, tls_stack.pki.ca) == 4, "the fixed pair", timeout=10)


def test_the_batch_worker_sends_its_lines_to_its_own_gateway_over_https(tls_stack: TlsStack, tmp_path: Path) -> None:
    """The Batch API's worker (kvgate.batch.runner) in process, against the module's TLS gateway."""
    import asyncio
    import io

    import redis as redis_lib

    from kvgate.batch import records
    from kvgate.batch.files import FileStore
    from kvgate.batch.runner import Runner
    from kvgate.policy import load_policy
    from kvgate.policy.batch import window_seconds

    policy = load_policy(tls_stack.policy_path)
    r = redis_lib.Redis(host="127.0.0.1", port=tls_stack.redis_port, decode_responses=True)
    files = FileStore(tmp_path / "data", r)
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}
    f = files.create("", io.BytesIO(json.dumps(line).encode()), "in.jsonl", "batch", max_bytes=10 ** 6)
    rec = records.new_record(batch_id=records.new_batch_id(), tenant="", endpoint="/v1/chat/completions",
                             input_file_id=f["id"], completion_window="24h", window_s=window_seconds("24h"),
                             metadata=None)
    records.save_new(r, rec)
    runner = Runner(lambda: policy, r, files, tls_stack.token, worker_id="tls")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(runner.run(),), daemon=True)
    thread.start()
    try:
        h = wait_until(lambda: (lambda h: h if h["status"] in records.TERMINAL else None)(records.load(r, rec["id"])),
                       "the batch", timeout=20)
    finally:
        loop.call_soon_threadsafe(runner.stop)
        thread.join(10)
    assert h["status"] == records.COMPLETED and h["completed"] == "1", h
    with files.open("", h["output_file_id"]) as fh:
        out = json.loads(fh.read().decode().splitlines()[0])
    assert out["response"]["status_code"] == 200, out
    # /v1/batches goes through the gateway on to the control plane, HTTPS both hops
    listed = requests.get(tls_stack.gateway_url + "/v1/batches", verify=str(tls_stack.pki.ca), timeout=10)
    assert listed.status_code == 200, listed.text
    assert rec["id"] in [b["id"] for b in listed.json()["data"]]


# ----------------------------------------------------------------------------- the control plane
def test_control_plane_over_https(tls_stack: TlsStack) -> None:
    r = tls_stack.api("GET", "/api/v1/nodes")
    assert r.status_code == 200 and r.json()["nodes"][0]["id"] == "n1"
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://{tls_stack.control}/healthz", timeout=5)
    # the CLI: with the CA bundle it works, without it the certificate is refused
    env_args = ("nodes", "--control-url", tls_stack.control_url, "--token", tls_stack.token)
    ok = subprocess.run([sys.executable, "-m", "kvgate", "--run-dir", str(tls_stack.run_dir), *env_args],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, "KVGATE_CA_FILE": str(tls_stack.pki.ca)})
    assert ok.returncode == 0 and "n1" in ok.stdout, ok.stdout + ok.stderr
    bad = kvgate_cli(tls_stack.run_dir, *env_args, timeout=60)
    assert bad.returncode != 0 and "SSLError" in bad.stderr, bad.stdout + bad.stderr
    # the admin page's session cookie is Secure
    s = requests.Session()  # verify per request: $REQUESTS_CA_BUNDLE would override Session.verify
    page = s.get(tls_stack.control_url + "/admin/login", timeout=10, verify=str(tls_stack.pki.ca)).text
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    r = s.post(tls_stack.control_url + "/admin/login", data={"token": tls_stack.token, "csrf_token": csrf},
               allow_redirects=False, timeout=10, verify=str(tls_stack.pki.ca),
               # as a browser sends it (Referrer-Policy: same-origin): Flask-WTF checks it over HTTPS
               headers={"Referer": tls_stack.control_url + "/admin/login"})
    assert r.status_code == 303, r.text[:300]
    assert "secure" in r.headers["Set-Cookie"].lower()


def test_control_plane_certificate_renewal(tls_stack: TlsStack) -> None:
    assert served_serial(tls_stack.control, tls_stack.pki.ca) == 1
    tls_stack.pki.cert(tls_stack.ctl_key, 2, tls_stack.ctl_cert)
    wait_until(lambda: served_serial(tls_stack.control, tls_stack.pki.ca) == 2, "the control plane's new certificate",
               timeout=10)
    assert tls_stack.api("GET", "/healthz").status_code == 200


def test_control_plane_stops_promptly_with_a_client_connected(tls_stack: TlsStack, tmp_path: Path) -> None:
    """SIGTERM ends `kvgate control` over HTTPS as over HTTP (the shutdown comments in
    kvgate.control.cli): exit 0 within seconds while a client holds an idle keep-alive connection.
    A second control plane, on its own Redis, writing the gateway config only (--external-gateway)."""
    redis = _start_redis(tmp_path)
    try:
        control = f"127.0.0.1:{_free_port_28k()}"
        text = tls_stack.policy_path.read_text()
        text = re.sub(r'url: "redis://[^"]+"', f'url: "{redis.url}"', text)
        text = text.replace(f'listen: "{tls_stack.control}"', f'listen: "{control}"')
        policy = tmp_path / "policy.yaml"
        policy.write_text(text)
        run = tmp_path / "run"
        # --external-gateway: it writes the config, the module's nginx stays the only one on the port
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "--run-dir", str(run), "control", "--policy",
                                 str(policy), "--external-gateway"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            s = requests.Session()
            wait_until(lambda: _ok(s, f"https://{control}/healthz", tls_stack.pki.ca), "the second control plane",
                       timeout=30)
            t0 = time.monotonic()
            proc.terminate()
            assert proc.wait(10) == 0
            assert time.monotonic() - t0 < 5
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        redis.stop()


def _ok(s: requests.Session, url: str, ca: Path) -> bool:
    try:
        return s.get(url, timeout=1, verify=str(ca)).status_code == 200
    except requests.RequestException:
        return False


# ----------------------------------------------------------------------------- kvgate up
def test_kvgate_up_with_tls_on_both_listeners(control_fleet, tmp_path: Path) -> None:
    """`kvgate up` of a policy with gateway.tls and a self-signed control.tls, both named relative
    to the policy file's folder: the stack's health checks, the agents' reports, `kvgate status`
    and `kvgate nodes` all go over HTTPS, the CLI trusting the run dir's self-signed certificate
    with no CA file given."""
    pki = Pki(tmp_path / "pki")
    gw_key = pki.key("gateway")
    gw_cert = pki.dir / "gateway.pem"
    pki.cert(gw_key, 1, gw_cert)
    ctl_key, ctl_cert = pki.dir / "self.key", pki.dir / "self.pem"
    pki._openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ctl_key), "-out", str(ctl_cert),
                 "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1")

    def template(fleet, **kw) -> str:
        from ctlfixtures import default_template

        # the policy files are written in tmp_path (control_fleet's folder too): relative names
        rel = {p: p.relative_to(tmp_path) for p in (gw_cert, gw_key, ctl_cert, ctl_key)}
        text = default_template(fleet, gateway_extra=f', tls: {{certificate: "{rel[gw_cert]}", key: "{rel[gw_key]}"}}',
                                **kw)
        return text.replace("control: {", f'control: {{tls: {{certificate: "{rel[ctl_cert]}", key: "{rel[ctl_key]}"}}, ',
                            1)

    fleet = control_fleet(n=1, template=template)
    https = f"https://127.0.0.1:{fleet.control_port}"
    r = requests.get(https + "/api/v1/nodes", headers={"Authorization": f"Bearer {fleet.token}"},
                     verify=str(ctl_cert), timeout=10)
    assert r.status_code == 200
    wait_until(lambda: requests.get(https + "/api/v1/nodes", headers={"Authorization": f"Bearer {fleet.token}"},
                                    verify=str(ctl_cert), timeout=10).json()["nodes"][0].get("report"),
               "the agent's report over https", timeout=20)
    nodes = fleet.kvgate("nodes")
    assert nodes.returncode == 0 and "n1" in nodes.stdout, nodes.stdout + nodes.stderr
    status = fleet.kvgate("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"https://127.0.0.1:{fleet.gateway_port}" in status.stdout and https in status.stdout, status.stdout
    r = requests.post(f"https://127.0.0.1:{fleet.gateway_port}/v1/chat/completions", verify=str(pki.ca), timeout=30,
                      json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
