"""Code problems from files: the test layouts of common code-RL data, read into the code
verifier's answer (rl_jax.rewards._code: JSON of an entry point and its tests).

code           {"prompt" | "question" | ...: ..., "tests": [...] | {...} | "..."}
               the tests field read by what it holds: assert strings, a check() or
               test_* code, APPS-style {"inputs", "outputs", "fn_name"}, a list of
               {"input", "output", "testtype"}, or the verifier's own JSON
mbpp           {"text" | "prompt", "test_list", "test_setup_code"}           (MBPP)
humaneval      {"prompt", "test", "entry_point"}; completions continue the prompt
apps           {"question", "input_output", "starter_code"}                  (APPS, TACO)
livecodebench  {"question_content", "public_test_cases", "metadata", "starter_code"}

data.question_field and data.answer_field (the tests' field) replace a layout's fields.
A row whose tests cannot be read is dropped and counted as an unparsable answer. A
reference solution a row carries (`solution`, `code`, `canonical_solution`, APPS'
first of `solutions`) becomes meta["reference"], what a supervised warm-up imitates.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rl_jax.config.data import DataConfig
from rl_jax.data._problem import RowError
from rl_jax.rewards._code import CodeTests, encode_tests

Record = Mapping[str, Any]
_QUESTIONS = ("prompt", "question", "problem", "text", "instruction", "question_content")
_TESTS = ("tests", "test_list", "test", "input_output", "public_test_cases")
_REFERENCES = ("solution", "canonical_solution", "code")


class _Unreadable(ValueError):
    """A row's tests field holds nothing the verifier can run."""


@dataclass(frozen=True)
class CodeLayout:
    name: str
    question: tuple[str, ...]
    tests: tuple[str, ...]  # the first of these fields a record has holds its tests
    reward: str = "code"

    # _files.Layout's interface (record_layout, problems_from_records, LoadReport).
    @property
    def answer(self) -> str:
        return self.tests[0]

    plain_answer = ""

    def mapped(self, cfg: DataConfig) -> CodeLayout:
        lay = self
        if cfg.question_field:
            lay = dataclasses.replace(lay, question=(cfg.question_field,))
        if cfg.answer_field:
            lay = dataclasses.replace(lay, tests=(cfg.answer_field,))
        return lay

    def describe(self) -> str:
        q = " or ".join(repr(f) for f in self.question)
        t = " or ".join(repr(f) for f in self.tests)
        return f"{self.name} layout: question {q}, tests {t} (code verifier)"

    def read(self, r: Record) -> tuple[str, str | None]:
        q = next((f for f in self.question if f in r), None)
        t = next((f for f in self.tests if f in r), None)
        if q is None or t is None:
            missing = self.question if q is None else self.tests
            raise RowError(f"no {' or '.join(map(repr, missing))} field (fields: {sorted(r)})")
        # Null, a list or an object as str() would prompt 'None' or '[...]'.
        if r[q] is None or isinstance(r[q], bool | list | dict):
            raise RowError(f"{q}={r[q]!r}: expected a string or a number")
        question = str(r[q])
        try:
            spec = _READERS[self.name](r, t)
            return question, encode_tests(**spec)
        except (ValueError, TypeError, KeyError):
            return question, None

    def reference(self, r: Record) -> str:
        """A reference solution the row carries ('' if none)."""
        if self.name == "humaneval" and isinstance(r.get("canonical_solution"), str):
            return str(r.get("prompt", "")) + r["canonical_solution"]
        if self.name == "apps":
            try:
                sols = json.loads(r.get("solutions") or "[]")
                return sols[0] if sols and isinstance(sols[0], str) else ""
            except (TypeError, ValueError):
                return ""
        return next((r[f] for f in _REFERENCES if isinstance(r.get(f), str) and r[f]), "")


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _entry_of(r: Record) -> str:
    return str(r.get("entry_point") or r.get("fn_name") or "")


def _read_code(r: Record, field: str) -> dict:
    """The tests field by what it holds (module docstring)."""
    v = _json(r[field])
    spec: dict[str, Any] = {"entry_point": _entry_of(r)}
    if isinstance(r.get("test_setup_code"), str):
        spec["setup"] = r["test_setup_code"]
    if isinstance(v, dict) and ("fn_name" in v or "starter_code" in r):
        return {**spec, **_apps_pairs(v, r.get("starter_code", ""))}
    if isinstance(v, dict):  # the verifier's own answer, the row's entry point beside it
        out = {**{k: x for k, x in spec.items() if x}, **v}
        CodeTests.parse(json.dumps(out))
        return out
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return {**spec, **_lcb_pairs(v, _json(r.get("metadata", "{}")))}
    if isinstance(v, list) and all(isinstance(x, str) for x in v) and v:
        return {**spec, "tests": v}
    if isinstance(v, str) and v.strip():
        if re.search(r"^def (check|test_\w*)\s*\(", v, re.M):
            return {**spec, "test_code": v}
        asserts = [line.strip() for line in v.splitlines() if line.strip().startswith("assert")]
        if asserts:
            return {**spec, "tests": asserts}
    raise _Unreadable(f"{field}: no tests to read")


def _read_mbpp(r: Record, field: str) -> dict:
    spec = {"tests": list(r[field])}
    if r.get("test_setup_code"):
        spec["setup"] = str(r["test_setup_code"])
    return spec


def _read_humaneval(r: Record, field: str) -> dict:
    return {
        "entry_point": str(r["entry_point"]),
        "test_code": str(r[field]),
        "prefix": str(r.get("prompt", "")),
    }


def _apps_pairs(io: Mapping, starter: str) -> dict:
    inputs, outputs = list(io["inputs"]), list(io["outputs"])
    fn = io.get("fn_name")
    if not fn:
        return {"inputs": [_text(x) for x in inputs], "outputs": [_text(x) for x in outputs]}
    spec: dict[str, Any] = {"inputs": inputs, "outputs": outputs, "compare": "apps"}
    if re.search(r"^class Solution\b", starter or "", re.M):
        return {**spec, "entry_point": "Solution", "call": f"Solution().{fn}"}
    return {**spec, "entry_point": fn}


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _read_apps(r: Record, field: str) -> dict:
    return _apps_pairs(_json(r[field]), str(r.get("starter_code") or ""))


def _lcb_pairs(cases: list, meta: Any) -> dict:
    if not cases:
        raise _Unreadable("no test cases")
    if all(c.get("testtype", "stdin") == "stdin" for c in cases):
        return {
            "inputs": [str(c["input"]) for c in cases],
            "outputs": [str(c["output"]) for c in cases],
        }
    fn = meta.get("func_name") if isinstance(meta, dict) else None
    if not fn:
        raise _Unreadable("functional tests without metadata.func_name")
    inputs = [
        [json.loads(line) for line in str(c["input"]).splitlines() if line.strip()] for c in cases
    ]
    outputs = [json.loads(c["output"]) for c in cases]
    return {"entry_point": "Solution", "call": f"Solution().{fn}", "inputs": inputs,
            "outputs": outputs}  # fmt: skip


def _read_lcb(r: Record, field: str) -> dict:
    return _lcb_pairs(list(_json(r[field])), _json(r.get("metadata", "{}")))


_READERS = {
    "code": _read_code,
    "mbpp": _read_mbpp,
    "humaneval": _read_humaneval,
    "apps": _read_apps,
    "livecodebench": _read_lcb,
}
CODE_LAYOUTS: dict[str, CodeLayout] = {
    "code": CodeLayout("code", _QUESTIONS, _TESTS),
    "mbpp": CodeLayout("mbpp", ("text", "prompt"), ("test_list",)),
    "humaneval": CodeLayout("humaneval", ("prompt",), ("test",)),
    "apps": CodeLayout("apps", ("question",), ("input_output",)),
    "livecodebench": CodeLayout("livecodebench", ("question_content",), ("public_test_cases",)),
}


def detect_code_layout(record: Record) -> CodeLayout | None:
    """The code layout of records like `record` by their fields, or None (not code)."""
    keys = set(record)
    if "test_list" in keys:
        return CODE_LAYOUTS["mbpp"]
    if {"test", "entry_point", "prompt"} <= keys:
        return CODE_LAYOUTS["humaneval"]
    if "input_output" in keys and "question" in keys:
        return CODE_LAYOUTS["apps"]
    if "public_test_cases" in keys and "question_content" in keys:
        return CODE_LAYOUTS["livecodebench"]
    if "tests" in keys and keys & set(_QUESTIONS):
        return CODE_LAYOUTS["code"]
    return None
