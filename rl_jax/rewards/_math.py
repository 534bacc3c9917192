"""Math answers (MATH / Polaris style) with math-verify, run inside a sandbox worker.

Only `math_verify_score` runs in the worker; the parent cuts the completion to
its tail first so a megabyte of output never crosses the pipe. math-verify's
own `signal.alarm` timeouts are turned off: the sandbox's per-call kill is the
time limit. Its plain-text expression path hands strings to sympy's
`parse_expr`, but only strings its regex admits (digits, `.`, spaces and
`+-*/^()`), so no name can be looked up, let alone called; the worker is a
separate, memory-capped process besides.
"""

from __future__ import annotations

import logging
from functools import lru_cache

TAIL_CHARS = 4096


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


@lru_cache(maxsize=4096)
def _gold(answer: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse("\\boxed{" + answer + "}", extraction_config=configs, parsing_timeout=None)
    return gold or parse(answer, extraction_config=configs, parsing_timeout=None)


def math_verify_score(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = _gold(answer)
    if not gold:
        return 0.0
    pred = parse(completion, parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
