"""The package's shape, checked on its import graph (DESIGN.md: "arrows point down only; no cycles,
even inside a room").

The graph is grimp's (import-linter's engine): every `import` / `from ... import` statement in
every module, at any depth -- inside functions and under `if TYPE_CHECKING:` too -- is an edge
from the importing module to the imported one. So a lazy import inside a function that closes a
loop counts as a cycle here, as does an import made only for a type annotation.
"""

from __future__ import annotations

import sys

import pytest

grimp = pytest.importorskip("grimp")

# Cycles that still exist, each named by the agent that owns the room and is taking it apart.
# The test fails on any cycle not listed here, and on a listed one that no longer exists, so
# this list only shrinks.
KNOWN_CYCLES: dict[frozenset[str], str] = {
    # executors: the blocks call layer_step's claim_step; layer_step reaches back for blocks.claim_step
    frozenset({"headwise.models.blocks", "headwise.models.layer_step"}): "executors",
    # runtime: the Engine and its front ends (threads, streams) import each other
    frozenset({"headwise.engine.engine", "headwise.engine.frontends"}): "runtime"
}


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
