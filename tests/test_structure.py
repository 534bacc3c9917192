"""The trainer stays readable: no class over 300 lines, no function over 60 (rl_jax/train).

A phase or schedule that outgrows a screen is split into named pieces instead."""

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "rl_jax" / "train"
MAX_CLASS, MAX_FUNCTION = 300, 60


def oversized(source: str, *, max_class: int = MAX_CLASS, max_function: int = MAX_FUNCTION):
    """[(name, lines, limit)] of the classes and functions of `source` over their limit
    (decorators and docstrings count: they are on the screen too)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            limit = max_class
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = max_function
        else:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines = node.end_lineno - first + 1
        if lines > limit:
            out.append((node.name, lines, limit))
    return out


def test_the_checker_finds_long_functions_and_classes():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert oversized(f"def f():\n{body}\n") == [("f", 61, 60)]
    assert oversized(f"def f():\n{body[: body.rindex(chr(10))]}\n") == []
    fields = "    x: int = 0\n" * 299
    assert oversized(f"class C:\n{fields}") == []
    assert oversized(f"@dataclass\nclass C:\n{fields}") == [("C", 301, 300)]


def test_train_modules_stay_within_the_limits():
    found = {
        f"{path.name}:{name}": (lines, limit)
        for path in sorted(TRAIN.glob("*.py"))
        for name, lines, limit in oversized(path.read_text())
    }
    assert not found, f"over the limit (lines, limit): {found}"
