"""The import structure of rl_jax (docs/architecture.md): no circles, and each floor
imports only the floors below it.

Every `import` in every module counts, function-local ones included: a local import
that only hides a circle from Python is still a circle. Imports under
`if TYPE_CHECKING:` never run and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "rl_jax"

# Floors, lowest first. A module may import its own folder and any lower floor. The
# lower floors (config ... scaling) are the library's subsystems; none knows another
# floor's purpose above it. Top-level modules sit on the floor of the folder named
# alike (knobs, runtime: the bottom).
LOWER = ("config", "knobs", "runtime", "sharding", "kernels", "losses", "rewards", "models")
LOWER += ("data", "runs", "scaling")
UPPER = ("sampling", "train", "plan", "grid", "cli")
# What each upper floor may not import.
FORBIDDEN = {
    **{f: set(UPPER) for f in LOWER},
    "sampling": {"train", "grid", "cli"},
    "train": {"plan", "grid", "cli"},
    "grid": {"cli"},
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported rl_jax module: "file:line"}.

    `from a.b import c` names a.b.c where that is a module, else a.b (as grimp and
    import-linter count it).
    """
    mods = _modules()

    def owner(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, dict[str, str]] = {}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for name in names:
                target = owner(name) if name.startswith("rl_jax") else None
                if target and target != mod:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                    edges.setdefault(target, where)
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One shortest circle per strongly connected component (Tarjan, then BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:
        start = min(comp)
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while prev[path[-1]] != start:
            path.append(prev[path[-1]])
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_graph_sees_local_imports(graph):
    assert "rl_jax.knobs" in graph["rl_jax.config"]
    assert len(graph) > 50


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        lines.append("circle: " + " -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not cycles, "\n".join(lines)


def test_layering(graph):
    bad = [
        f"{src} imports {dst} ({where}): {floor(src)} may not import {floor(dst)}"
        for src, edges in sorted(graph.items())
        for dst, where in edges.items()
        if floor(dst) in FORBIDDEN.get(floor(src), ())
    ]
    assert not bad, "\n".join(bad)


def test_every_floor_is_placed(graph):
    floors = {floor(m) for m in graph} - {""}
    unplaced = floors - set(LOWER) - set(UPPER)
    assert not unplaced, f"place {sorted(unplaced)} in LOWER or UPPER of this test"
