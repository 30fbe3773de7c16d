"""Load a policy YAML file into :class:`~kvgate.policy.model.Policy`.

Errors are :class:`PolicyError` carrying the YAML path of the bad field
(``pools[0].nodes[1].url``) and a one-line reason, so the CLI can print them
without a traceback and the control plane can return them to the operator.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .model import DEFAULT_TENANT, Policy


@dataclass
class PolicyIssue:
    """One problem found in a policy: ``path`` like ``pools[0].balancer``, ``reason`` one line."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class PolicyError(ValueError):
    """A policy that cannot be used. ``issues`` lists every problem found (at least one)."""

    def __init__(self, source: str, issues: list[PolicyIssue]):
        self.source = source
        self.issues = issues
        super().__init__(f"{source}: " + "; ".join(str(i) for i in issues))


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _reason(err: dict[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; see docs/policy-reference.md)"
    if kind == "missing":
        return "required field is missing"
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    return msg.splitlines()[0]


def parse_policy(data: Any, source: str = "<policy>") -> Policy:
    """Validate already-parsed YAML/JSON data.

    Raises:
        PolicyError: with one issue per bad field, paths in YAML notation.
    """
    if not isinstance(data, dict):
        raise PolicyError(source, [PolicyIssue("", "the policy must be a YAML mapping")])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            issues.append(PolicyIssue(_path(loc), _reason(err)))
        raise PolicyError(source, issues) from None
    issues = cross_check(policy)
    if issues:
        raise PolicyError(source, issues)
    return policy


_WILDCARDS = {"0.0.0.0", "::", "[::]", "*"}
_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def _same_host(a: str, b: str) -> bool:
    """Whether two listeners' hosts collide on this machine: equal, both loopback spellings
    (127.0.0.1, localhost, ::1), or a wildcard (0.0.0.0, ::) against a loopback or wildcard
    host. Remote hosts on the same port never collide with a local wildcard."""
    if a == b:
        return True

    def loopback(h: str) -> bool:
        if h in _LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(h.strip("[]")).is_loopback
        except ValueError:
            return False

    local_a = a in _WILDCARDS or loopback(a)
    local_b = b in _WILDCARDS or loopback(b)
    return local_a and local_b


def cross_check(policy: Policy) -> list[PolicyIssue]:
    """Rules that span fields: unique pool names, node ids and addresses, each model in one
    pool, and no two listeners (gateway, its internal listener, Redis, control plane, nodes) on one address."""
    issues: list[PolicyIssue] = []
    host, _, port = policy.gateway.listen.rpartition(":")
    listeners: list[tuple[str, int, str]] = [(host, int(port), "gateway.listen")]

    def clash(where: str, host: str, port: int) -> None:
        for other_host, other_port, other in listeners:
            if port == other_port and _same_host(host, other_host):
                issues.append(PolicyIssue(where, f"{host}:{port} is also {other} ({other_host}:{other_port})"
                                          if other_host != host else f"{host}:{port} is also {other}"))
                return
        listeners.append((host, port, where))

    internal = policy.gateway.internal_listen
    if not internal.startswith("unix:"):
        ihost, _, iport = internal.rpartition(":")
        clash("gateway.internal_listen", ihost.strip("[]"), int(iport))
    if policy.redis.managed:
        clash("redis.url", policy.redis.host, policy.redis.port)
    chost, _, cport = policy.control.listen.rpartition(":")
    clash("control.listen", chost, int(cport))
    issues += _member_issues(policy, clash)
    pools: dict[str, int] = {}
    models: dict[str, str] = {}
    node_ids: dict[str, str] = {}
    for i, pool in enumerate(policy.pools):
        if pool.name in pools:
            issues.append(PolicyIssue(f"pools[{i}].name", f"pool name {pool.name!r} is already used by pools[{pools[pool.name]}]"))
        pools.setdefault(pool.name, i)
        for j, model in enumerate(pool.models):
            if model in models:
                issues.append(PolicyIssue(f"pools[{i}].models[{j}]",
                                          f"model {model!r} is already served by pool {models[model]!r}"))
            models.setdefault(model, pool.name)
        for j, node in enumerate(pool.nodes):
            here = f"pools[{i}].nodes[{j}]"
            if node.id in node_ids:
                issues.append(PolicyIssue(f"{here}.id", f"node id {node.id!r} is already used by {node_ids[node.id]}"))
            node_ids.setdefault(node.id, here)
            clash(f"{here}.url", node.host, node.port)
    issues += _tenant_issues(policy, models)
    passive = policy.health.passive
    if passive.enabled and passive.window_s < 2 * policy.control.tick_s:
        # the 5xx share is the difference of two scrapes of the gateway (one per tick)
        issues.append(PolicyIssue("health.passive.window_s", f"{passive.window_s:g}s is shorter than two reconciler "
                                  f"rounds (2 × control.tick_s = {2 * policy.control.tick_s:g}s): the share would be "
                                  "judged on a single scrape of the gateway"))
    return issues


def _member_issues(policy: Policy, clash: Any) -> list[PolicyIssue]:
    """The ``gateways:`` members (docs/scale-out.md): unique ids and client listeners, internal
    listeners unique among the members of one host, the first at ``gateway.listen`` (the control
    plane's own nginx), the others clear of every other listener (``clash``)."""
    issues: list[PolicyIssue] = []
    if not policy.gateways:
        return issues
    first = policy.gateways[0]
    for name in ("listen", "internal_listen"):
        if getattr(first, name) != getattr(policy.gateway, name):
            issues.append(PolicyIssue(f"gateways[0].{name}", f"the first member is the gateway the control plane "
                                      f"drives itself: its {name} must be gateway.{name} "
                                      f"({getattr(policy.gateway, name)}), or leave gateway.{name} out"))
    ids: dict[str, int] = {}
    listens: dict[str, int] = {}
    internals: dict[tuple[str, str], int] = {}
    for i, m in enumerate(policy.gateways):
        if m.id in ids:
            issues.append(PolicyIssue(f"gateways[{i}].id", f"gateway id {m.id!r} is already used by gateways[{ids[m.id]}]"))
        ids.setdefault(m.id, i)
        host, _, port = m.listen.rpartition(":")
        if m.listen in listens:
            issues.append(PolicyIssue(f"gateways[{i}].listen", f"{m.listen} is also gateways[{listens[m.listen]}].listen"))
        elif i > 0:
            clash(f"gateways[{i}].listen", host, int(port))
        listens.setdefault(m.listen, i)
        # an internal listener is loopback: two members on one host must not share one
        where = (host, m.internal_listen)
        if where in internals:
            issues.append(PolicyIssue(f"gateways[{i}].internal_listen", f"{m.internal_listen} is also "
                                      f"gateways[{internals[where]}].internal_listen on host {host}"))
        internals.setdefault(where, i)
    return issues


def _tenant_issues(policy: Policy, models: dict[str, str]) -> list[PolicyIssue]:
    """Unique tenant ids, known models, and the tenants ``gateway.auth`` needs."""
    issues: list[PolicyIssue] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(policy.tenants):
        if t.id in seen:
            issues.append(PolicyIssue(f"tenants[{i}].id", f"tenant id {t.id!r} is already used by tenants[{seen[t.id]}]"))
        seen.setdefault(t.id, i)
        for j, m in enumerate(t.models or []):
            if m not in models:
                issues.append(PolicyIssue(f"tenants[{i}].models[{j}]", f"model {m!r} is served by no pool"))
    auth = policy.gateway.auth
    if auth == "off" and policy.tenants:
        issues.append(PolicyIssue("gateway.auth", "tenants are defined but gateway.auth is off: "
                                  "set optional or required (or remove tenants)"))
    if auth == "optional" and DEFAULT_TENANT not in seen:
        issues.append(PolicyIssue("tenants", f"gateway.auth: optional maps keyless requests to the tenant "
                                  f"{DEFAULT_TENANT!r}: define it"))
    if auth == "required" and not policy.tenants:
        issues.append(PolicyIssue("tenants", "gateway.auth: required needs at least one tenant"))
    return issues


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""PyYAML's safe loader on libyaml where PyYAML was built with it (Debian's and the wheels are):
the same documents, ten times faster (a policy of 1,000 nodes: 60 ms, not 600 ms, in every
apply and validation)."""


def parse_policy_text(text: str, source: str = "<policy>") -> Policy:
    """Parse and validate YAML text. Raises :class:`PolicyError`."""
    try:
        data = yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PolicyError(source, [PolicyIssue(where, f"YAML syntax error: {problem}")]) from None
    return parse_policy(data, source)


def load_policy(path: str | Path, files_base: str | Path | None = None) -> Policy:
    """Read and validate a policy file. Raises :class:`PolicyError` (also for an unreadable file).

    ``files_base``: the folder relative file names in the policy (``static_answers``,
    ``gateway.tls`` and ``control.tls``) are read from; default the policy file's own (a copy
    elsewhere, such as the run dir's, passes the original's). The policy returned names its TLS
    files by absolute paths."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(str(p), [PolicyIssue("", f"cannot read the file: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        raise PolicyError(str(p), [PolicyIssue("", f"not UTF-8 text (byte {exc.start}): is this a policy YAML file?")]) from None
    policy = parse_policy_text(text, str(p))
    issues = static_answers_issues(policy, Path(files_base) if files_base is not None else p.parent)
    from .tls import resolve_tls, tls_problems  # gateway.tls, control.tls: readable PEM files, a matching key

    policy = resolve_tls(policy, Path(files_base) if files_base is not None else p.parent)  # relative paths
    issues += [PolicyIssue(path, reason) for path, reason in tls_problems(policy)]
    if issues:
        raise PolicyError(str(p), issues)
    return policy


def static_answers_issues(policy: Policy, base: Path) -> list[PolicyIssue]:
    """The pools' ``semantic.static_answers`` files (relative to ``base``, the policy's folder)
    read and validated: one issue per file that cannot serve, its reason naming the row."""
    from kvgate.semantic.static import StaticAnswersError, load_static

    issues = []
    for i, pool in enumerate(policy.pools):
        name = pool.semantic.static_answers
        if name:
            try:
                load_static(Path(name) if Path(name).is_absolute() else base / name)
            except StaticAnswersError as exc:
                issues.append(PolicyIssue(f"pools[{i}].semantic.static_answers", str(exc)))
    return issues


def dump_policy(policy: Policy) -> str:
    """``policy`` as YAML text that :func:`parse_policy_text` reads back to an equal policy
    (every field written out, defaults included)."""
    return yaml.safe_dump(policy.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
