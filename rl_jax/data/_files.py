"""Real datasets from JSONL or parquet files in the GSM8K, MATH and Polaris layouts.

A file is a local path or a URL (`gs://...`, any fsspec protocol: rl_jax.config.paths).

gsm8k    {"question": ..., "answer": "... #### 72"}          -> numeric verifier
math     {"problem": ..., "solution": "... \\boxed{3}"}       -> math verifier
         (an "answer" field, as in MATH-500, wins over the boxed solution)
polaris  {"problem": ..., "answer": "3"}                      -> math verifier
jsonl    {"question" | "prompt": ..., "answer": ...}          -> numeric if every
         answer is a plain number, else math
auto     picks one of the above from the first record's fields; records with other
         names (a question in question / problem / prompt, an answer in answer /
         solution, or the fields data.question_field / data.answer_field name) are
         read as gsm8k if the answer holds '####', math if it holds \\boxed{}, else jsonl.
code layouts (code, mbpp, humaneval, apps, livecodebench: rl_jax.data._code_layouts)
         read a problem's tests into the code verifier's answer; auto picks them by field.

data.question_field, data.answer_field and data.answer_extract (with data.answer_regex)
replace a layout's fields and how its answer is read. A row whose answer cannot be read
is dropped, as is a duplicate; each is counted (`LoadReport`), never dropped silently.
docs/data.md has the user's guide.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from rl_jax.config import paths
from rl_jax.config.data import DataConfig
from rl_jax.data._code_layouts import CODE_LAYOUTS, CodeLayout, detect_code_layout
from rl_jax.data._problem import Problem, RowError, make_problem
from rl_jax.knobs import ConfigError
from rl_jax.rewards import last_boxed, parse_number

Record = Mapping[str, Any]


def read_records(path: str | Path, key: str = "data.path") -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json (one object per line) or .parquet file, local or a URL
    (rl_jax.config.paths); `key` is the knob that named the file (for messages)."""
    path = path if paths.is_url(path) else Path(path)
    found = paths.kind(path, key)
    if found is None:
        raise ConfigError(f"{key}={str(path)!r} does not exist")
    if found == "dir":
        raise ConfigError(f"{key}={str(path)!r} is a directory, expected a data file")
    ext = paths.suffix(path)
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        try:
            with paths.open_input(path, key) as f:
                return pq.read_table(f).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"{key}={str(path)!r}: not a readable parquet file ({first})") from e
    if ext not in (".jsonl", ".json", ".ndjson"):
        raise ConfigError(f"{key}={str(path)!r}: expected .jsonl, .json or .parquet")
    rows = []
    with paths.open_input(path, key) as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); expected one JSON object per line"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not a JSON object per line ({e})") from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{path}:{n}: a JSON {type(row).__name__}, expected one object per line "
                    '({"question": ..., "answer": ...})'
                )
            rows.append(row)
    return rows


def _text(x: Any) -> str:
    """A field's value as text: bytes decoded; a float that `str` writes with an exponent
    (JSON's 1e-05, as json.dumps writes 0.00001) in positional notation, the form the
    verifiers read and models write."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if isinstance(x, float) and math.isfinite(x) and "e" in repr(x):
        return format(Decimal(repr(x)), "f")
    return str(x)


def _field(r: Record, key: str) -> str:
    """A question/answer/solution field as text. Null, NaN, inf, a list or an object is
    refused: as `str()` they would become 'None', 'nan' or '[...]', a wrong answer that also
    switches the verifier (a non-number answer makes the jsonl layout pick `math`)."""
    if key not in r:
        raise RowError(f"no {key!r} field (fields: {sorted(r)})")
    x = r[key]
    if x is None or isinstance(x, bool | list | dict):
        raise RowError(f"{key}={x!r}: expected a string or a number")
    # JSON's NaN / Infinity (and 1e400) read as floats that are no answer either.
    if isinstance(x, float) and not math.isfinite(x):
        raise RowError(f"{key}={x!r}: expected a string or a finite number")
    return _text(x)


def extract_answer(kind: str, text: str, regex: str = "") -> str | None:
    """The answer `kind` reads from a field's text, or None when it finds none: none (the
    whole text), gsm8k (after the last '####', thousands separators dropped), boxed (the
    last \\boxed{...}), regex (the last match's first group, or the whole match)."""
    if kind == "none":
        answer = text
    elif kind == "gsm8k":
        if "####" not in text:
            return None
        answer = text.split("####")[-1].replace(",", "")
    elif kind == "boxed":
        answer = last_boxed(text) or ""
    elif kind == "regex":
        matches = list(re.finditer(regex, text))
        if not matches:
            return None
        last = matches[-1]
        answer = (last.group(1) if last.re.groups else last.group(0)) or ""
    else:
        raise ValueError(f"unknown answer extraction {kind!r}")
    return answer.strip() or None


_EXTRACT_WORDS = {
    "none": "the whole of {f}",
    "gsm8k": "after the last '####' in {f}",
    "boxed": "the last \\boxed{{}} in {f}",
    "regex": "the last match of {r!r} in {f}",
}
# The verifier an extraction's answers are meant for (none and regex: by the answers).
_EXTRACT_REWARD = {"gsm8k": "numeric", "boxed": "math"}


@dataclass(frozen=True)
class Layout:
    """Where a record's question and answer are and how the answer is read from its field.

    name: the layout (gsm8k, math, polaris, jsonl); problems' task is `file:<name>`, part
        of their ids.
    question: the first of these fields a record has holds the question.
    answer: the field the answer is read from, by `extract` (regex: with `regex`).
    reward: the verifier; None = numeric when every answer is a number, else math.
    plain_answer: a field that, when a record has it non-empty, is the answer as it is
        (MATH-500's 'answer' beside its solution).
    """

    name: str
    question: tuple[str, ...]
    answer: str
    extract: str
    reward: str | None
    plain_answer: str = ""
    regex: str = ""

    def mapped(self, cfg: DataConfig) -> Layout:
        """This layout with data.question_field / answer_field / answer_extract applied."""
        lay = self
        if cfg.question_field:
            lay = dataclasses.replace(lay, question=(cfg.question_field,))
        if cfg.answer_field:
            lay = dataclasses.replace(lay, answer=cfg.answer_field, plain_answer="")
        if cfg.extract not in ("auto", lay.extract) or cfg.extract == "regex":
            reward = _EXTRACT_REWARD.get(cfg.extract)
            lay = dataclasses.replace(
                lay, extract=cfg.extract, regex=cfg.answer_regex, reward=reward
            )
        return lay

    def describe(self) -> str:
        q = " or ".join(repr(f) for f in self.question)
        a = _EXTRACT_WORDS[self.extract].format(f=repr(self.answer), r=self.regex)
        plain = f" (or {self.plain_answer!r} when set)" if self.plain_answer else ""
        return f"{self.name} layout: question {q}, answer {a}{plain}"

    def read(self, r: Record) -> tuple[str, str | None]:
        """(question, answer or None when the answer field holds none to read)."""
        q = next((f for f in self.question if f in r), None)
        if q is None:
            raise RowError(
                f"no {' or '.join(map(repr, self.question))} field (fields: {sorted(r)})"
            )
        question = _field(r, q)
        if self.plain_answer and r.get(self.plain_answer) not in (None, ""):
            return question, _field(r, self.plain_answer).strip() or None
        return question, extract_answer(self.extract, _field(r, self.answer), self.regex)


LAYOUTS: dict[str, Layout] = {
    "gsm8k": Layout("gsm8k", ("question",), "answer", "gsm8k", "numeric"),
    "math": Layout("math", ("problem",), "solution", "boxed", "math", plain_answer="answer"),
    "polaris": Layout("polaris", ("problem",), "answer", "none", "math"),
    "jsonl": Layout("jsonl", ("question", "prompt"), "answer", "none", None),
}
# Where `detect_layout` looks for a question and an answer under other layouts' names.
_QUESTION_NAMES = ("question", "problem", "prompt")
_ANSWER_NAMES = ("answer", "solution")


def detect_layout(record: Record, question_field: str = "", answer_field: str = "") -> Layout:
    """The layout of records like `record` (data.format=auto): one of LAYOUTS by its own
    field names; else a question and an answer field (data.question_field / answer_field,
    or the common names) read as gsm8k when the answer holds '####', math when it holds
    \\boxed{}, else jsonl."""
    keys = set(record)
    if not question_field and not answer_field:
        if {"question", "answer"} <= keys and "####" in _text(record["answer"]):
            return LAYOUTS["gsm8k"]
        if {"problem", "solution"} <= keys:
            return LAYOUTS["math"]
        if {"problem", "answer"} <= keys:
            return LAYOUTS["polaris"]
        if "answer" in keys and keys & {"question", "prompt"}:
            return LAYOUTS["jsonl"]
    q = question_field or next((k for k in _QUESTION_NAMES if k in keys), "")
    a = answer_field or next((k for k in _ANSWER_NAMES if k in keys), "")
    if not q or not a:
        missing = "question" if not q else "answer"
        names = _QUESTION_NAMES if not q else _ANSWER_NAMES
        raise ConfigError(
            f"cannot tell the layout of records with fields {sorted(keys)}: no {missing} "
            f"field (one of {list(names)}); set data.{missing}_field to the field holding "
            f"the {missing}, or data.format to one of {sorted(LAYOUTS)}"
        )
    text = "" if record.get(a) is None else _text(record[a])
    name = "gsm8k" if "####" in text else "math" if last_boxed(text) is not None else "jsonl"
    return dataclasses.replace(LAYOUTS[name], question=(q,), answer=a, plain_answer="")


def record_layout(first: Record, cfg: DataConfig, source: str) -> Layout:
    """The layout `cfg` reads records like `first` with (data.format, the field knobs);
    a field a knob names that `first` lacks is an error naming the fields it has."""
    for knob in ("question_field", "answer_field"):
        name = getattr(cfg, knob)
        if name and name not in first:
            raise ConfigError(
                f"data.{knob}={name!r} is not a field of {source}: its records have {sorted(first)}"
            )
    code = CODE_LAYOUTS.get(cfg.format) or (cfg.format == "auto" and detect_code_layout(first))
    if code:
        return _code_layout(code, first, cfg, source)
    if cfg.format == "auto":
        base = detect_layout(first, cfg.question_field, cfg.answer_field)
    else:  # DataConfig admits auto and the names of LAYOUTS and CODE_LAYOUTS
        base = LAYOUTS[cfg.format]
    lay = base.mapped(cfg)
    return _with_fields(lay, first, cfg, source, (lay.answer,), also=(lay.plain_answer,))


def _with_fields(lay, first: Record, cfg: DataConfig, source: str, answers, also=()):
    """`lay`, once `first` has one of its question fields and one of `answers` (or of
    `also`, fields an error does not name)."""
    wanted = (("question_field", lay.question, ()), ("answer_field", answers, also))
    for knob, names, others in wanted:
        if not any(f in first for f in (*names, *others)):
            raise ConfigError(
                f"{source}: records have no {' or '.join(map(repr, names))} field for the "
                f"{lay.name} layout (data.format={cfg.format!r}); their fields: "
                f"{sorted(first)}; set data.{knob} to one of them"
            )
    return lay


def _code_layout(base: CodeLayout, first: Record, cfg: DataConfig, source: str) -> CodeLayout:
    """A code layout with the field knobs applied, checked against the first record."""
    if cfg.extract != "auto":
        raise ConfigError(
            f"data.answer_extract={cfg.answer_extract!r}: the {base.name} layout reads tests, "
            "not an answer; leave it auto (data.answer_field names the tests' field)"
        )
    lay = base.mapped(cfg)
    return _with_fields(lay, first, cfg, source, lay.tests)


def problems_from_records(
    records: Iterable[Record], cfg: DataConfig, *, source: str
) -> tuple[list[Problem], str, Layout, tuple[int, int]]:
    """Problems (deduplicated by id, first kept), the layout's verifier, the layout, and
    (duplicates, unparsable answers) dropped. A row without the layout's fields, or one
    whose field is null or not text, is an error naming the row; a row whose answer field
    holds no answer the layout can read is dropped (all of them: an error)."""
    records = list(records)
    if not records:
        raise ConfigError(f"{source}: no records")
    if not isinstance(records[0], Mapping):
        raise ConfigError(f"{source} row 0: a {type(records[0]).__name__}, expected a record")
    layout = record_layout(records[0], cfg, source)
    out: dict[int, Problem] = {}
    unparsable: list[int] = []
    for n, r in enumerate(records):
        if not isinstance(r, Mapping):
            raise ConfigError(f"{source} row {n}: a {type(r).__name__}, expected a record")
        try:
            question, answer = layout.read(r)
        except RowError as e:
            raise ConfigError(f"{source} row {n} ({layout.name} layout): {e}") from None
        if answer is None:
            unparsable.append(n)
            continue
        meta = {"task": f"file:{layout.name}", "question": question, "row": n}
        if isinstance(layout, CodeLayout) and layout.reference(r):
            meta["reference"] = layout.reference(r)
        # The id ignores the file path, so moving a file keeps curriculum and split ids valid.
        p = make_problem(question, answer, meta)
        out.setdefault(p.id, p)
    if not out:
        first = _text(records[0].get(layout.answer))[:80]
        raise ConfigError(
            f"{source}: none of its {len(records)} rows has an answer to read "
            f"({layout.describe()}; row 0's is {first!r}); set data.answer_extract (none, "
            "gsm8k, boxed, regex with data.answer_regex) or data.answer_field"
        )
    problems = list(out.values())
    reward = layout.reward
    if reward is None:
        numeric = all(parse_number(p.answer) is not None for p in problems)
        reward = "numeric" if numeric else "math"
    problems = [
        Problem(id=p.id, prompt=p.prompt, answer=p.answer, meta={**p.meta, "reward": reward})
        for p in problems
    ]
    duplicates = len(records) - len(unparsable) - len(problems)
    return problems, reward, layout, (duplicates, len(unparsable))
