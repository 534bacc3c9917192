"""A task mixture's problems (data.mixture): each task's own, marked with their task.

Every problem of task `t` carries meta["mix_task"] = t and meta["mix_weight"] (the
task's share of each batch) and an answer that names its verifier
(`rl_jax.rewards.TaskAnswer`). The marks travel with the problems through any list
operation (a split's selection, dropping long prompts), so `PromptPipeline` draws the
stated proportions from whatever list it is given, and the `mixture` verifier scores
each answer with its task's verifier.

Training problems are the tasks' in order; validation problems interleave the tasks
one by one, so the first eval.num_prompts of them hold every task equally (as far as
each has problems).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Sequence

from rl_jax.config.data import DataConfig
from rl_jax.data._problem import LazySequence, LoadReport, MappedSequence, Problem, Task

MIX_TASK, MIX_WEIGHT = "mix_task", "mix_weight"


class Concat(LazySequence):
    """Sequences one after another, read lazily (a task's problems may be a lazy view)."""

    def __init__(self, parts: Sequence[Sequence]):
        self._parts = list(parts)
        # Where each part starts, then the total: part k holds items starts[k]..starts[k+1]-1.
        self._starts = [0, *itertools.accumulate(len(p) for p in self._parts)]

    def __len__(self) -> int:
        return self._starts[-1]

    def _item(self, i: int):
        k = bisect.bisect_right(self._starts, i) - 1  # the part holding i (never an empty one)
        return self._parts[k][i - self._starts[k]]


def _interleave(parts: list[Sequence[Problem]]) -> list[Problem]:
    return [p for row in itertools.zip_longest(*parts) for p in row if p is not None]


def mixture_task(cfg: DataConfig, build: Callable[[DataConfig, str], Task]) -> Task:
    """The Task of `cfg.mixture`: `build(task_cfg, verifier)` builds each task's own
    (`verifier`: the task's reward, '' for its source's own)."""
    from rl_jax.rewards import TaskAnswer

    trains, vals, verifiers, reports, infos = [], [], [], [], {}
    for t in cfg.mixture_tasks():
        sub = build(t.data(cfg), t.reward)
        verifier = t.reward or sub.reward_name
        verifiers.append(verifier)

        def mark(p: Problem, name=t.name, weight=t.weight, verifier=verifier) -> Problem:
            meta = {**p.meta, MIX_TASK: name, MIX_WEIGHT: weight}
            return dataclasses.replace(p, answer=TaskAnswer(p.answer, verifier), meta=meta)

        lazy = not isinstance(sub.train, list)
        trains.append(MappedSequence(sub.train, mark) if lazy else [mark(p) for p in sub.train])
        vals.append([mark(p) for p in sub.val])
        reports.append((t.name, sub))
        infos[t.name] = {**sub.info, "weight": t.weight, "verifier": verifier}
    train = trains if any(not isinstance(p, list) for p in trains) else None
    train = Concat(trains) if train else [p for part in trains for p in part]
    val = _interleave(vals)
    # One verifier for all: that one; else each answer's own (the `mixture` verifier).
    reward = verifiers[0] if len(set(verifiers)) == 1 else "mixture"
    info = {"source": "mixture", "tasks": infos, "train_size": len(train), "val_size": len(val)}
    return Task(
        name="mixture",
        train=train,
        val=val,
        reward_name=reward,
        info=info,
        report=_report(reports, len(train), len(val)),
    )


def _report(reports: list[tuple[str, Task]], train: int, val: int) -> LoadReport | None:
    """One LoadReport of every task's: where and how each was read, rows and drops summed
    (None when every task is generated: nothing was read)."""
    if all(sub.report is None for _, sub in reports):
        return None
    out = LoadReport(train=train, val=val)
    layouts = []
    for name, sub in reports:
        r = sub.report
        if r is None:
            out.where.append(f"{name}: {sub.name} generated")
            continue
        out.where += [f"{name}: {w}" for w in r.where]
        layouts.append(f"{name}: {r.layout}")
        out.rows += r.rows
        for k, n in r.dropped.items():
            out.dropped[k] = out.dropped.get(k, 0) + n
    out.layout = "; ".join(layouts) or "generated"
    return out


def task_of(p: Problem) -> str:
    """The mixture task a problem belongs to ('' outside a mixture)."""
    return p.meta.get(MIX_TASK, "")
