"""The import structure of rl_jax (docs/architecture.md): no circles, each package
imports only its own floor and the floors below it, and the doc's floors and import
tables are the code's.

Every `import` in every module counts, function-local ones included: a local import
that only hides a circle from Python is still a circle. Imports under
`if TYPE_CHECKING:` never run and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "rl_jax"

DOC = ROOT.parent / "docs" / "architecture.md"

# Floor of each package, the tables of docs/architecture.md "Allowed import directions".
# A package imports its own floor (without circles) and the floors below it. Top-level
# modules (knobs, runtime) count as packages of their own name.
FLOORS = {
    5: ("cli",),
    4: ("grid", "plan"),
    3: ("train",),
    2: ("sampling",),
    1: ("data", "kernels", "losses", "models", "runs", "scaling", "sharding"),
    0: ("config", "knobs", "rewards", "runtime"),
}
FLOOR_OF = {pkg: level for level, pkgs in FLOORS.items() for pkg in pkgs}


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


def package_imports(graph: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import (the root package left out)."""
    out: dict[str, set[str]] = {}
    for src, edges in graph.items():
        if floor(src):
            out.setdefault(floor(src), set()).update(
                floor(dst) for dst in edges if floor(dst) not in ("", floor(src))
            )
    return out


def doc_table(text: str, heading: str) -> list[list[str]]:
    """The cells of the markdown table under the header row `heading` (backticks and
    spaces stripped), one list per row."""
    lines = text.splitlines()
    assert heading in lines, f"docs/architecture.md has no table headed {heading!r}"
    start = lines.index(heading) + 2  # past the header and the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|")])
    return rows


def upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """One line per import that points to a higher floor than its module's."""
    return [
        f"{src} imports {dst} ({where}): {floor(src)} (floor {FLOOR_OF[floor(src)]}) may not"
        f" import {floor(dst)} (floor {FLOOR_OF[floor(dst)]})"
        for src, edges in sorted(graph.items())
        for dst, where in edges.items()
        if floor(src) in FLOOR_OF
        and floor(dst) in FLOOR_OF
        and FLOOR_OF[floor(dst)] > FLOOR_OF[floor(src)]
    ]


def test_layering(graph):
    bad = upward_imports(graph)
    assert not bad, "\n".join(bad)


def test_upward_imports_are_found_and_sideways_ones_allowed():
    graph = {
        "rl_jax.config.a": {"rl_jax.models.m": "config/a.py:1", "rl_jax.knobs": "config/a.py:2"},
        "rl_jax.models.m": {"rl_jax.kernels.k": "models/m.py:1"},
        "rl_jax.train.t": {"rl_jax.plan.p": "train/t.py:3", "rl_jax.sampling.s": "train/t.py:4"},
    }
    assert upward_imports(graph) == [
        "rl_jax.config.a imports rl_jax.models.m (config/a.py:1): config (floor 0) may not"
        " import models (floor 1)",
        "rl_jax.train.t imports rl_jax.plan.p (train/t.py:3): train (floor 3) may not"
        " import plan (floor 4)",
    ]


def test_every_floor_is_placed(graph):
    floors = {floor(m) for m in graph} - {""}
    unplaced = floors - set(FLOOR_OF)
    assert not unplaced, f"place {sorted(unplaced)} in FLOORS of this test"
    assert not set(FLOOR_OF) - floors, f"FLOORS names no package: {set(FLOOR_OF) - floors}"


def test_the_doc_floors_are_the_tests():
    rows = doc_table(DOC.read_text(), "| floor | packages |")
    doc = {int(level): tuple(p.strip() for p in pkgs.split(",")) for level, pkgs in rows}
    assert doc == FLOORS, f"docs/architecture.md's floors table differs from FLOORS: {doc}"


def test_the_doc_import_table_is_the_code(graph):
    rows = doc_table(DOC.read_text(), "| package | imports |")
    doc = {
        pkg: set() if "nothing" in imps else {i.strip() for i in imps.split(",")}
        for pkg, imps in rows
    }
    code = package_imports(graph)
    if doc != code:
        order = sorted(code, key=lambda p: (-FLOOR_OF.get(p, -1), p))
        table = "\n".join(
            f"| `{p}` | {', '.join(f'`{i}`' for i in sorted(code[p])) or '(nothing in rl_jax)'} |"
            for p in order
        )
        raise AssertionError(
            "docs/architecture.md's import table is not the code's; as the code has it:\n" + table
        )


def test_the_doc_table_reader_reads_a_table():
    text = "x\n| package | imports |\n|---|---|\n| `a` | `b`, `c` |\n| `d` | (nothing) |\n\nmore"
    assert doc_table(text, "| package | imports |") == [["a", "b, c"], ["d", "(nothing)"]]
