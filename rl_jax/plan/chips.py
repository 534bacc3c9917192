"""Accelerator chips a plan can target: published peak rates and memory, in one place.

Per chip, from Google Cloud's TPU system-architecture pages: dense bfloat16
peak FLOP/s, HBM capacity and bandwidth, and inter-chip interconnect bandwidth. A topology name is
`<chip>:<shape>` as `jax.experimental.topologies` takes it (v5e:2x2,
v5p:2x2x2, v6e:4x4, v4:2x2x1), or a Cloud TPU accelerator type (v5p-128,
v6e-64, v5litepod-16, v4-32), which names the slice's default shape
(`canonical_topology`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl_jax.knobs import ConfigError

# The most chips a tensor-parallel group spans: those one host's interconnect joins
# (a plan's meshes keep tensor parallelism within a host).
MAX_TENSOR = 8


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bidirectional inter-chip interconnect bytes/s, all ports
    ici_ports: int  # 4 on a 2-D torus, 6 on a 3-D one

    @property
    def collective_bandwidth(self) -> float:
        """Bytes/s one chip sends in a collective over one axis of its torus: the 2 of
        its ports along that axis (a ring both ways). A model: a mesh axis laid over
        several torus axes uses more links, one sharing its links with another less."""
        return self.ici_bandwidth * 2 / self.ici_ports

    def roofline_s(self, flops: float, bytes_accessed: float) -> float:
        """Lower bound on a program's time on one chip: compute- or memory-bound."""
        return max(flops / self.bf16_flops, bytes_accessed / self.hbm_bandwidth)

    def mfu(self, flops: float, seconds: float) -> float:
        """The fraction of one chip's peak that `flops` (its model FLOPs) in `seconds` use
        (NaN where no time is known)."""
        return flops / self.bf16_flops / seconds if seconds > 0 else math.nan

    def push_s(self, push: float, sampler: int, trainer: int) -> float:
        """Seconds a version's weights take from the trainer's `trainer` chips to the
        sampler's `sampler` (split mode, once per RL step): each sampler chip receives
        `push` bytes (its shard of the view), and the trainer's chips send those of every
        sampler chip between them, over ICI at half its bidirectional bandwidth (one
        direction of every port at once). A lower bound: no hops, no contention, nothing
        overlapped."""
        return max(push, push * sampler / trainer) / (self.ici_bandwidth / 2)


GB = 1e9
GIB = 2**30
# ICI: "bidirectional inter-chip interconnect (ICI) bandwidth (per chip)" of the v5e,
# v5p and v6e pages; the v4 page gives none (its collectives are priced as NaN).
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1228 * GB, math.nan, 6),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819 * GB, 400 * GB, 4),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 6),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1640 * GB, 800 * GB, 4),
}


# Cloud TPU accelerator types: <prefix>-<N> with N TensorCores (v4 and v5p have two per
# chip, v5e and v6e one), and the shape of chips a slice of that type has by default
# (Cloud TPU's "TPU versions" pages). Other shapes go by <chip>:<shape>.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_PREFIXES = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}
_DEFAULT_SHAPES = {  # by the chips' torus: 3-D (v4, v5p) or 2-D (v5e, v6e)
    3: "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 8x8x8 8x8x16 8x16x16 16x16x16",
    2: "1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16",
}
_TORUS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}


def canonical_topology(name: str) -> str:
    """A topology as `jax.experimental.topologies` names it: `<chip>:<shape>` as given,
    an accelerator type as its default shape ('v5p-128' -> 'v5p:4x4x4': 64 chips of
    two TensorCores); ConfigError naming what is allowed for an unknown size."""
    if ":" in name or "-" not in name:
        return name
    prefix, _, cores = name.rpartition("-")
    chip = _PREFIXES.get(prefix)
    if chip is None or not cores.isdigit():
        raise ConfigError(
            f"--topology={name!r}: expected <chip>:<shape> (v5p:4x4x4) or an accelerator"
            f" type <{'|'.join(sorted(_PREFIXES))}>-<TensorCores> (v5p-128)"
        )
    per_chip = _CORES_PER_CHIP[chip]
    shapes = {
        math.prod(int(d) for d in s.split("x")): s for s in _DEFAULT_SHAPES[_TORUS[chip]].split()
    }
    n = int(cores)
    if n % per_chip or n // per_chip not in shapes:
        sizes = ", ".join(f"{prefix}-{c * per_chip}" for c in shapes)
        raise ConfigError(f"--topology={name!r}: not a {chip} slice size; one of {sizes}")
    return f"{chip}:{shapes[n // per_chip]}"


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """('v5p:4x4x4' or 'v5p-128') -> (the v5p chip, (4, 4, 4)); ConfigError naming what
    is allowed."""
    name = canonical_topology(name)
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
