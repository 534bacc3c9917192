"""`build_task(cfg)`: the train/val problems a DataConfig describes, by source name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._files import LAYOUTS, problems_from_records, read_records
from rl_jax.data._problem import MappedSequence, Problem, Task, problem_id, templated
from rl_jax.knobs import ConfigError

RawSplits = tuple[list[Problem], list[Problem], str]


def _arith(cfg: DataConfig) -> RawSplits:
    from rl_jax.data._synthetic import arith_problems

    return (*arith_problems(cfg), "arith")


def _countdown(cfg: DataConfig) -> RawSplits:
    from rl_jax.data._synthetic import countdown_problems

    return (*countdown_problems(cfg), "countdown")


def _gym(cfg: DataConfig) -> RawSplits:
    from rl_jax.data._gym_source import gym_problems

    return (*gym_problems(cfg), "gym")


def _file(cfg: DataConfig) -> RawSplits:
    problems, reward, _ = problems_from_records(
        read_records(cfg.path, "data.path"), layout=cfg.format, source=cfg.path
    )
    if cfg.val_path:
        val, _, _ = problems_from_records(
            read_records(cfg.val_path, "data.val_path"), layout=cfg.format, source=cfg.val_path
        )
        return (*_without(problems, val), reward)
    return (*hold_out(cfg, problems, where=cfg.path), reward)


def _hf(cfg: DataConfig) -> RawSplits:
    from rl_jax.data._hf import hf_records

    train_rows, val_rows, where = hf_records(cfg)
    problems, reward, _ = problems_from_records(train_rows, layout=cfg.format, source=where)
    if val_rows is not None:
        vwhere = f"{cfg.path} split {cfg.hf_val_split!r}"
        val, _, _ = problems_from_records(val_rows, layout=cfg.format, source=vwhere)
        return (*_without(problems, val), reward)
    return (*hold_out(cfg, problems, where=where), reward)


def _without(train: list[Problem], val: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    held = {p.id for p in val}
    # A validation problem that also sits in the training data is trained on: drop it there.
    return [p for p in train if p.id not in held], val


def hold_out(
    cfg: DataConfig, problems: list[Problem], *, where: str
) -> tuple[list[Problem], list[Problem]]:
    """(train, val): `cfg.val_count` problems held out by a seeded permutation over
    id-sorted problems (independent of row order); at least one of each."""
    n_val = cfg.val_count(len(problems))
    if n_val >= len(problems):
        raise ConfigError(
            f"data.val_size={cfg.val_size:g} holds out {n_val} validation problems of the "
            f"{len(problems)} in {where}, leaving {len(problems) - n_val} to train on (at least "
            f"1 of each is needed); set data.val_size to a count below {len(problems)} or a "
            "fraction such as 0.1, or give data.val_path"
        )
    problems = sorted(problems, key=lambda p: p.id)
    perm = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED])).permutation(
        len(problems)
    )
    val = [problems[i] for i in perm[:n_val]]
    train = [problems[i] for i in sorted(perm[n_val:])]
    return train, val


_RAW_SOURCES: dict[str, Callable[[DataConfig], RawSplits]] = {
    "arith": _arith,
    "countdown": _countdown,
    "file": _file,
    "hf": _hf,
    "reasoning_gym": _gym,
}


def raw_problems(cfg: DataConfig) -> RawSplits:
    """Untemplated (train, val, reward name) of an in-memory source."""
    if cfg.source not in _RAW_SOURCES:
        raise ConfigError(
            f"data.source={cfg.source!r} has no in-memory problems; one of {sorted(_RAW_SOURCES)}"
        )
    return _RAW_SOURCES[cfg.source](cfg)


def _tfds_splits(cfg: DataConfig, make: Callable[[Problem], Problem]) -> RawSplits:
    from rl_jax.data._tfds import decode_record, open_tfds

    sources = open_tfds(cfg.task, cfg.path or None)
    if "train" not in sources:
        raise ConfigError(f"tfds dataset {cfg.task!r} has no 'train' split: {sorted(sources)}")
    val_key = next((k for k in ("validation", "test") if k in sources), None)

    def ours(rec) -> Problem:
        pid, question, answer, meta = decode_record(rec)
        return make(
            Problem(id=pid, prompt=question, answer=answer, meta={**meta, "question": question})
        )

    def foreign(rec) -> Problem:
        layout = cfg.format if cfg.format != "auto" else None
        question, answer = LAYOUTS[layout or "jsonl"](rec)
        pid = problem_id(f"tfds:{cfg.task}", question, answer)
        meta = {"task": f"tfds:{cfg.task}", "question": question}
        return make(Problem(id=pid, prompt=question, answer=answer, meta=meta))

    first = sources["train"][0]
    fn = ours if {"id", "question", "answer", "meta"} <= set(first) else foreign
    train = MappedSequence(sources["train"], fn)
    val = MappedSequence(sources[val_key], fn) if val_key else []
    reward = train[0].meta.get("reward", "numeric")
    return train, val, reward


def _select_split(problems: Sequence[Problem], ids: set[int]) -> Sequence[Problem]:
    if isinstance(problems, MappedSequence):
        keep = [i for i in range(len(problems)) if problems[i].id in ids]
        return MappedSequence(problems, lambda p: p, keep)
    return [p for p in problems if p.id in ids]


def build_task(
    cfg: DataConfig,
    *,
    tokenizer: Any = None,
    verifier: str = "auto",
    chat_template: Callable[[str], str] | None = None,
) -> Task:
    """Train and validation problems of `cfg`, rendered, filtered by its difficulty split.

    tokenizer: the model's; prompts are rendered with its chat template when it ships one
        and data.chat_template is on (`rl_jax.data.prompt_renderer`). None: plain text.
    verifier: rewards.name ('auto': the data's own), for data.answer_instruction=auto.
    chat_template: instead of a tokenizer, `fn(user_text) -> prompt` applied after
        data.prompt_template.
    """
    render: list[Callable[[str], str] | None] = [chat_template]
    make = lambda p: templated(p, cfg.prompt_template, render[0])
    if cfg.source == "tfds":
        # Rendered lazily, as records are read: the renderer is set once the verifier is known.
        train, val, reward = _tfds_splits(cfg, make)
    else:
        train, val, reward = raw_problems(cfg)
    if chat_template is None:
        from rl_jax.data._chat import prompt_renderer

        chosen = reward if verifier in ("", "auto") else verifier
        render[0] = prompt_renderer(cfg, tokenizer, verifier=chosen)
    if cfg.source != "tfds":
        train, val = [make(p) for p in train], [make(p) for p in val]
    info = {"source": cfg.source, "task": cfg.task, "difficulty": cfg.difficulty}
    if cfg.split_file:
        from rl_jax.data.splits import read_splits

        splits = read_splits(cfg.split_file)["splits"]
        if cfg.split_name not in splits:
            raise ConfigError(
                f"data.split_name={cfg.split_name!r} is not in {cfg.split_file}; "
                f"splits there: {sorted(splits)}"
            )
        ids = set(splits[cfg.split_name])
        n_train, n_val = len(train), len(val)
        train, val = _select_split(train, ids), _select_split(val, ids)
        if not len(train) or (n_val and not len(val)):
            raise ConfigError(
                f"split {cfg.split_name!r} of {cfg.split_file} holds {len(train)} of the "
                f"{n_train} training and {len(val)} of the {n_val} validation problems of this "
                "data config; estimate avg@k over task.train and task.val of the same config"
            )
        info.update(split=cfg.split_name, split_file=str(Path(cfg.split_file)))
    info.update(train_size=len(train), val_size=len(val))
    name = cfg.source if cfg.source in ("countdown", "file", "hf") else f"{cfg.source}:{cfg.task}"
    return Task(name=name, train=train, val=val, reward_name=reward, info=info)
