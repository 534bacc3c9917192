"""Real datasets from local JSONL or parquet files in the GSM8K, MATH and Polaris layouts.

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

from rl_jax.data._problem import Problem, problem_id
from rl_jax.knobs import ConfigError
from rl_jax.rewards import last_boxed, parse_number

Record = Mapping[str, Any]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json (one object per line) or .parquet file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data.path={str(path)!r} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise ConfigError(f"data.path={str(path)!r}: expected .jsonl, .json or .parquet")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not a JSON object per line ({e})") from e
    return rows


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _gsm8k(r: Record) -> tuple[str, str]:
    answer = _text(r["answer"]).split("####")[-1].strip().replace(",", "")
    return _text(r["question"]), answer


def _math(r: Record) -> tuple[str, str]:
    if r.get("answer") not in (None, ""):
        return _text(r["problem"]), _text(r["answer"]).strip()
    boxed = last_boxed(_text(r["solution"]))
    if boxed is None:
        raise ValueError("solution has no \\boxed{} answer")
    return _text(r["problem"]), boxed.strip()


def _polaris(r: Record) -> tuple[str, str]:
    return _text(r["problem"]), _text(r["answer"]).strip()


def _generic(r: Record) -> tuple[str, str]:
    q = r.get("question", r.get("prompt"))
    if q is None:
        raise KeyError("question")
    return _text(q), _text(r["answer"]).strip()


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
        layout = detect_layout(records[0])
    if layout not in LAYOUTS:
        raise ConfigError(f"data.format={layout!r} is not one of {['auto', *sorted(LAYOUTS)]}")
    out: dict[int, Problem] = {}
    for n, r in enumerate(records):
        try:
            question, answer = LAYOUTS[layout](r)
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
