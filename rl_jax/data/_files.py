"""Real datasets from JSONL or parquet files in the GSM8K, MATH and Polaris layouts.

A file is a local path or a URL (`gs://...`, any fsspec protocol: rl_jax.config.paths).

gsm8k    {"question": ..., "answer": "... #### 72"}          -> numeric verifier
math     {"problem": ..., "solution": "... \\boxed{3}"}       -> math verifier
         (an "answer" field, as in MATH-500, wins over the boxed solution)
polaris  {"problem": ..., "answer": "3"}                      -> math verifier
jsonl    {"question" | "prompt": ..., "answer": ...}          -> numeric if every
         answer is a plain number, else math
auto     picks one of the above from the first record's keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rl_jax.config import paths
from rl_jax.data._problem import Problem, problem_id
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
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


class _RowError(ValueError):
    """What is wrong with one record (the caller adds the file and row)."""


def _field(r: Record, key: str) -> str:
    """A question/answer/solution field as text. Null, a list or an object is refused: as
    `str()` they would become 'None' or '[...]', a wrong answer that also switches the
    verifier (a non-number answer makes the jsonl layout pick `math`)."""
    if key not in r:
        raise _RowError(f"no {key!r} field (keys: {sorted(r)})")
    x = r[key]
    if x is None or isinstance(x, bool | list | dict):
        raise _RowError(f"{key}={x!r}: expected a string or a number")
    return _text(x)


def _gsm8k(r: Record) -> tuple[str, str]:
    answer = _field(r, "answer").split("####")[-1].strip().replace(",", "")
    return _field(r, "question"), answer


def _math(r: Record) -> tuple[str, str]:
    if r.get("answer") not in (None, ""):
        return _field(r, "problem"), _field(r, "answer").strip()
    boxed = last_boxed(_field(r, "solution"))
    if boxed is None:
        raise _RowError("solution has no \\boxed{} answer")
    return _field(r, "problem"), boxed.strip()


def _polaris(r: Record) -> tuple[str, str]:
    return _field(r, "problem"), _field(r, "answer").strip()


def _generic(r: Record) -> tuple[str, str]:
    q = "question" if "question" in r else "prompt"
    return _field(r, q), _field(r, "answer").strip()


LAYOUTS: dict[str, Callable[[Record], tuple[str, str]]] = {
    "gsm8k": _gsm8k,
    "math": _math,
    "polaris": _polaris,
    "jsonl": _generic,
}
_LAYOUT_REWARD = {"gsm8k": "numeric", "math": "math", "polaris": "math"}


def detect_layout(record: Record) -> str:
    keys = set(record)
    if {"question", "answer"} <= keys and "####" in _text(record["answer"]):
        return "gsm8k"
    if {"problem", "solution"} <= keys:
        return "math"
    if {"problem", "answer"} <= keys:
        return "polaris"
    if "answer" in keys and keys & {"question", "prompt"}:
        return "jsonl"
    raise ConfigError(
        f"cannot tell the layout of records with keys {sorted(keys)}; set data.format to one "
        f"of {sorted(LAYOUTS)}"
    )


def problems_from_records(
    records: Iterable[Record], *, layout: str, source: str
) -> tuple[list[Problem], str, int]:
    """Problems (deduplicated by id, first kept), the layout's verifier, and the number of
    duplicates dropped. Rows without a readable answer are an error naming the row."""
    records = list(records)
    if not records:
        raise ConfigError(f"{source}: no records")
    if layout == "auto":
        if not isinstance(records[0], Mapping):
            raise ConfigError(f"{source} row 0: a {type(records[0]).__name__}, expected a record")
        layout = detect_layout(records[0])
    if layout not in LAYOUTS:
        raise ConfigError(f"data.format={layout!r} is not one of {['auto', *sorted(LAYOUTS)]}")
    out: dict[int, Problem] = {}
    for n, r in enumerate(records):
        if not isinstance(r, Mapping):
            raise ConfigError(f"{source} row {n}: a {type(r).__name__}, expected a record")
        try:
            question, answer = LAYOUTS[layout](r)
        except _RowError as e:
            raise ConfigError(f"{source} row {n} ({layout} layout): {e}") from None
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{source} row {n}: not in the {layout} layout ({e!r})") from e
        # The id ignores the file path, so moving a file keeps curriculum and split ids valid.
        pid = problem_id(f"file:{layout}", question, answer)
        meta = {"task": f"file:{layout}", "question": question, "row": n}
        out.setdefault(pid, Problem(id=pid, prompt=question, answer=answer, meta=meta))
    problems = list(out.values())
    reward = _LAYOUT_REWARD.get(layout)
    if reward is None:
        numeric = all(parse_number(p.answer) is not None for p in problems)
        reward = "numeric" if numeric else "math"
    problems = [
        Problem(id=p.id, prompt=p.prompt, answer=p.answer, meta={**p.meta, "reward": reward})
        for p in problems
    ]
    return problems, reward, len(records) - len(problems)
