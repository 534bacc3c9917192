"""Exact numeric answers (GSM8K style): the final number of a completion, compared as a fraction."""

from __future__ import annotations

import re
from fractions import Fraction

from rl_jax.rewards._text import bounded_text

# Final answers sit at the end of a completion; nothing before this tail is read.
TAIL_CHARS = 4096
# Longer "numbers" are refused before Fraction sees them, so no huge integer is ever built.
MAX_NUMBER_CHARS = 48

# A number token is read whole, exponent and other scripts' digits included, so that
# parse_number refuses it rather than a part of it ("1e3" is never the number 3).
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")
# re.ASCII: only 0-9 are digits (Python's int() would also read other scripts' digits), and
# no exponent: no huge number is ever built.
_CANONICAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", re.ASCII)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([-+]?\d+)\}\{(\d+)\}", re.ASCII)
_LATEX_NOISE = re.compile(r"\\text\{[^{}]{0,64}\}|\\[,!;: ]|\\\$|\\%|\$|%|\\left|\\right")
_ANSWER_IS = re.compile(r"(?i)(?:final answer|answer)\s*(?:is|:|=)")
# Units and words in a \boxed{} beside its number; anything else there is math.
_UNIT_TEXT = r"\\(?:text\w*|math(?:rm|it|bf)|mbox|rm)\s*\{([^{}]{0,64})\}"
_LATEX_WORDS = re.compile(_UNIT_TEXT)
_MATH = re.compile(r"[\\^_{}*/+=()\[\]|<>\u00d7\u00f7\u00b7\u221a]")
# Degrees and a unit's power are units too: "72^\circ", "12 \text{cm}^2" (a power only
# of a unit's text).
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_UNIT_POWER = re.compile(rf"({_UNIT_TEXT})\s*\^\s*\{{?[23]\}}?")
# U+2212 MINUS SIGN is a minus: read as '-', so that "−5" is never the number 5.
_MINUS = str.maketrans({"\u2212": "-"})


def _plain(text: str) -> str:
    """`text` with U+2212 as '-' and LaTeX's `{,}` thousands separator as ',' (so that
    "1{,}000" is 1000, not 1 or 000)."""
    return text.translate(_MINUS).replace("{,}", ",")


def parse_number(text: str) -> Fraction | None:
    """A number written as `-1,234.5`, `3/4`, `\\frac{3}{4}` or `$72`; None if it is not one."""
    if len(text) > 4 * MAX_NUMBER_CHARS:
        return None
    s = _LATEX_FRAC.sub(r"\1/\2", _plain(text))
    s = _LATEX_NOISE.sub("", s).replace(",", "").replace(" ", "").strip().rstrip(".")
    if not s or len(s) > MAX_NUMBER_CHARS or not _CANONICAL.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _boxed_number(boxed: str) -> str | None:
    """The number a \\boxed{} holds: all of it, the value after its last '=' ("x = 7"), or
    its one number among words ("72 dollars"); None where it holds other math, no part
    of which is the answer ("2^{10}", "3\\sqrt{2}", "3 \\times 4")."""
    value = boxed.rsplit("=", 1)[-1]
    for part in (boxed, value):
        if parse_number(part) is not None:
            return part
    units = _UNIT_POWER.sub(r"\1", _DEGREES.sub(" ", value))
    words = _LATEX_WORDS.sub(r" \1 ", _LATEX_NOISE.sub("", _LATEX_FRAC.sub(r"\1/\2", units)))
    numbers = _NUMBER.findall(words)
    if len(numbers) == 1 and not _MATH.search(_NUMBER.sub(" ", words)):
        return numbers[0]
    return None


def _last_number(text: str) -> str | None:
    last = None
    for m in _NUMBER.finditer(text):
        last = m.group(0)
    return last


def extract_numeric(completion: object) -> str | None:
    """The final-answer string of a completion: last \\boxed{}, else after `####`,
    else after the last "answer is", else the last number in the text."""
    text = _plain(bounded_text(completion, limit=TAIL_CHARS, keep="tail"))
    boxed = last_boxed(text)
    if boxed is not None:
        return _boxed_number(boxed)
    hashes = text.rfind("####")
    if hashes >= 0:
        m = _NUMBER.search(text, hashes + 4)
        return m.group(0) if m else None
    marks = list(_ANSWER_IS.finditer(text))
    if marks:
        m = _NUMBER.search(text, marks[-1].end())
        if m:
            return m.group(0)
    return _last_number(text)


def numeric_score(completion: object, answer: str) -> float:
    gold = parse_number(answer)
    got_s = extract_numeric(completion)
    if gold is None or got_s is None:
        return 0.0
    got = parse_number(got_s)
    return 1.0 if got is not None and got == gold else 0.0


def numeric_well_formed(completion: object) -> bool:
    got = extract_numeric(completion)
    return got is not None and parse_number(got) is not None
