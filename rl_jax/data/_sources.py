"""Untemplated problems of the in-memory sources (arith, countdown, file, reasoning_gym),
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
        held = {p.id for p in val}
        # A validation problem that also sits in the training file is trained on: drop it there.
        return [p for p in problems if p.id not in held], val, reward
    if cfg.val_size >= len(problems):
        raise ConfigError(
            f"data.val_size={cfg.val_size} leaves no training problems of the "
            f"{len(problems)} in {cfg.path}; lower it or set data.val_path"
        )
    # Held-out split by a seeded permutation over id-sorted problems: independent of row order.
    problems = sorted(problems, key=lambda p: p.id)
    perm = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED])).permutation(
        len(problems)
    )
    val = [problems[i] for i in perm[: cfg.val_size]]
    train = [problems[i] for i in sorted(perm[cfg.val_size :])]
    return train, val, reward


_RAW_SOURCES: dict[str, Callable[[DataConfig], RawSplits]] = {
    "arith": _arith,
    "countdown": _countdown,
    "file": _file,
    "reasoning_gym": _gym,
}


def raw_problems(cfg: DataConfig) -> RawSplits:
    """Untemplated (train, val, reward name) of an in-memory source."""
    if cfg.source not in _RAW_SOURCES:
        raise ConfigError(
            f"data.source={cfg.source!r} has no in-memory problems; one of {sorted(_RAW_SOURCES)}"
        )
    return _RAW_SOURCES[cfg.source](cfg)
