"""docker-compose.yml, Dockerfile and policies/compose.yaml agree with each other and with the code.

There is no Docker engine on the development machines, so the Docker packaging is checked
statically: the compose file parses; every service builds from this repository's Dockerfile,
which runs scripts/setup; every command names a program the image has and, for `kvgate`, a
subcommand and options that exist; published ports, agents, engines and the control plane's
paths match policies/compose.yaml; and that policy validates and renders.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from click.testing import CliRunner

from kvgate.cli import main as kvgate_main
from kvgate.policy import load_policy
from kvgate.render import default_lua_dir, render
from kvgate.stack import Stack

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SETUP = REPO / "scripts" / "setup"
VENDOR = "control/kvgate/web/admin/static/vendor"   # the admin page's uPlot (scripts/build-web)
DEMO = load_policy(REPO / "policies" / "demo.yaml")
POLICY = load_policy(REPO / "policies" / "compose.yaml")
IMAGE_ROOT = "/opt/kvgate"           # the Dockerfile's WORKDIR, where the repository is copied
NODE_IDS = [n.id for n in POLICY.nodes()]


def _interpolate(value):
    """Compose's interpolation of a parsed file: `$$` is a literal `$`. The file uses no
    variables, so any other `$` is a mistake (compose would substitute it, mostly with "")."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, str):
        if "$" in value.replace("$$", ""):
            UNESCAPED.append(value)
        return value.replace("$$", "$")
    return value


UNESCAPED: list[str] = []


def _load_compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


COMPOSE = _load_compose()
SERVICES: dict[str, dict] = COMPOSE["services"]


def _port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def argv(service: str) -> list[str]:
    """The program and arguments a service finally runs. `sh -c SCRIPT ARG0 ARGS...` runs
    ARG0 ARGS (the script ends in `exec "$0" "$@"`); `sh -c SCRIPT` runs the script's `exec` line."""
    cmd = SERVICES[service]["command"]
    assert isinstance(cmd, list), f"{service}: write the command as a list (exec form)"
    if cmd[:2] != ["sh", "-c"]:
        return cmd
    script = cmd[2]
    if len(cmd) > 3:
        assert script.rstrip().endswith('exec "$0" "$@"'), f"{service}: {script!r}"
        return cmd[3:]
    execs = [line.strip() for line in script.splitlines() if line.strip().startswith("exec ")]
    assert len(execs) == 1, f"{service}: the script must end in one exec line"
    return shlex.split(execs[0])[1:]


def options(args: list[str]) -> dict[str, str | bool]:
    """`--name value` pairs and bare `--flag`s of a command line (after its subcommand)."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"unexpected positional argument {arg!r} in {args}"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
            i += 2
        else:
            out[arg] = True
            i += 1
    return out


def kvgate_call(service: str) -> tuple[dict[str, str | bool], str, dict[str, str | bool]]:
    """A `kvgate [GLOBAL OPTIONS] SUB [OPTIONS]` command line: (global options, SUB, options)."""
    args = argv(service)
    assert args[0] == "kvgate", f"{service} does not run kvgate"
    i = 1
    while args[i].startswith("--"):
        i += 2                       # the group's options all take a value (--run-dir DIR)
    return options(args[1:i]), args[i], options(args[i + 1:])


def apt_packages(name: str = "APT_PACKAGES") -> list[str]:
    text = SETUP.read_text()
    m = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert m, f"scripts/setup defines {name}=(...)"
    return m.group(1).split()


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined, comments left out), one list
    per build stage, each beginning with its FROM."""
    text = DOCKERFILE.read_text()
    stages: list[list[str]] = []
    for ln in re.sub(r"\\\n", " ", text).splitlines():
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith("FROM "):
            stages.append([])
        assert stages, f"an instruction before the first FROM: {ln}"
        stages[-1].append(re.sub(r"\s+", " ", ln))
    return stages


# The programs commands and healthchecks may run, and where the image gets each.
PROGRAMS = {
    "kvgate": "the venv (scripts/setup)",
    "python3": "the venv (scripts/setup)",
    "sh": "debian:bookworm-slim",
    "nginx": "nginx",
    "redis-server": "redis-server",
    "redis-cli": "redis-tools",
    "redis-sentinel": "redis-sentinel",
}


@cache
def kvgate_help(sub: str | None) -> str:
    """`kvgate SUB --help` (`kvgate --help` for None), in process: the subcommand must import."""
    result = CliRunner().invoke(kvgate_main, [*([sub] if sub else []), "--help"], prog_name="kvgate")
    assert result.exit_code == 0, f"`kvgate {sub or ''} --help` failed:\n{result.output[-2000:]}{result.exception!r}"
    return result.output


def has_option(help_text: str, opt: str) -> bool:
    return re.search(rf"(^|[\s,/]){re.escape(opt)}([\s=,/]|$)", help_text, re.M) is not None


def volume_mounts(service: str) -> dict[str, tuple[str, bool]]:
    """target path → (named volume, read_only) of a service's volumes."""
    out = {}
    for v in SERVICES[service].get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out[target] = (source, "ro" in mode)
        else:
            assert v["type"] == "volume", v
            out[v["target"]] = (v["source"], bool(v.get("read_only")))
    return out


# ------------------------------------------------------------------ the compose file

def test_compose_file_is_a_compose_spec_file() -> None:
    assert not UNESCAPED, f"compose would substitute these `$` (mostly with nothing): write $$ in {UNESCAPED}"
    assert "version" not in COMPOSE, "the compose spec has no `version:` key (compose warns that it is obsolete)"
    expected = {"redis", "gateway", "control", "batch-worker", "semantic"} | {f"engine-{n}" for n in NODE_IDS} \
        | {f"agent-{n}" for n in NODE_IDS} | {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"} \
        | {"gateway-b", "semantic-b"}
    assert set(SERVICES) == expected
    declared = set(COMPOSE.get("volumes") or {})
    for name, svc in SERVICES.items():
        for source, _ in volume_mounts(name).values():
            if source.startswith(("./", "/")):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name}: bind mount of missing {source}"
            else:
                assert source in declared, f"{name}: volume {source!r} is not declared at the top level"
        assert svc.get("restart") == "unless-stopped", name
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            assert spec["condition"] in ("service_started", "service_healthy"), (name, dep)
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy, which has no healthcheck"


def test_every_service_builds_the_one_image_from_this_repository() -> None:
    images = set()
    for name, svc in SERVICES.items():
        build = svc.get("build")
        assert build is not None, f"{name}: no build"
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (COMPOSE_FILE.parent / context).resolve() == REPO, name
        assert (REPO / context / dockerfile).is_file(), name
        images.add(svc.get("image"))
    # one image name: compose builds it once, every service runs the same bytes
    assert len(images) == 1 and None not in images


def test_dockerfile_installs_with_scripts_setup() -> None:
    instructions = dockerfile_stages()[-1]           # the final image
    assert instructions[0] == "FROM debian:bookworm-slim"
    assert "WORKDIR " + IMAGE_ROOT in instructions
    runs = [i for i in instructions if i.startswith("RUN ")]
    assert any(re.search(r"\bscripts/setup --no-test-extras\b", r) for r in runs), runs
    assert not any("pip install" in r or "apt-get install" in r for r in runs), \
        "install through scripts/setup, like `make setup`, not beside it"
    assert any(i.startswith("ENV PATH=" + IMAGE_ROOT + "/.venv/bin:") for i in instructions)
    assert not any("playwright" in i for i in instructions), "the image runs no browser"
    # COPY . must happen before the venv install (an editable install needs the source tree)
    copy_all = next(n for n, i in enumerate(instructions) if re.fullmatch(r"COPY \. (\.|/opt/kvgate/?)", i))
    venv_run = next(n for n, i in enumerate(instructions) if "--no-test-extras" in i and "--no-venv" not in i)
    assert copy_all < venv_run


def test_dockerfile_final_image_gets_vendored_uplot_and_no_browser() -> None:
    *builders, final = dockerfile_stages()
    # the web stage: Node, scripts/build-web on the pinned lock file
    web = next((st for st in builders if re.fullmatch(r"FROM node:\S+ AS web", st[0], re.I)), None)
    assert web is not None, "a `FROM node:... AS web` stage vendors uPlot (the final image carries no Node)"
    copied = " ".join(i for i in web if i.startswith("COPY "))
    for needed in ("web/package.json", "web/package-lock.json", "scripts/build-web"):
        assert needed in copied and (REPO / needed).is_file(), needed
    assert any(re.search(r"\bscripts/build-web\s*$", i) for i in web if i.startswith("RUN ")), web
    # the final stage copies the vendor folder from it, after the source tree, before scripts/setup
    copy_all = final.index(next(i for i in final if re.fullmatch(r"COPY \. (\.|/opt/kvgate/?)", i)))
    vendor = [n for n, i in enumerate(final)
              if re.fullmatch(rf"COPY --from=web {IMAGE_ROOT}/{VENDOR}/? {VENDOR}/?", i)]
    assert vendor, f"the final image gets {VENDOR} from the web stage"
    setup_runs = [n for n, i in enumerate(final) if i.startswith("RUN ") and "scripts/setup" in i]
    assert copy_all < vendor[0] < max(setup_runs)
    # no test extras anywhere in the final image: no Chromium, no Playwright, no npm of its own
    assert "chromium" in apt_packages("TEST_APT_PACKAGES") and "chromium" not in apt_packages()
    for n in setup_runs:
        assert "--no-test-extras" in final[n], f"scripts/setup without --no-test-extras installs Chromium: {final[n]}"
    venv_run = final[max(setup_runs)]
    assert "--no-web" in venv_run and "scripts/build-web --check" in venv_run, \
        "the image checks the web stage's files instead of fetching them again (with npm)"
    assert not any(re.search(r"\b(chromium|npm|nodejs|playwright)\b", i) for i in final if i.startswith("RUN "))


def test_dockerignore_keeps_what_the_image_needs() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch(p, pat.removeprefix("**/")) or fnmatch(p, pat) for p in prefixes for pat in patterns)

    for needed in ["scripts/setup", "pyproject.toml", "README.md", "control/kvgate/cli/__init__.py",
                   "lua/kvgate", "nginx/nginx.conf.j2", "policies/compose.yaml"]:
        assert (REPO / needed).exists(), needed
        assert not ignored(needed), f".dockerignore leaves {needed} out of the image"
    for needed in ["scripts/build-web", "web/package.json", "web/package-lock.json"]:
        assert not ignored(needed), f".dockerignore leaves {needed} out of the image (build-web --check reads it)"
    # the vendored files come from the Dockerfile's web stage, never from the host
    for host_only in [".venv", ".git", ".kvgate", "control/kvgate.egg-info", "web/node_modules", VENDOR]:
        assert ignored(host_only), f".dockerignore should keep the host's {host_only} out of the image"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_commands_run_programs_the_image_has(service: str) -> None:
    args = argv(service)
    assert args[0] in PROGRAMS, f"{service}: {args[0]} is not a program the image provides"
    package = PROGRAMS[args[0]]
    if package[0].isalpha() and " " not in package and package != "debian:bookworm-slim":
        assert package in apt_packages(), f"{service}: {args[0]} comes from {package}, which scripts/setup does not install"
    check = SERVICES[service].get("healthcheck", {}).get("test")
    if check:
        if check[0] == "CMD":
            assert check[1] in PROGRAMS, f"{service}: healthcheck runs {check[1]}"
        else:
            assert check[0] == "CMD-SHELL"
            words = set(re.findall(r"[\w.-]+", check[1]))
            for prog, pkg in PROGRAMS.items():
                if prog in words and pkg in ("redis-tools", "nginx", "redis-server"):
                    assert pkg in apt_packages()


def _kvgate_services() -> list[str]:
    out = []
    for s in sorted(SERVICES):
        try:
            if argv(s)[0] != "kvgate":
                continue
        except (AssertionError, KeyError, IndexError):
            pass                     # a broken command fails in the test, not at collection
        out.append(s)
    return out


KVGATE_SERVICES = _kvgate_services()


@pytest.mark.parametrize("service", KVGATE_SERVICES)
def test_kvgate_subcommands_and_options_exist(service: str) -> None:
    group_opts, sub, opts = kvgate_call(service)
    for opt in group_opts:
        assert has_option(kvgate_help(None), opt), f"{service}: `kvgate` has no option {opt}"
    text = kvgate_help(sub)
    for opt in opts:
        assert has_option(text, opt), f"{service}: `kvgate {sub}` has no option {opt}"


def test_operator_commands_of_the_docs_exist() -> None:
    # docs/docker.md: `docker compose exec control kvgate token` (and nodes, drain) find the run
    # dir through KVGATE_RUN_DIR, which the control service sets
    assert "KVGATE_RUN_DIR" in (REPO / "control" / "kvgate" / "cli" / "__init__.py").read_text()
    for sub in ("token", "nodes", "drain", "apply"):
        kvgate_help(sub)


# ------------------------------------------------------------------ compose ↔ policies/compose.yaml

def test_published_ports_are_the_policies_ports() -> None:
    published = {}
    for spec in SERVICES["gateway"]["ports"]:
        *host, host_port, container_port = str(spec).split(":")
        published[int(container_port)] = int(host_port)
    assert set(published) == {_port(POLICY.gateway.listen), _port(POLICY.control.listen)}
    # the same addresses as the local demo, so the README's curl lines work against either
    assert published == {_port(DEMO.gateway.listen): _port(DEMO.gateway.listen),
                         _port(DEMO.control.listen): _port(DEMO.control.listen)}
    # published ports reach a container through its network interface, not its loopback
    assert POLICY.gateway.listen.startswith("0.0.0.0:") and POLICY.control.listen.startswith("0.0.0.0:")
    assert "ports" not in SERVICES["control"], "control shares the gateway's network namespace and ports"


def test_control_service_runs_the_compose_policy_behind_the_gateway() -> None:
    svc = SERVICES["control"]
    assert svc["network_mode"] == "service:gateway" and svc["pid"] == "service:gateway"
    group_opts, sub, opts = kvgate_call("control")
    assert sub == "control"
    assert opts["--policy"] == f"{IMAGE_ROOT}/policies/compose.yaml"
    # the image's copy, or this checkout's policies/ mounted over it (read-only)
    policies = volume_mounts("control").get(f"{IMAGE_ROOT}/policies")
    assert policies in (None, ("./policies", True))
    assert opts["--listen"] == POLICY.control.listen
    assert opts["--external-gateway"] is True
    # the nginx prefix is one volume at one path in both containers: nginxctl recognises the
    # master by `-p PREFIX/` in its command line and signals the pid in PREFIX/logs/nginx.pid
    prefix = opts["--nginx-prefix"]
    gw_args = argv("gateway")
    assert gw_args[0] == "nginx"
    gw_opts = dict(zip(gw_args[1::2], gw_args[2::2]))
    assert gw_opts["-p"] == prefix + "/" and gw_opts["-c"] == "conf/nginx.conf"
    assert "daemon off;" in gw_opts["-g"]
    assert volume_mounts("control")[prefix] == volume_mounts("gateway")[prefix]
    run_dir = group_opts["--run-dir"]
    assert volume_mounts("control")[run_dir][1] is False
    # `docker compose exec control kvgate token` reads the same run dir
    assert svc["environment"]["KVGATE_RUN_DIR"] == run_dir
    # the gateway waits for both rendered files (kvgate.json is written last)
    script = SERVICES["gateway"]["command"][2]
    assert "conf/nginx.conf" in script and "conf/kvgate.json" in script


@pytest.mark.parametrize("node_id", NODE_IDS)
def test_engine_service_runs_the_policys_simulator(node_id: str) -> None:
    node = POLICY.node(node_id)
    assert not node.simulate, "compose runs the engines; `simulate: true` would make kvgate start them too"
    service = node.host
    assert service == f"engine-{node_id}" and service in SERVICES
    args = argv(service)
    assert args[:2] == ["kvgate", "sim"]
    got = options(args[2:])
    # what `kvgate up` would run for this node, listening on every interface of the container
    want = options(Stack.sim_command(POLICY, node)[4:])
    want["--host"] = "0.0.0.0"

    def norm(opts: dict) -> dict:
        out = {}
        for k, v in opts.items():
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                out[k] = v
        return out

    assert norm(got) == norm(want)
    assert int(got["--port"]) == node.port
    assert "control" in SERVICES and service in SERVICES["control"]["depends_on"], \
        "nginx resolves engine names when it loads a config: the control plane must start after them"


@pytest.mark.parametrize("node_id", NODE_IDS)
def test_agent_service_reports_its_node(node_id: str) -> None:
    node = POLICY.node(node_id)
    args = argv(f"agent-{node_id}")
    assert args[:2] == ["kvgate", "agent"]
    opts = options(args[2:])
    assert opts["--node-id"] == node.id
    assert opts["--engine-url"] == node.url
    control = urlsplit(str(opts["--control-url"]))
    assert control.hostname == "gateway", "the control plane listens in the gateway's network namespace"
    assert control.port == _port(POLICY.control.listen)
    token = Path(str(opts["--token-file"]))
    run_dir = kvgate_call("control")[0]["--run-dir"]
    assert token == Path(run_dir) / "admin.token"
    mounts = volume_mounts(f"agent-{node_id}")
    assert mounts[run_dir] == (volume_mounts("control")[run_dir][0], True), "the run dir, read-only"
    # the agent waits for the token the control plane writes on its first start
    assert str(token) in SERVICES[f"agent-{node_id}"]["command"][2]


def test_redis_service_is_the_policys_redis() -> None:
    assert POLICY.redis.host == "redis" and "redis" in SERVICES
    assert POLICY.redis.managed is False
    opts = options(argv("redis")[1:])
    assert int(opts.get("--port", 6379)) == POLICY.redis.port
    assert opts["--bind"] == "0.0.0.0"
    assert "ports" not in SERVICES["redis"], "Redis runs without protected mode: keep it off the host"
    assert opts["--appendonly"] == "yes" and opts["--dir"] in volume_mounts("redis")


def test_compose_policy_is_the_demo_policy_at_container_addresses() -> None:
    for demo_pool, pool in zip(DEMO.pools, POLICY.pools, strict=True):
        assert pool.model_copy(update={"nodes": demo_pool.nodes}) == demo_pool, "only the nodes differ"
    assert [(a.id, a.weight) for a in POLICY.nodes()] == [(d.id, d.weight) for d in DEMO.nodes()]
    for field in ("simulator", "cache", "health", "weights", "ramp", "drain", "tenants", "limits"):
        assert getattr(POLICY, field) == getattr(DEMO, field), field
    assert POLICY.gateway.model_copy(update={"listen": DEMO.gateway.listen}) == DEMO.gateway


def test_compose_policy_validates() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvgate", "validate", str(REPO / "policies" / "compose.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ok (1 pool(s), 4 node(s))" in proc.stdout


def test_compose_policy_renders_where_the_service_names_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    # In the control container the compose DNS answers for the service names; here a fake does.
    addresses = {"redis": "172.30.0.2", **{f"engine-{n}": f"172.30.0.{10 + i}" for i, n in enumerate(NODE_IDS)},
                 **{f"sentinel-{i}": f"172.30.0.{20 + i}" for i in (1, 2, 3)}}

    def compose_dns(host, port, family=0, type=0, proto=0, flags=0):
        if host not in addresses or family == socket.AF_INET6:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (addresses[host], port))]

    monkeypatch.setattr(socket, "getaddrinfo", compose_dns)
    files = render(POLICY, default_lua_dir())
    conf = files["conf/nginx.conf"]
    assert f"listen {POLICY.gateway.listen};" in conf
    data = yaml.safe_load(files["conf/kvgate.json"])          # JSON is YAML
    for node in POLICY.nodes():
        # the Lua balancer connects to the address the service name resolved to; the server line
        # is that peer (one try per node), without weight or state (the runtime's)
        peer = f"{addresses[node.host]}:{node.port}"
        assert f"server {peer};  # {node.id}" in conf
        assert data["nodes_by_addr"][peer] == node.id
        assert {"id": node.id, "peer": peer}.items() <= next(
            n for n in data["pools"][POLICY.pools[0].name]["nodes"] if n["id"] == node.id).items()
    # through Sentinel: the data path asks the sentinels (at the addresses their names resolved
    # to) for the master of master_name
    assert data["redis"]["sentinels"] == [{"host": addresses[f"sentinel-{i}"], "port": 26379} for i in (1, 2, 3)]
    assert data["redis"]["master_name"] == POLICY.redis.master_name


def test_batch_worker_runs_the_compose_policy_through_the_gateway() -> None:
    """The Batch API's worker: in the gateway's network namespace (it sends lines to the
    policy's gateway.listen there), the compose policy, the admin token and the run dir's data/
    (shared, writable, with the control plane) from the run-dir volume."""
    svc = SERVICES["batch-worker"]
    assert svc["network_mode"] == "service:gateway"
    cmd = svc["command"]
    i = cmd.index("batch-worker")
    opts = dict(zip(cmd[i + 1::2], cmd[i + 2::2]))
    assert opts["--policy"] == f"{IMAGE_ROOT}/policies/compose.yaml"
    assert opts["--token-file"] == "/var/lib/kvgate/run/admin.token"
    assert cmd[cmd.index("--run-dir") + 1] == "/var/lib/kvgate/run"
    mounts = {v.split(":")[1]: v for v in svc["volumes"]}
    assert mounts["/var/lib/kvgate/run"] == "run-dir:/var/lib/kvgate/run"  # writable: output files
    assert POLICY.batch.enabled and POLICY.batch.data_dir is None  # → <run dir>/data, on that volume


# ------------------------------------------------------------------ the tier: Sentinel and two gateways

def test_sentinels_watch_the_policys_master_with_a_replica() -> None:
    sentinels = [split for split in (a.rpartition(":") for a in POLICY.redis.sentinels)]
    assert [h for h, _, _ in sentinels] == ["sentinel-1", "sentinel-2", "sentinel-3"]
    assert POLICY.redis.managed is False
    for host, _, port in sentinels:
        assert argv(host) == ["redis-sentinel", "/data/sentinel.conf"]
        script = SERVICES[host]["command"][2]
        # the first config: the master by its service name, a quorum of 2 of the 3
        assert f"port {port}" in script
        assert f"sentinel monitor {POLICY.redis.master_name} {POLICY.redis.host} {POLICY.redis.port} 2" in script
        assert "resolve-hostnames yes" in script
        assert volume_mounts(host)["/data"][0] == f"{host}-data", "each sentinel keeps its own rewritten config"
        assert "redis-cli -p 26379 ping" in SERVICES[host]["healthcheck"]["test"][1]
        assert "ports" not in SERVICES[host]
    args = argv("redis-replica")
    assert args[0] == "redis-server" and args[-3:] == ["--replicaof", POLICY.redis.host, str(POLICY.redis.port)]
    assert options(args[1:-3])["--appendonly"] == "yes"
    assert "ports" not in SERVICES["redis-replica"]
    for s in ("sentinel-1", "sentinel-2", "sentinel-3"):
        assert s in SERVICES["control"]["depends_on"], "the control plane renders the sentinels' addresses"


def test_second_gateway_member_runs_the_supervisor() -> None:
    members = {m.id: m for m in POLICY.gateway_members()}
    assert list(members) == ["a", "b"] and members["a"].listen == POLICY.gateway.listen
    group_opts, sub, opts = kvgate_call("gateway-b")
    assert sub == "gateway" and opts["--id"] == "b"
    control = urlsplit(str(opts["--control"]))
    assert control.hostname == "gateway" and control.port == _port(POLICY.control.listen)
    run_dir = kvgate_call("control")[0]["--run-dir"]
    assert Path(str(opts["--token-file"])) == Path(run_dir) / "admin.token"
    assert volume_mounts("gateway-b")[run_dir] == (volume_mounts("control")[run_dir][0], True)
    assert volume_mounts("gateway-b")[str(opts["--prefix"])][0] == "nginx-prefix-b", "its own nginx prefix"
    published = {int(str(p).split(":")[-1]): int(str(p).split(":")[-2]) for p in SERVICES["gateway-b"]["ports"]}
    assert published == {_port(members["b"].listen): _port(members["b"].listen)}
    assert members["b"].listen.startswith("0.0.0.0:")
    # the semantic service of member b, in its network namespace at the policy's address
    assert SERVICES["semantic-b"]["network_mode"] == "service:gateway-b"
    assert kvgate_call("semantic-b")[2]["--policy"] == f"{IMAGE_ROOT}/policies/compose.yaml"
    assert POLICY.semantic_service.listen.startswith("127.0.0.1:")
