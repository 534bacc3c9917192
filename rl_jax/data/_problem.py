"""The records every source produces: a Problem, and a Task (train/val problems + verifier)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One prompt with its verifiable answer.

    id: stable across runs and machines (a hash of source, question and answer,
        see `problem_id`), so curriculum state and difficulty-split files keyed by
        id stay valid whatever the template, train_size or ordering.
    prompt: the templated text given to the model.
    answer: the canonical answer string its verifier compares against.
    meta: task, difficulty, question (untemplated), reward (default verifier), ...
    """

    id: int
    prompt: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)


def problem_id(source: str, question: str, answer: str) -> int:
    """63-bit content hash: non-negative, fits int64 and JSON, independent of PYTHONHASHSEED."""
    blob = "\x00".join((source, question, answer)).encode("utf-8", "replace")
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


def make_problem(question: str, answer: str, meta: dict[str, Any]) -> Problem:
    """A problem prompted with its untemplated `question`, its id (`problem_id`) from
    meta["task"], the question and the answer."""
    pid = problem_id(meta["task"], question, answer)
    return Problem(id=pid, prompt=question, answer=answer, meta=meta)


class RowError(ValueError):
    """What is wrong with one record of a dataset (the caller adds the file and row)."""


@dataclass
class LoadReport:
    """What reading a dataset kept and dropped; `line()` says it in one line at load."""

    where: list[str] = field(default_factory=list)  # "data.path=train.jsonl", ...
    layout: str = ""
    rows: int = 0
    dropped: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("duplicate", "unparsable answer", "too long"), 0)
    )
    train: int = 0
    val: int = 0
    split: str = ""  # a difficulty split that selects among the problems read

    def add(self, where: str, rows: int, duplicates: int, unparsable: int) -> None:
        self.where.append(where)
        self.rows += rows
        self.dropped["duplicate"] += duplicates
        self.dropped["unparsable answer"] += unparsable

    def line(self) -> str:
        total = sum(self.dropped.values())
        why = ", ".join(f"{n} {k}" for k, n in self.dropped.items())
        split = f"; {self.split} keeps" if self.split else ";"
        return (
            f"data: {self.rows} rows read ({', '.join(self.where)}; {self.layout}); "
            f"{total} dropped ({why}){split} {self.train} train + {self.val} validation problems"
        )


@dataclass(frozen=True, kw_only=True)
class Task:
    """Problems of one data config. `reward_name` is the verifier they are meant for;
    `report` what reading a dataset dropped (None: generated or lazily read problems)."""

    name: str
    train: Sequence[Problem]
    val: Sequence[Problem]
    reward_name: str
    info: Mapping[str, Any] = field(default_factory=dict)
    report: LoadReport | None = None


def apply_template(template: str, question: str) -> str:
    # Plain substitution, not str.format: math templates contain literal braces (\boxed{}).
    return template.replace("{question}", question)


def templated(
    p: Problem, template: str, chat_template: Callable[[str], str] | None = None
) -> Problem:
    text = apply_template(template, p.meta["question"])
    return replace(p, prompt=chat_template(text) if chat_template else text)


class LazySequence(Sequence):
    """A sequence whose items are made on demand by `_item(i)`, 0 <= i < len; slices
    are lists, negative indices count from the end."""

    def _item(self, i: int):
        raise NotImplementedError

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._item(i)


class MappedSequence(LazySequence):
    """A lazy `fn(source[i])` view (ArrayRecord sources are read on demand)."""

    def __init__(
        self, source: Sequence, fn: Callable[[Any], Any], index: Sequence[int] | None = None
    ):
        self._source, self._fn = source, fn
        self._index = index

    def __len__(self) -> int:
        return len(self._index) if self._index is not None else len(self._source)

    def _item(self, i: int):
        return self._fn(self._source[self._index[i] if self._index is not None else i])
