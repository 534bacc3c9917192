"""Accelerator chips a plan can target: published peak rates and memory, in one place.

Per chip, from Google Cloud's TPU system-architecture pages: dense bfloat16
peak FLOP/s, HBM capacity and HBM bandwidth. A topology name is
`<chip>:<shape>` as `jax.experimental.topologies` takes it (v5e:2x2,
v5p:2x2x2, v6e:4x4, v4:2x2x1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl_jax.knobs import ConfigError


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s

    def roofline_s(self, flops: float, bytes_accessed: float) -> float:
        """Lower bound on a program's time on one chip: compute- or memory-bound."""
        return max(flops / self.bf16_flops, bytes_accessed / self.hbm_bandwidth)


GB = 1e9
GIB = 2**30
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1228 * GB),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819 * GB),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765 * GB),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1640 * GB),
}


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """('v5p:4x4x4') -> (the v5p chip, (4, 4, 4)); ConfigError naming what is allowed."""
    chip, _, shape = name.partition(":")
    if chip not in CHIPS:
        raise ConfigError(f"--topology={name!r}: chip {chip!r} is not one of {sorted(CHIPS)}")
    try:
        dims = tuple(int(d) for d in shape.split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"--topology={name!r}: expected <chip>:<shape> such as {chip}:2x2")
    return CHIPS[chip], dims


def num_chips(dims: tuple[int, ...]) -> int:
    return math.prod(dims)
