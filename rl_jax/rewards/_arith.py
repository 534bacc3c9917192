"""Arithmetic task verifier: the completion's leading answer string against the canonical one.

The task writes the answer in its final form into `Problem.answer` (for the
CPU demo, digits least-significant first when `data.reverse_digits`, e.g.
12+34 -> "64"; a sign, if any, comes first: "-22"). So this verifier never
re-derives the arithmetic: it reads the completion up to the first character
that cannot be part of an answer (EOS is already stripped by decoding; `;`,
space, newline or anything else ends it) and compares strings exactly. Leading
zeros are therefore wrong answers, as they would be for a string target.
"""

from __future__ import annotations

import re

from rl_jax.rewards._text import bounded_text

# Longest answer the arith tasks produce is far shorter; a longer digit run is wrong anyway.
HEAD_CHARS = 96
_LEADING = re.compile(r"\s{0,16}(-?[0-9]{1,64})")


def extract_arith(completion: object) -> str | None:
    m = _LEADING.match(bounded_text(completion, limit=HEAD_CHARS, keep="head"))
    return m.group(1) if m else None


def arith_score(completion: object, answer: str) -> float:
    got = extract_arith(completion)
    return 1.0 if got is not None and got == answer.strip() else 0.0


def arith_well_formed(completion: object) -> bool:
    return extract_arith(completion) is not None
