"""The loops that stay rolled in a run and that a plan must count: attention's blocks,
the LM head's chunks.

XLA's cost analysis counts a `while` loop's body once. `rl-jax plan` counts the layer
and minibatch scans by building 1- and 2-layer programs with them unrolled; loops over
blocks and chunks are too long to unroll at real lengths (a 15k-token attention is
hundreds of block pairs per layer and pass), so they go through `scan` here, which a
plan runs in one of three modes (`mode()`):

* run (default): `jax.lax.scan`, rolled;
* unrolled (`unrolled()`): every iteration in the program (the plan's tests' truth);
* counting (`counting(twice)`): the loop *peeled*: its first iteration (two, for the
  loops named in `twice`) as straight-line code, the trip count recorded. One body's
  cost is the difference between a program with a loop's body twice and once; the plan
  adds it (trip count - 1) times (`rl_jax.plan._programs`).

A loop's key is (name, trip count, inside a layer body): every loop of one key doubles
together (an attention's forward and backward, full remat's second forward), and a
loop inside a layer (`layer_body`) counts once per layer.

A loop whose run on the target platform is one fused kernel (splash attention on TPU:
the counting program holds its XLA stand-in) says so with `bytes_per_flop`: the HBM
bytes the kernel moves per FLOP of the loop, at most. XLA's bytes of the stand-in's
body count every block of scores it writes and reads back, which the kernel keeps on
chip; the plan counts such a body's bytes as its FLOPs times this ratio instead
(`Count.fused`).

Rules: a loop over blocks or chunks that must stay rolled goes through `scan`; a
`jax.custom_vjp` whose backward calls `scan` takes `mode()` as a static argument and
passes it on, because its backward is traced after the mode's context is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# The real scan, taken at import: the plan's layer unrolling patches `jax.lax.scan`.
_lax_scan = jax.lax.scan


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static argument
class Count:
    """A counting trace: the keys whose loops run two iterations, and the trip count of
    every loop key met while tracing (filled in)."""

    twice: frozenset
    trips: dict = dataclasses.field(default_factory=dict)
    fused: dict = dataclasses.field(default_factory=dict)  # key -> bytes per FLOP, at most


class Mode(NamedTuple):
    how: str  # "run", "unrolled" or "counting"
    count: Count | None = None
    in_layer: bool = False


_mode = Mode("run")


def mode() -> Mode:
    """The mode loops traced now run in (hashable: a `custom_vjp` static argument)."""
    return _mode


@contextlib.contextmanager
def _set(new: Mode) -> Iterator[Mode]:
    global _mode
    old, _mode = _mode, new
    try:
        yield new
    finally:
        _mode = old


def unrolled():
    """Loops traced inside run every iteration in the program."""
    return _set(Mode("unrolled", in_layer=_mode.in_layer))


@contextlib.contextmanager
def counting(twice=()) -> Iterator[Count]:
    """Loops traced inside run peeled (one iteration; two for the keys in `twice`);
    yields the `Count` whose `trips` maps each key met to its trip count."""
    count = Count(frozenset(twice))
    with _set(Mode("counting", count, _mode.in_layer)):
        yield count


def layer_body(fn: Callable) -> Callable:
    """`fn`, a layer scan's body: loops traced in it count once per layer."""

    @functools.wraps(fn)
    def body(*args, **kw):
        with _set(_mode._replace(in_layer=True)):
            return fn(*args, **kw)

    return body


def scan(
    body: Callable,
    init: Any,
    xs: Any,
    *,
    name: str,
    mode: Mode | None = None,
    bytes_per_flop: float | None = None,
) -> tuple[Any, Any]:
    """`jax.lax.scan(body, init, xs)` (xs required: its leading axis is the trip count),
    run as `mode` (default: the mode in effect) says. Counting: the carry after the
    peeled iterations and their outputs, the last repeated to the trip count.
    `bytes_per_flop`: the loop runs as a fused kernel moving at most this many HBM
    bytes per FLOP (recorded for its key, the largest of its loops')."""
    m = _mode if mode is None else mode
    if m.how == "run":
        return _lax_scan(body, init, xs)
    if m.how == "unrolled":
        return _lax_scan(body, init, xs, unroll=True)
    n = jax.tree.leaves(xs)[0].shape[0]
    key = (name, n, m.in_layer)
    m.count.trips[key] = n
    if bytes_per_flop is not None:
        m.count.fused[key] = max(m.count.fused.get(key, 0.0), float(bytes_per_flop))
    # The carry and the iteration's inputs opaque to XLA, as in the rolled loop: a peeled
    # iteration costs what any iteration of the loop costs, not the first over a carry
    # known to be zeros or one whose constant block indices fold its masks away.
    carry, ys = jax.lax.optimization_barrier(init), []
    for i in range(min(n, 2 if key in m.count.twice else 1)):
        x = jax.lax.optimization_barrier(jax.tree.map(lambda a, i=i: a[i], xs))
        carry, y = body(carry, x)
        ys.append(y)

    def fill(*y):
        last = jnp.broadcast_to(y[-1], (n - len(y), *y[-1].shape))
        return jnp.concatenate([jnp.stack(y), last])

    return carry, jax.tree.map(fill, *ys)
