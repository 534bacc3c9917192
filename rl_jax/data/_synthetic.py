"""Built-in tasks generated locally from a seed: arithmetic and countdown.

Splits: problems are drawn without replacement from the task's problem space
by one seeded stream; the first `val_size` distinct problems are validation,
the next `train_size` are training. So the splits are disjoint by
construction, and validation does not move when train_size changes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._problem import Problem, make_problem
from rl_jax.knobs import ConfigError
from rl_jax.rewards import evaluate_expression, format_countdown_answer

ARITH_OPS = {"add": "+", "sub": "-", "mul": "*", "chain": "+"}
# Spaces at most this large are enumerated and permuted (exact sampling without
# replacement); larger ones are rejection-sampled, where collisions are rare.
_ENUMERATE_LIMIT = 1 << 22
COUNTDOWN_MAX_NUMBER = 50
COUNTDOWN_MAX_TARGET = 999


def _rng(cfg: DataConfig, family: str) -> np.random.Generator:
    tag = [ord(c) for c in family]
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, cfg.difficulty, *tag]))


def arith_answer(value: int, *, reverse_digits: bool) -> str:
    """Canonical answer string: digits least-significant first when reverse_digits
    (46 -> "64"), a minus sign, if any, always first (-22 -> "-22")."""
    digits = str(abs(value))
    return ("-" if value < 0 else "") + (digits[::-1] if reverse_digits else digits)


def _operand_range(k: int) -> tuple[int, int]:
    # k-digit numbers: 10..99 for k=2; one-digit numbers include 0.
    return (0, 10) if k == 1 else (10 ** (k - 1), 10**k)


def _draw_distinct(
    rng: np.random.Generator, space: int, need: int, sample: Callable[[], tuple], decode
) -> list[tuple]:
    if space < need:
        return []
    if space <= _ENUMERATE_LIMIT:
        return [decode(int(i)) for i in rng.permutation(space)[:need]]
    seen: dict[tuple, None] = {}
    while len(seen) < need:
        seen.setdefault(sample(), None)
    return list(seen)


def arith_problems(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    k, terms = cfg.difficulty, cfg.num_terms if cfg.task == "chain" else 2
    lo, hi = _operand_range(k)
    width = hi - lo
    space = width**terms
    need = cfg.generated_val_size + cfg.train_size
    rng = _rng(cfg, "arith:" + cfg.task)

    def decode(index: int) -> tuple:
        out = []
        for _ in range(terms):
            index, r = divmod(index, width)
            out.append(lo + r)
        return tuple(out)

    def sample() -> tuple:
        return tuple(int(x) for x in rng.integers(lo, hi, size=terms))

    draws = _draw_distinct(rng, space, need, sample, decode)
    if not draws:
        raise ConfigError(
            f"arith task {cfg.task!r} with data.difficulty={k} has only {space} distinct "
            f"problems, fewer than data.val_size + data.train_size = {need}; lower them or "
            "raise data.difficulty"
        )
    op = ARITH_OPS[cfg.task]
    out = []
    for operands in draws:
        question = op.join(str(x) for x in operands) + "="
        if cfg.task == "mul":
            value = operands[0] * operands[1]
        elif cfg.task == "sub":
            value = operands[0] - operands[1]
        else:
            value = sum(operands)
        answer = arith_answer(value, reverse_digits=cfg.reverse_digits)
        meta = {
            "task": f"arith:{cfg.task}",
            "difficulty": k,
            "question": question,
            "value": value,
            "reward": "arith",
        }
        out.append(make_problem(question, answer, meta))
    return out[cfg.generated_val_size :], out[: cfg.generated_val_size]


def _countdown_one(rng: np.random.Generator, n: int) -> tuple[tuple[int, ...], int, str] | None:
    """Random numbers and a target reachable by combining all of them once; None to retry."""
    numbers = [int(x) for x in rng.integers(1, COUNTDOWN_MAX_NUMBER + 1, size=n)]
    items = [(v, str(v)) for v in numbers]
    while len(items) > 1:
        i, j = (int(x) for x in rng.choice(len(items), size=2, replace=False))
        (a, ea), (b, eb) = items[i], items[j]
        op = "+-*/"[int(rng.integers(4))]
        if op == "-" and a <= b:
            op = "+"
        if op == "/" and (b <= 1 or a % b):
            op = "*"
        if op == "*" and (a == 1 or b == 1):
            op = "+"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        items = [it for t, it in enumerate(items) if t not in (i, j)] + [(value, f"({ea}{op}{eb})")]
    target, expr = items[0]
    if not 1 <= target <= COUNTDOWN_MAX_TARGET or target in numbers:
        return None
    expr = expr[1:-1] if expr.startswith("(") and n > 1 else expr
    return tuple(sorted(numbers)), target, expr


def countdown_problems(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    n = cfg.difficulty
    need = cfg.generated_val_size + cfg.train_size
    rng = _rng(cfg, "countdown")
    found: dict[tuple, str] = {}
    attempts, budget = 0, 50 * need + 1000
    while len(found) < need and attempts < budget:
        attempts += 1
        got = _countdown_one(rng, n)
        if got is not None:
            found.setdefault(got[:2], got[2])
    if len(found) < need:
        raise ConfigError(
            f"found only {len(found)} distinct countdown problems with data.difficulty={n} in "
            f"{budget} draws, fewer than data.val_size + data.train_size = {need}; lower them "
            "or raise data.difficulty"
        )
    out = []
    for (numbers, target), solution in found.items():
        assert evaluate_expression(solution) == target, solution  # generator self-check
        question = f"reach {target} with {','.join(str(x) for x in numbers)}:"
        answer = format_countdown_answer(list(numbers), target)
        meta = {
            "task": "countdown",
            "difficulty": n,
            "question": question,
            "solution": solution,
            "reward": "countdown",
        }
        out.append(make_problem(question, answer, meta))
    return out[cfg.generated_val_size :], out[: cfg.generated_val_size]


__all__ = ["arith_answer", "arith_problems", "countdown_problems"]
