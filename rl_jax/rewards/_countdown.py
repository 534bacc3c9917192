"""Countdown verifier: reach the target using each given number exactly once with + - * /.

The expression is checked by a recursive-descent parser over a tiny grammar,
never by `eval`:

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := NUMBER | '(' expr ')'

No unary minus, no powers, no names. Input is bounded before parsing (length,
nesting depth, digits per number) and the numbers used must be exactly the
given multiset before anything is evaluated, so evaluation touches at most a
handful of small integers (exact fractions; division by zero is no credit).

Answer string (in `Problem.answer`): the numbers then the target, `"3,7,25=46"`.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from rl_jax.rewards._text import bounded_text

HEAD_CHARS = 256  # an expression over <= 8 small numbers is far shorter
TAIL_CHARS = 4096  # where an <answer>...</answer> tag is looked for
MAX_DEPTH = 16
MAX_DIGITS = 6
MAX_NUMBERS = 12

_EXPR_PREFIX = re.compile(r"\s*([0-9+\-*/() ]*)")
_ANSWER_TAG = re.compile(r"<answer>(.{0,512}?)</answer>", re.DOTALL)
_ANSWER_FORMAT = re.compile(r"(\d{1,6}(?:,\d{1,6}){0,11})=(-?\d{1,9})", re.ASCII)


class _Reject(Exception):
    """The expression is not valid Countdown; the caller gives no credit."""


def format_countdown_answer(numbers: list[int], target: int) -> str:
    return ",".join(str(n) for n in numbers) + f"={target}"


def parse_countdown_answer(answer: str) -> tuple[list[int], int]:
    m = _ANSWER_FORMAT.fullmatch(answer.strip())
    if not m:
        raise ValueError(f"countdown answer {answer!r} is not of the form '3,7,25=46'")
    return [int(x) for x in m.group(1).split(",")], int(m.group(2))


def _tokens(s: str) -> list[str]:
    out: list[str] = []
    i, depth = 0, 0
    while i < len(s):
        c = s[i]
        if c == " ":
            i += 1
        elif c.isdigit():
            j = i
            while j < len(s) and s[j].isdigit():
                j += 1
            if j - i > MAX_DIGITS:
                raise _Reject
            out.append(s[i:j])
            i = j
        else:  # the prefix regex admits only + - * / ( ) here
            depth += c == "("
            depth -= c == ")"
            if depth > MAX_DEPTH or depth < 0:
                raise _Reject
            out.append(c)
            i += 1
        if len(out) > 4 * MAX_NUMBERS + 2 * MAX_DEPTH:
            raise _Reject
    return out


class _Parser:
    def __init__(self, toks: list[str]):
        self.toks, self.i = toks, 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        if self.i >= len(self.toks):
            raise _Reject
        self.i += 1
        return self.toks[self.i - 1]

    def expr(self):
        node = self.term()
        while self.peek() in ("+", "-"):
            node = (self.take(), node, self.term())
        return node

    def term(self):
        node = self.factor()
        while self.peek() in ("*", "/"):
            node = (self.take(), node, self.factor())
        return node

    def factor(self):
        t = self.take()
        if t == "(":
            node = self.expr()
            if self.take() != ")":
                raise _Reject
            return node
        if t.isdigit():
            return int(t)
        raise _Reject


def _leaves(node, out: list[int]) -> None:
    if isinstance(node, int):
        out.append(node)
        if len(out) > MAX_NUMBERS:
            raise _Reject
    else:
        _leaves(node[1], out)
        _leaves(node[2], out)


def _eval(node) -> Fraction:
    if isinstance(node, int):
        return Fraction(node)
    op, a, b = node[0], _eval(node[1]), _eval(node[2])
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise _Reject
    return a / b


def parse_expression(text: str):
    """AST of an expression string (ints and (op, left, right) tuples); raises _Reject."""
    toks = _tokens(text)
    if not toks:
        raise _Reject
    p = _Parser(toks)
    node = p.expr()
    if p.i != len(toks):
        raise _Reject
    return node


def evaluate_expression(text: str) -> Fraction:
    """Exact value of an expression in the grammar above; raises ValueError if invalid."""
    try:
        node = parse_expression(text)
        _leaves(node, [])
        return _eval(node)
    except _Reject:
        raise ValueError(f"not a countdown expression: {text[:64]!r}") from None


def extract_countdown(completion: object) -> str | None:
    """The expression: inside the last <answer> tag if any, else the completion's
    leading run of expression characters; anything from '=' on is ignored."""
    tail = bounded_text(completion, limit=TAIL_CHARS, keep="tail")
    tags = _ANSWER_TAG.findall(tail) if "<answer>" in tail else []
    text = tags[-1] if tags else bounded_text(completion, limit=HEAD_CHARS, keep="head")
    m = _EXPR_PREFIX.match(text[:HEAD_CHARS])
    expr = m.group(1).strip() if m else ""
    return expr or None


def _completion_expression(completion: object):
    """The AST of the completion's expression, or None where it has none that parses."""
    expr = extract_countdown(completion)
    try:
        return None if expr is None else parse_expression(expr)
    except (_Reject, RecursionError):
        return None


def countdown_score(completion: object, answer: str) -> float:
    numbers, target = parse_countdown_answer(answer)
    node = _completion_expression(completion)
    if node is None:
        return 0.0
    try:
        used: list[int] = []
        _leaves(node, used)
        # The numbers are checked before anything is evaluated.
        return float(Counter(used) == Counter(numbers) and _eval(node) == target)
    except (_Reject, RecursionError):
        return 0.0


def countdown_well_formed(completion: object) -> bool:
    return _completion_expression(completion) is not None
