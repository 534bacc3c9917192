"""Untemplated problems of the in-memory sources (arith, countdown, file, hf, reasoning_gym),
by source name; `source=tfds` datasets are written from these (rl_jax.data._tfds)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._files import problems_from_records, read_records
from rl_jax.data._problem import Problem
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
