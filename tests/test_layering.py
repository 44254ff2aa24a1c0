"""The package's shape, checked on its import graph (DESIGN.md: "arrows point down only; no cycles,
even inside a room; no room imports another room's private names"). A room is a direct
subpackage of headwise (core, attention, cache, models, ..., cli).

The graph is grimp's (import-linter's engine): every `import` / `from ... import` statement in
every module, at any depth -- inside functions and under `if TYPE_CHECKING:` too -- is an edge
from the importing module to the imported one. So a lazy import inside a function that closes a
loop counts as a cycle here, as does an import made only for a type annotation.
"""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path

import pytest

import headwise

grimp = pytest.importorskip("grimp")

# Cycles that still exist, each named by the agent that owns the room and is taking it apart.
# The test fails on any cycle not listed here, and on a listed one that no longer exists, so
# this list only shrinks.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("headwise", cache_dir=None)


def strongly_connected(graph) -> list[frozenset[str]]:
    """Tarjan's algorithm over the module graph: the sets of modules that reach each other."""
    succ = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(succ)))
    try:
        for m in succ:
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _describe(graph, cycle: frozenset[str]) -> str:
    lines = []
    for a in sorted(cycle):
        for b in sorted(graph.find_modules_directly_imported_by(a) & cycle):
            where = graph.get_import_details(importer=a, imported=b)
            lines.append(f"  {a} -> {b} (line {', '.join(str(d['line_number']) for d in where) or '?'})")
    return "\n".join(lines)


def test_no_import_cycles(graph):
    cycles = strongly_connected(graph)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (move the shared piece down into a module both import):\n" + "\n".join(
        _describe(graph, c) for c in new
    )


def test_known_cycles_still_exist(graph):
    """An entry of KNOWN_CYCLES whose cycle is gone is deleted, so the list only shrinks."""
    cycles = set(strongly_connected(graph))
    gone = [f"{' <-> '.join(sorted(c))} ({owner})" for c, owner in KNOWN_CYCLES.items() if c not in cycles]
    assert not gone, "no longer a cycle: delete from KNOWN_CYCLES: " + "; ".join(gone)


def test_the_checker_finds_a_cycle():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.a")
    g.add_import(importer="p.b", imported="p.c")
    assert strongly_connected(g) == [frozenset({"p.a", "p.b"})]


ROOT = Path(headwise.__file__).parent


def rooms() -> set[str]:
    """headwise's direct subpackages and modules (headwise/__init__.py aside)."""
    return {m.name for m in pkgutil.iter_modules([str(ROOT)])}


def layers_contract() -> dict:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["headwise"]]
    return layers


def test_every_room_is_in_the_layers_contract():
    contract = layers_contract()
    named = set()
    for layer in contract["layers"]:  # "a | b" independent siblings, "a : b" siblings, "(a)" optional
        named |= {n.strip().strip("()") for n in layer.replace(":", "|").split("|")}
    missing = rooms() - named
    assert not missing, f"rooms left out of pyproject.toml's layers contract: {sorted(missing)}"
    assert contract.get("exhaustive") is True  # and import-linter checks it too


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(path: Path) -> list[str]:
    """`from <other room> import _name`, imports of another room's _private module, and
    `module._name` read off a module imported from another room, as "file:line: what"."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found, modules = [], {}  # modules: local name -> the other room's module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if not target.startswith("headwise"):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if (_room(target) or _room(full)) == _room(module):
                    continue
                if _private(alias.name) or any(_private(p) for p in target.split(".")):
                    found.append(f"{path}:{node.lineno}: from {target} import {alias.name}")
                modules[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("headwise") and _room(alias.name) != _room(module):
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "headwise"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                full = ".".join([modules[base.id], *chain])
                if _room(full) not in (None, _room(module)):
                    found.append(f"{path}:{node.lineno}: {full}.{node.attr}")
    return found


def test_no_room_imports_another_rooms_private_names():
    found = [hit for path in sorted(ROOT.rglob("*.py")) for hit in private_imports(path)]
    assert not found, "another room's private names (give them a public name in their room):\n" + "\n".join(found)


def test_the_private_name_check_finds_one(tmp_path, monkeypatch):
    room = tmp_path / "headwise" / "serve"
    room.mkdir(parents=True)
    (room / "config.py").write_text(
        "from ..models.builtin import BUILTIN, _canonical\nfrom ..models import gguf\nfrom .app import _mine\n"
        "def f():\n    return gguf._plain\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "headwise")
    hits = private_imports(room / "config.py")
    assert [h.split(": ", 1)[1] for h in hits] == [
        "from headwise.models.builtin import _canonical",
        "headwise.models.gguf._plain",
    ]


# Modules that still change an object's class at run time ("path": "owner"); the test fails on any
# other and once a listed one no longer does, so the list only shrinks. Empty: keep it so.
KNOWN_CLASS_CHANGES: dict[str, str] = {}


def class_changes(path: Path) -> list[int]:
    """Lines that assign `x.__class__` (or setattr(x, "__class__", ...))."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
            lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "__class__"
        ):
            lines.append(node.lineno)
    return lines


def test_no_object_changes_its_class_at_run_time():
    found = {str(p.relative_to(ROOT.parent)): class_changes(p) for p in sorted(ROOT.rglob("*.py"))}
    found = {p: lines for p, lines in found.items() if lines}
    new = {p: lines for p, lines in found.items() if p not in KNOWN_CLASS_CHANGES}
    assert not new, f"__class__ assigned at run time (build the object of the class it needs instead): {new}"
    gone = sorted(set(KNOWN_CLASS_CHANGES) - set(found))
    assert not gone, f"no longer change a class: delete from KNOWN_CLASS_CHANGES: {gone}"
