"""Untemplated problems of the in-memory sources (arith, countdown, code, file, hf,
reasoning_gym), by source name; `source=tfds` datasets are written from these
(rl_jax.data._tfds)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._code_tasks import code_problems
from rl_jax.data._files import problems_from_records, read_records
from rl_jax.data._gym_source import gym_problems
from rl_jax.data._problem import LoadReport, Problem
from rl_jax.data._synthetic import arith_problems, countdown_problems
from rl_jax.knobs import ConfigError

# (train, validation, verifier name, what reading a dataset dropped: None when generated)
RawSplits = tuple[list[Problem], list[Problem], str, LoadReport | None]


def _generated(problems: Callable, reward: str) -> Callable[[DataConfig], RawSplits]:
    """A generated source: `problems(cfg)` gives (train, val), scored by `reward`."""
    return lambda cfg: (*problems(cfg), reward, None)


def _file(cfg: DataConfig) -> RawSplits:
    rows = read_records(cfg.path, "data.path")
    val_rows = read_records(cfg.val_path, "data.val_path") if cfg.val_path else None
    return _splits(cfg, rows, f"data.path={cfg.path}", val_rows, f"data.val_path={cfg.val_path}")


def _hf(cfg: DataConfig) -> RawSplits:
    from rl_jax.data._hf import hf_records

    rows, val_rows, where = hf_records(cfg)
    vwhere = f"{cfg.path} split {cfg.hf_val_split!r}"
    return _splits(cfg, rows, where, val_rows, vwhere)


def _splits(
    cfg: DataConfig, rows: list, where: str, val_rows: list | None, val_where: str
) -> RawSplits:
    """Problems of the training records, and of the validation ones (or held out of the
    training records), with a LoadReport of both."""
    problems, reward, layout, (dup, bad) = problems_from_records(rows, cfg, source=where)
    report = LoadReport(layout=layout.describe())
    report.add(where, len(rows), dup, bad)
    if val_rows is None:
        train, val = hold_out(cfg, problems, where=where)
    else:
        val, _, _, (dup, bad) = problems_from_records(val_rows, cfg, source=val_where)
        report.add(val_where, len(val_rows), dup, bad)
        # A validation problem that also sits in the training data would be trained on:
        # dropped there.
        held = {p.id for p in val}
        train = [p for p in problems if p.id not in held]
        if not train:
            raise ConfigError(
                f"every one of the {len(problems)} problems of {where} is also in {val_where},"
                " leaving none to train on; give data.val_path a file of other problems, or"
                " leave it empty to hold data.val_size out of the training data"
            )
        if len(train) < len(problems):
            report.dropped["also in validation"] = len(problems) - len(train)
    report.train, report.val = len(train), len(val)
    return train, val, reward, report


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
    "arith": _generated(arith_problems, "arith"),
    "countdown": _generated(countdown_problems, "countdown"),
    "code": _generated(code_problems, "code"),
    "file": _file,
    "hf": _hf,
    "reasoning_gym": _generated(gym_problems, "gym"),
}


def raw_problems(cfg: DataConfig) -> RawSplits:
    """Untemplated (train, val, reward name) of an in-memory source: any but tfds, which
    its callers read otherwise."""
    return _RAW_SOURCES[cfg.source](cfg)
