"""A generated code task (data.source=code): small functions to write, with tests.

Each problem asks for one function, e.g. "Write a Python function `digit_sum_plus(n)`
that returns the sum of the digits of n plus 7.", and its answer is the code verifier's
JSON: the entry point and four assert tests whose expected values come from the
family's reference. data.difficulty picks the families:

1  one operation on an integer and a constant (plus, minus, times, floor division,
   remainder, comparisons)
2  strings and lists with a constant (repeat, slices, counts, filters, maps)
3  loops (digit sums, ranges, factorials, Fibonacci numbers, reversals, vowels)

A problem is a (family, constant) pair, drawn without replacement by the seeded stream
arith uses: the first data.val_size are validation, the next data.train_size training.
meta["reference"] is a reference program (what a supervised warm-up imitates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._problem import Problem, make_problem
from rl_jax.knobs import ConfigError
from rl_jax.rewards._code import encode_tests

TESTS_PER_PROBLEM = 4
_WORDS = ("apple", "banana", "kiwi", "cherry", "mango", "level", "rotor", "python", "hello")


@dataclass(frozen=True)
class Family:
    name: str  # the function's name
    arg: str  # n (int), s (str) or xs (list of ints)
    ask: str  # what it returns, with {k}
    body: str  # the reference's expression or statements, with {k}
    ref: Callable  # (x, k) -> the value
    ks: range  # the constants it takes


def _digits_sum(n: int) -> int:
    return sum(int(c) for c in str(abs(n)))


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


_K = range(1, 1000)
FAMILIES: dict[int, tuple[Family, ...]] = {
    1: (
        Family("plus", "n", "n plus {k}", "return n + {k}", lambda n, k: n + k, _K),
        Family("minus", "n", "n minus {k}", "return n - {k}", lambda n, k: n - k, _K),
        Family("times", "n", "n times {k}", "return n * {k}", lambda n, k: n * k, _K),
        Family(
            "floor_div", "n", "n divided by {k}, rounded down", "return n // {k}",
            lambda n, k: n // k, range(2, 1000),
        ),
        Family(
            "remainder", "n", "the remainder of n divided by {k}", "return n % {k}",
            lambda n, k: n % k, range(2, 1000),
        ),
        Family(
            "greater", "n", "True if n is greater than {k}, else False", "return n > {k}",
            lambda n, k: n > k, _K,
        ),
        Family(
            "at_most", "n", "True if n is at most {k}, else False", "return n <= {k}",
            lambda n, k: n <= k, _K,
        ),
    ),
    2: (
        Family("repeat", "s", "s repeated {k} times", "return s * {k}", lambda s, k: s * k,
               range(1, 6)),
        Family("head", "s", "the first {k} characters of s", "return s[:{k}]",
               lambda s, k: s[:k], range(1, 9)),
        Family("tail", "s", "the last {k} characters of s", "return s[-{k}:]",
               lambda s, k: s[-k:], range(1, 9)),
        Family("add_each", "xs", "the list xs with {k} added to each element",
               "return [x + {k} for x in xs]", lambda xs, k: [x + k for x in xs], _K),
        Family("above", "xs", "the elements of xs greater than {k}, in order",
               "return [x for x in xs if x > {k}]", lambda xs, k: [x for x in xs if x > k],
               range(0, 100)),
        Family("count_above", "xs", "how many elements of xs are greater than {k}",
               "return sum(1 for x in xs if x > {k})",
               lambda xs, k: sum(1 for x in xs if x > k), range(0, 100)),
        Family("scaled_sum", "xs", "the sum of xs times {k}", "return sum(xs) * {k}",
               lambda xs, k: sum(xs) * k, _K),
    ),
    3: (
        Family("digit_sum_plus", "n", "the sum of the digits of n plus {k}",
               "return sum(int(c) for c in str(n)) + {k}",
               lambda n, k: _digits_sum(n) + k, range(0, 1000)),
        Family("sum_from", "n", "the sum of the integers from {k} to n inclusive (0 if n < {k})",
               "return sum(range({k}, n + 1))", lambda n, k: sum(range(k, n + 1)), range(0, 50)),
        Family("factorial_mod", "n", "n factorial modulo {k}",
               "r = 1\n    for i in range(2, n + 1):\n        r = r * i % {k}\n    return r",
               lambda n, k: math.factorial(n) % k, range(2, 1000)),
        Family("fib_mod", "n", "the n-th Fibonacci number modulo {k} (fib(0) = 0, fib(1) = 1)",
               "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a % {k}",
               lambda n, k: _fib(n) % k, range(2, 1000)),
        Family("reversed_plus", "n", "n with its digits reversed, plus {k}",
               "return int(str(n)[::-1]) + {k}", lambda n, k: int(str(n)[::-1]) + k,
               range(0, 1000)),
        Family("vowels_plus", "s", "the number of vowels (a, e, i, o, u) in s plus {k}",
               "return sum(c in 'aeiou' for c in s) + {k}",
               lambda s, k: sum(c in "aeiou" for c in s) + k, range(0, 1000)),
    ),
}  # fmt: skip


def _inputs(f: Family, k: int, rng: np.random.Generator) -> list:
    if f.name in ("greater", "at_most"):  # two on each side of the constant
        below = k - rng.choice(min(k, 50) + 1, size=2, replace=False)
        return [int(x) for x in below] + [int(x) for x in k + 1 + rng.choice(50, 2, replace=False)]
    if f.arg == "n":
        hi = 25 if f.name in ("fib_mod", "factorial_mod", "sum_from") else 10_000
        return [int(x) for x in rng.choice(hi, size=TESTS_PER_PROBLEM, replace=False)]
    if f.arg == "s":
        return [str(w) for w in rng.choice(_WORDS, size=TESTS_PER_PROBLEM, replace=False)]
    return [[int(x) for x in rng.integers(0, 100, size=int(rng.integers(0, 6)))]
            for _ in range(TESTS_PER_PROBLEM)]  # fmt: skip


def code_problem(f: Family, k: int, rng: np.random.Generator, difficulty: int) -> Problem:
    question = f"Write a Python function `{f.name}({f.arg})` that returns {f.ask.format(k=k)}."
    solution = f"def {f.name}({f.arg}):\n    {f.body.format(k=k)}\n"
    tests = [f"assert {f.name}({x!r}) == {f.ref(x, k)!r}" for x in _inputs(f, k, rng)]
    answer = encode_tests(entry_point=f.name, tests=tests)
    meta = {
        "task": f"code:{f.name}",
        "difficulty": difficulty,
        "question": question,
        "reference": solution,
        "reward": "code",
    }
    return make_problem(question, answer, meta)


def code_problems(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, val) of the generated code task at data.difficulty."""
    fams = FAMILIES[cfg.difficulty]
    space = [(f, k) for f in fams for k in f.ks]
    need = cfg.generated_val_size + cfg.train_size
    if need > len(space):
        raise ConfigError(
            f"the code task at data.difficulty={cfg.difficulty} has {len(space)} distinct "
            f"problems, fewer than data.val_size + data.train_size = {need}; lower them"
        )
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, cfg.difficulty, 0xC0DE]))
    order = rng.permutation(len(space))[:need]
    out = [code_problem(*space[i], rng, cfg.difficulty) for i in order]
    return out[cfg.generated_val_size :], out[: cfg.generated_val_size]
