"""Helpers shared by every subsystem's frozen config dataclass.

Each knob carries its meaning in field metadata so `rl-jax --help` and
`rl-jax config --help` can list every knob with its default and meaning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


def knob(
    default: Any = dataclasses.MISSING, *, help: str, factory: Callable[[], Any] | None = None
):
    """A dataclass field with a help string (shown by `--help`)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def sub(cls: type, help: str):
    """A nested sub-config field."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def check_choice(owner: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{owner}.{name}={value!r} is not one of {choices}")


def check_range(
    owner: str,
    name: str,
    value: float,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    bad = False
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value > hi
    if bad:
        lo_s = "-inf" if lo is None else f"{lo}"
        hi_s = "inf" if hi is None else f"{hi}"
        bracket = "(" if lo_open else "["
        raise ConfigError(f"{owner}.{name}={value!r} must be in {bracket}{lo_s}, {hi_s}]")
