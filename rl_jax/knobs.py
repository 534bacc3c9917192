"""Helpers shared by every subsystem's frozen config dataclass.

Each knob carries its meaning in field metadata so `rl-jax --help` and
`rl-jax config --help` can list every knob with its default and meaning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


class DependentKnobError(ConfigError):
    """`knob`'s value is refused for the values of the knobs it depends on (`on`, dotted
    keys): it applies only under some of their values (train.off_policy_k under the
    off-policy modes), or its meaning changes with them.

    An override that switches one of `on` and leaves `knob` as the recipe had it puts
    `knob` back to its default instead (`rl_jax.config.apply_overrides`): one flag is one
    ablation. Set on the same command line, the two are checked together as given.

    mutual: the two exclude each other: when the command set `knob` and none of `on`,
    those of `on` take their defaults instead (the knob the command set wins).
    """

    def __init__(
        self, message: str, *, knob: str = "", on: tuple[str, ...] = (), mutual: bool = False
    ):
        super().__init__(message)
        self.knob, self.on, self.mutual = knob, tuple(on), mutual


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
    hi_open: bool = False,
) -> None:
    """`owner.name` within [lo, hi] (either end open or absent); NaN and inf never are.

    NaN compares false with everything, so a plain `value < lo` test lets it through.
    """
    check_finite(owner, name, value)
    bad = False
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        lo_s = "-inf" if lo is None else f"{lo}"
        hi_s = "inf" if hi is None else f"{hi}"
        bracket = "(" if lo_open else "["
        close = ")" if hi_open else "]"
        raise ConfigError(f"{owner}.{name}={value!r} must be in {bracket}{lo_s}, {hi_s}{close}")


def _is_float_knob(f: dataclasses.Field) -> bool:
    # Annotations are strings where a module postpones them (`from __future__ import
    # annotations`), types where it does not.
    return f.type in (float, "float", "float | None") or f.type == float | None


# Integers every knob must fit: they reach numpy/JAX as int64 (seeds, sizes, steps).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def check_finite(owner: str, name: str, value: Any) -> None:
    """A number knob must be a finite float or an int that fits int64."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{owner}.{name}={value!r} must be a finite number")
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        raise ConfigError(f"{owner}.{name}={value!r} must fit a 64-bit integer")


def check_numbers(owner: str, cfg: Any) -> None:
    """The generic pass every config runs first: each int/float field (and each number in a
    list field) finite and int64-sized. Specific ranges are checked after it, per knob.

    An int given to a float knob is stored as that float: `warmup_steps=50` in a recipe and
    `train.warmup_steps=50` on a command line (which OmegaConf reads as 50.0) are one config,
    written and hashed into the run id alike."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if _is_float_knob(f) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(cfg, f.name, value)
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, int | float):
                check_finite(owner, f.name, v)


def read_json_object(path, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A user's JSON file holding one object; anything else raises `error` naming the file."""
    import json
    from pathlib import Path

    f = Path(path)
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{f}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{f}: holds a JSON {type(data).__name__}, expected an object")
    return data
