"""No import cycles in the kvgate package (issue 10 item 7: the client↔stack circle went with
kvgate.rundir and kvgate.addr; this keeps any other from coming back).

Read from the source with ``ast`` (nothing is imported): an edge A → B for each
``import B`` / ``from B import x`` in A (relative imports resolved; ``from P import m`` where
``P.m`` is a module is an edge to ``P.m``). Module-level imports (including those under a
top-level ``try``/``if``, but not under ``if TYPE_CHECKING``) must form no cycle: a cycle there
is an ImportError or a half-initialised module waiting for the right import order. Imports
inside functions run later, but a cycle among them still means two modules that each need the
other; those are checked too, with the few deliberate lazy imports named below.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[2] / "control" / "kvgate"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG_ROOT.rglob("*.py"):
        rel = path.relative_to(PKG_ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_pkg(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_pkg(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module: those run at import time (``module_level``), or all."""
    found: list = []

    def walk(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if top or not module_level:
                    found.append(child)
                continue
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if module_level and nested:
                continue
            # a class body runs at import time; a function body does not
            walk(child, top and not nested)

    walk(tree, True)
    return found


def _graph(module_level: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _imports(tree, module_level):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, node.module, node.level)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
            for t in targets:
                # `import kvgate.x.y` runs kvgate.x.y; an unknown name is a third-party module
                while t and t not in MODULES:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("kvgate"):
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def _without_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop an edge from a package's module to its own package (``kvgate.policy.loader`` →
    ``kvgate.policy``): Python has the package half-initialised then, by design."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def test_the_walk_sees_the_package() -> None:
    assert "kvgate.stack" in MODULES and "kvgate.control.client" in MODULES and "kvgate.rundir" in MODULES
    g = _graph(module_level=True)
    assert "kvgate.rundir" in g["kvgate.control.client"] and "kvgate.addr" in g["kvgate.control.client"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_among_module_level_imports() -> None:
    assert _cycles(_without_parents(_graph(module_level=True))) == []


def test_no_cycle_among_all_imports() -> None:
    """Lazy imports in functions included: the control plane's client never needs the stack."""
    g = _without_parents(_graph(module_level=False))
    assert "kvgate.stack" not in g["kvgate.control.client"]
    assert _cycles(g) == []


def test_services_never_import_flask() -> None:
    """The control plane, its steps and the stack run without the web layer's framework
    (issue 10 item 5: views call services; services never import Flask)."""
    import subprocess
    import sys

    code = ("import sys, kvgate.control.plane, kvgate.stack, kvgate.control.client, kvgate.web.admin.history; "
            "print(sorted(m for m in sys.modules if m == 'flask' or m.startswith('flask.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
