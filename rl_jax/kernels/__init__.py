"""Hot ops under the forward, one interface, an implementation per platform.

The model names an operation, never a platform:

    k = kernels.for_mesh(mesh)           # the mesh's devices pick the platform
    out = k.attention(q, k_, v, mask, scale=s)

Ops (signatures of the reference, `rl_jax.kernels.xla`):

* `attention(q, k, v, mask, *, scale)`: grouped-query attention for prefill and
  training; q [B, T, H, hd], keys/values [B, K, S, hd], mask [B or 1, T, S].
* `flash_attention(q, k, v, mask, *, scale, block, layout=None)`: `attention` for
  long sequences (training): the mask described (`xla.AttentionMask`), never built
  [B, T, S], and scores [B, H, T, S] never whole, in the forward and the backward;
  `layout` (`xla.AttentionLayout`) says how q, k, v are sharded, for kernels that
  XLA cannot partition.
* `attention_cached(q, k, v, mask, *, scale, filled)`: the same over a KV cache
  of which the first `filled` slots are written (decode, chunked prefill).
* `dense(x, w)`: x [..., D] times w [D, ...], a projection.
* `einsum_f32(spec, a, b)`: a two-operand contraction accumulated in float32 (the
  LM head, attention's products).
* `grouped_matmul(x, w, group_sizes)`: rows of x [M, D] in consecutive groups, group g
  times w[g] ([G, D, N]); a mixture of experts' matmul over rows sorted by expert
  (`rl_jax.models.moe`). The reference is `jax.lax.ragged_dot` (one grouped matmul in
  libtpu and XLA:GPU; XLA:CPU masks every group's product).
* `together(fn, *args)`: `fn(*args)` with every output computed before any is read
  (the LM head's log-probs and entropy: its logits then die with the forward).
* `decode(platform, *, compute_dtype, head_dim, local, threads, attention=True,
  matmul=True)`: the ops of the one-token decode step (`rl_jax.models.decode`) as
  an object, `xla.Decode` or a subclass: the weights' and the engine's paged KV
  cache's layouts (`prepare`, `prepare_mlp`, `paged_shapes`, `paged_axes`,
  `page_size`) and the ops that read them (`embed`, `normed_dense`, `swiglu`,
  `residual_dense`, `logits`, `paged_attention`, `write_prompt`). The conditions say
  what the decode runs under: compute dtype, head width, whether each device decodes its
  rows alone (`local`) and whether one device decodes (`threads`); `attention` /
  `matmul` False keep XLA's for that part. `Kernels.decode_ops(**conditions)` calls it
  with the platform.

Implementations:

* `xla` (`xla.py`): plain JAX, used on every platform for every op a platform
  does not register; the reference the tests compare every other one against.
* `cpu` (`cpu.py`): XLA:CPU's contractions with half-precision operands upcast
  (its dot kernel has no bf16 x bf16 -> f32), `together` as a conditional (its
  scheduler otherwise defers what only a metric reads), and the decode step in C++
  kernels (XLA FFI; `cpu.Decode`, where `cpu.available()`).
* `tpu` (`tpu.py`): `flash_attention` as the Pallas TPU splash attention, run per
  device under `shard_map` (`layout`), and `grouped_matmul` as the megablox grouped
  matmul (the model calls it per device); the tests compare both with `xla` in
  Pallas's interpreter on CPU. `decode`: `tpu.Decode`, XLA's ops with the paged cache
  read by the Pallas paged attention kernel (its MoE matmuls XLA's ragged_dot). Its
  other ops are `xla`'s. A further Pallas
  kernel (ragged paged attention for `attention_cached`) registers here the same way.
* `gpu`: not registered yet; it gets `xla`.

Sequence lengths: on TPU an array [B, T, D] is stored in tiles of 8 rows of 32-bit words
(16 of bfloat16) by 128 lanes, so the reshape to [B * T, D] that a projection makes is
free only when T is a multiple of the tile's rows; otherwise libtpu copies the rows one
by one in code that grows with B * T (an odd T = 14,335 cost minutes of compile time
per program). `Kernels.seq_tile` is that multiple (`SEQUENCE_TILE`; 1 where any length
is free), and forwards that choose their own lengths round them to it.

Loops over blocks or chunks that stay rolled in a run (flash attention's block pairs,
the LM head's chunks) go through `loops.scan` (`loops.py`), so that `rl-jax plan`
counts every iteration of them without unrolling them.

The platform comes from the mesh's devices (`rl_jax.runtime.mesh_platform`), not
from the process's default backend: a CPU host compiling for a TPU topology
(`rl-jax plan`) gets the TPU program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from rl_jax.kernels import cpu, tpu, xla
from rl_jax.runtime import mesh_platform

# Platforms a kernel may be registered for ("xla" is the portable reference).
PLATFORMS = ("xla", "cpu", "gpu", "tpu")
# Sequence lengths that keep [B, T, D] -> [B * T, D] a bitcast, per platform (see above):
# 16 rows is a bfloat16 tile, and two float32 tiles.
SEQUENCE_TILE = {"tpu": 16}

_REGISTRY: dict[str, dict[str, Callable]] = {p: {} for p in PLATFORMS}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The ops of one platform (each the platform's own, or `xla`'s)."""

    platform: str
    attention: Callable
    attention_cached: Callable
    dense: Callable
    einsum_f32: Callable
    flash_attention: Callable
    decode: Callable
    together: Callable
    grouped_matmul: Callable

    @property
    def seq_tile(self) -> int:
        """The multiple of which sequence lengths are free to reshape (`SEQUENCE_TILE`)."""
        return SEQUENCE_TILE.get(self.platform, 1)

    def decode_ops(self, **conditions) -> xla.Decode:
        """The decode step's ops on this platform under `conditions` (see `decode`)."""
        return self.decode(self.platform, **conditions)


# The ops a platform may register: `Kernels`' fields after the platform.
OPS = tuple(f.name for f in dataclasses.fields(Kernels)[1:])


def _check_platform(platform: str) -> None:
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; known: {', '.join(PLATFORMS)}")


def register(platform: str, **ops: Callable) -> None:
    """Make `ops` (names of OPS) the implementations on `platform`."""
    _check_platform(platform)
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown kernel ops {unknown}; known: {', '.join(OPS)}")
    _REGISTRY[platform].update(ops)
    for_platform.cache_clear()


@functools.cache
def for_platform(platform: str) -> Kernels:
    """The ops on `platform` ("cpu", "gpu", "tpu", or "xla" for the reference alone)."""
    _check_platform(platform)
    ops = {**_REGISTRY["xla"], **_REGISTRY[platform]}
    return Kernels(platform=platform, **ops)


def for_mesh(mesh=None) -> Kernels:
    """The ops for `mesh`'s devices (the default device's without a mesh)."""
    return for_platform(mesh_platform(mesh))


# Each op under its own name in `xla`, but `decode` (`xla.decode_ops`).
register("xla", **{op: getattr(xla, op) for op in OPS if op != "decode"}, decode=xla.decode_ops)
# XLA's attentions with the CPU-safe contraction.
_CPU_ATTENTIONS = ("attention", "attention_cached", "flash_attention")
register(
    "cpu",
    **{op: functools.partial(getattr(xla, op), einsum=cpu.einsum_f32) for op in _CPU_ATTENTIONS},
    einsum_f32=cpu.einsum_f32,
    decode=cpu.decode_ops,
    together=cpu.together,
)
register(
    "tpu",
    flash_attention=tpu.flash_attention,
    grouped_matmul=tpu.grouped_matmul,
    decode=tpu.decode_ops,
)

__all__ = ["OPS", "PLATFORMS", "SEQUENCE_TILE", "Kernels", "for_mesh", "for_platform", "register"]
