"""TPU kernels: `flash_attention` as the Pallas TPU splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`), `grouped_matmul` as the Pallas TPU
megablox grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`), registered for
meshes of TPUs.

The mask maps onto splash's as follows: causality with its offset (query t at key slot
offset + t) is the static `CausalMask((T, S), offset)`, whose fully hidden blocks the
kernel skips; key pads and packed-row segments are the dynamic `SegmentIds` (a hidden
key slot gets a segment no query has). Grouped-query attention is the kernel's own
(q [H, T, hd] over k / v [K, S, hd], query head h reading kv head h // (H / K), as
`xla.flash_attention` groups them). Rows are `vmap`ped, as in MaxText.

A Pallas call has no sharding rule: under a mesh it runs on each device's rows and
heads inside `jax.shard_map` (`xla.AttentionLayout`), as MaxText's `attentions.py`
wires it. It has no FLOPs that XLA's cost analysis sees either (splash attaches no
`pl.CostEstimate`), so the programs `rl-jax plan` counts FLOPs from (`loops` modes
"counting" and "unrolled") take `xla.flash_attention`, which computes the same
(query block, key block) pairs; the run's programs (mode "run", and with them the
plan's memory numbers) take splash. The stand-in's HBM bytes are not splash's: it
writes each pair's block of scores and reads it back, where splash keeps it in VMEM,
so it tells the count how many bytes splash moves per FLOP (`_bytes_per_flop`).

Rows that see no key at all (a left-padded prompt's pads) are the one difference:
`xla.flash_attention` gives them the mean of all S values, splash a finite average
over the keys of the blocks it visits. The model never reads them (their positions
are pads: no other query sees them and the loss masks them), and their gradient is
zero when their output's is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as paged
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from rl_jax.kernels import loops, xla

LANES = 128  # splash's blocks are multiples of the vector lane count
PAGED_BLOCK_SLOTS = 512  # positions per compute block of the paged attention kernel
HIDDEN = jnp.iinfo(jnp.int32).min  # the key segment of a pad: equal to no query's


def _block(block: int, n: int) -> int:
    """`block` as a multiple of 128, at least 128, at most n rounded up to 128."""
    up = -(-n // LANES) * LANES
    return max(LANES, min(block // LANES * LANES, up))


@functools.cache
def _kernel(T: int, S: int, offset: int, heads: int, bq: int, bkv: int, interpret: bool):
    """The splash kernel over `heads` query heads, T queries at key slots offset ..,
    S keys, blocks bq x bkv in the forward and both backward kernels."""
    causal = masks.CausalMask((T, S), offset=offset)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    # Built once per shape: the block maps as concrete arrays, not the first caller's
    # tracers (the cache outlives its trace).
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(
            masks.MultiHeadMask([causal] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def flash_attention(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask: xla.AttentionMask,
    *,
    scale: float,
    block: int = 512,
    layout: xla.AttentionLayout | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`xla.flash_attention` (same arguments and result, [B, T, H, hd]) with splash
    attention: blocks of `block` slots rounded to a multiple of 128 and clamped to the
    sequence, T and S padded to them and the padding dropped. `interpret`: run the
    kernel in Pallas's interpreter (any backend: the CPU tests)."""
    B, T = q_bthk.shape[:2]
    S = k_bksh.shape[2]
    bq, bkv = _block(block, T), _block(block, S)
    segments = mask.kv_valid_bs is not None or mask.q_segment_bt is not None
    if loops.mode().how != "run":  # a plan's FLOP counting: see the module's note
        hd, itemsize = q_bthk.shape[3], jnp.dtype(q_bthk.dtype).itemsize
        fused = _bytes_per_flop(T, S, int(mask.offset), bq, bkv, hd, itemsize, segments)
        return xla.flash_attention(
            q_bthk, k_bksh, v_bksh, mask, scale=scale, block=block, bytes_per_flop=fused
        )
    q_pad, pad = -T % bq, -S % bkv
    offset = int(mask.offset)
    # Pads past S are hidden by causality when no real query reaches them.
    hide_pad = pad and offset + T > S
    arrays = _segment_ids(mask, B, T, S, q_pad, pad) if segments or hide_pad else ()
    # Scaled in float32, then in q's dtype: splash scales nothing itself.
    q = (q_bthk.astype(jnp.float32) * scale).astype(q_bthk.dtype)
    q = jnp.pad(q, ((0, 0), (0, q_pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (k_bksh, v_bksh))
    Tp, Sp = T + q_pad, S + pad

    def local(q, k, v, *arrays):
        kernel = _kernel(Tp, Sp, offset, q.shape[1], bq, bkv, interpret)
        if arrays:
            ids = splash.SegmentIds(*arrays)
            return jax.vmap(kernel)(q, k, v, segment_ids=ids)
        return jax.vmap(kernel)(q, k, v)

    out = _per_device(local, layout, len(arrays))(q, k, v, *arrays)  # [B, H, Tp, hd]
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(q_bthk.dtype)


def _bytes_per_flop(
    T: int, S: int, offset: int, bq: int, bkv: int, hd: int, itemsize: int, segments: bool
) -> float:
    """HBM bytes per FLOP of splash's forward over T queries at key slots offset .. and
    S keys, from its block specs: for each query head, at every (query block, key block)
    pair causality shows, the key and value blocks (and the keys' segment ids, 8
    sublanes of int32); once per query block, the queries, the output, the queries'
    segment ids and the log-sum-exp (128 lanes of 32 bits each); over 4 x bq x bkv x hd
    FLOPs a pair. The backward's two kernels read as many blocks per pair (the dq
    kernel: keys and values; the dkv kernel: queries and output gradients) over 6 and
    8 x bq x bkv x hd FLOPs: the forward's ratio bounds the three."""
    nq = -(-T // bq)
    pairs = len(xla.causal_pairs(T, -(-S // bkv) * bkv, offset, bq, bkv)[0])
    per_pair = 2 * bkv * hd * itemsize + (8 * bkv * 4 if segments else 0)
    per_query_block = 2 * bq * hd * itemsize + bq * LANES * 4 * (2 if segments else 1)
    moved = pairs * per_pair + nq * per_query_block
    return moved / (pairs * 4 * bq * bkv * hd)


def _segment_ids(mask: xla.AttentionMask, B: int, T: int, S: int, q_pad: int, pad: int):
    """Splash's segment ids of `mask`, padded: (queries [B, T + q_pad], keys [B, S + pad]);
    a pad key, or one `mask.kv_valid_bs` hides, is in a segment no query is in."""
    q_seg = mask.q_segment_bt if mask.q_segment_bt is not None else jnp.zeros((B, T), jnp.int32)
    kv_seg = mask.kv_segment_bs if mask.kv_segment_bs is not None else jnp.zeros((B, S), jnp.int32)
    kv_seg = kv_seg.astype(jnp.int32)
    if mask.kv_valid_bs is not None:
        kv_seg = jnp.where(mask.kv_valid_bs.astype(bool), kv_seg, HIDDEN)
    q_seg = jnp.broadcast_to(q_seg.astype(jnp.int32), (B, T))
    kv_seg = jnp.broadcast_to(kv_seg, (B, S))
    return (
        jnp.pad(q_seg, ((0, 0), (0, q_pad))),
        jnp.pad(kv_seg, ((0, 0), (0, pad)), constant_values=HIDDEN),
    )


def _per_device(local, layout: xla.AttentionLayout | None, n_arrays: int):
    """`local(q, k, v, *segment arrays)` under `jax.shard_map` over `layout`'s mesh (batch
    and, where q's groups stay with their kv head, heads split), or as is: without a
    layout, on one device, or inside a shard_map already (the arrays are this device's)."""
    if layout is None:
        return local
    batch, heads = layout.q[0], layout.q[2] if len(layout.q) > 2 else None
    kv_heads = layout.kv[1] if len(layout.kv) > 1 else None
    if heads != kv_heads:  # split only where q's groups stay with their kv head
        heads = None
    spec = PartitionSpec(batch, heads, None, None)  # q, k, v and the output [B, H, T, hd]
    in_specs = (spec, spec, spec, *(PartitionSpec(batch, None) for _ in range(n_arrays)))
    return xla.per_device(local, layout, in_specs, spec)


# ---- the one-token decode step -----------------------------------------------------------


class Decode(xla.Decode):
    """`xla.Decode` with the engine's paged cache (`xla.PagedKV`, keys and values
    [K, L, N, P, hd], the layout the kernel reads) read by the Pallas paged attention
    kernel (`paged_attention`), per device under `jax.shard_map` on a mesh: a row reads
    its filled pages only. The kernel reads bfloat16 and blocks its softmax statistics
    as its queries, so it needs a head width of whole 128-lane tiles; another cache
    dtype (int8 too) or head width keeps XLA's reference (`kernel_reads`), as do the
    plan's counting programs (the kernel has no cost XLA can see).
    `interpret`: the kernel in Pallas's interpreter (any backend: the CPU tests)."""

    page_size = 64
    page_multiple = 16  # a page is whole bfloat16 tiles (16 rows)

    def __init__(self, platform: str, *, interpret: bool = False):
        super().__init__(platform)
        self.interpret = interpret

    def kernel_reads(self, dtype, head_dim: int) -> bool:
        """Whether the Pallas kernel reads a paged cache of `dtype` and `head_dim` (its
        per-head softmax statistics are blocked like its queries: on TPU, a head width of
        whole 128-lane tiles; Pallas's interpreter takes any)."""
        return jnp.dtype(dtype) == jnp.bfloat16 and (self.interpret or head_dim % 128 == 0)

    def pages_read(self, filled: int, width: int, *, dtype, head_dim: int) -> int:
        """The kernel reads a row's filled pages in blocks of `paged_block` pages."""
        if not self.kernel_reads(dtype, head_dim):
            return super().pages_read(filled, width, dtype=dtype, head_dim=head_dim)
        per = paged_block(width, self.page_size)
        return min(width, -(-filled // per) * per)

    def read_pages(self, q, cache, table, pos, layer, dtype, live=None):
        hd = q.shape[-1]
        if loops.mode().how != "run" or not self.kernel_reads(cache.values.dtype, hd):
            return super().read_pages(q, cache, table, pos, layer, dtype, live)
        q = (q.astype(jnp.float32) * hd**-0.5).astype(dtype)  # the kernel scales nothing
        lengths = pos + 1 if live is None else jnp.where(live, pos + 1, 0)  # ended: no reads
        return paged_attention(
            q, cache.keys, cache.values, table, lengths, layer, interpret=self.interpret
        )


def paged_block(width: int, page: int) -> int:
    """Pages per compute block of the paged attention kernel: about PAGED_BLOCK_SLOTS
    positions, at most a table's `width` pages."""
    return max(1, min(width, PAGED_BLOCK_SLOTS // page))


def paged_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    table: jax.Array,
    lengths: jax.Array,
    layer,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Queries q [B, K, R, hd] (scaled) over positions 0 .. lengths[b] - 1 of each row's
    pages of `layer` (keys, values [K, L, N, P, hd]; table [B, W] page ids, N past a
    row's own) with the Pallas TPU paged attention kernel: only the pages a row has
    filled are read, in blocks of `paged_block` pages. A row of length 0 reads nothing
    (zeros). The kernel reads keys and values in bfloat16. [B, K, R, hd] float32."""
    B, K, R, hd = q.shape
    _, L, N, P, _ = values.shape
    per = paged_block(table.shape[1], P)
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % per)), constant_values=N)
    # The layers side by side: layer l's page i is page l * N + i (a free reshape).
    pages = jnp.minimum(table, N - 1) + layer * N
    kp, vp = (x.reshape(K, L * N, P, hd) for x in (keys, values))

    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        out = paged.paged_attention(
            q.reshape(B, K * R, hd), kp, vp, lengths, pages, pages_per_compute_block=per
        )
    return out.reshape(B, K, R, hd).astype(jnp.float32)


# Megablox's tiles: rows (at most; fewer rows take one tile of their multiple of 8), and
# the contraction and output widths (a remainder is masked in the kernel).
GMM_ROWS, GMM_TILE = 128, 128


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """`xla.grouped_matmul` (rows of x [M, D] in consecutive groups, group g times w[g],
    [G, D, N]; rows past sum(group_sizes) zero; [M, N] in x's dtype) with megablox's
    kernels: `gmm` forward, `gmm` against w transposed for the rows' gradient, `tgmm`
    for the weights' (each expert's own rows). M is padded to whole tiles of rows. A
    Pallas call has no sharding rule: the model calls it per device (under `shard_map`,
    `rl_jax.models.moe.sharded_moe_mlp`). A plan's counting programs (`loops` modes
    "counting" and "unrolled") take `xla.grouped_matmul`, whose FLOPs XLA counts, its
    weight gradient's loop counted at tgmm's bytes (`_tgmm_bytes_per_flop`).
    `interpret`: Pallas's interpreter (the CPU tests)."""
    if loops.mode().how != "run":
        (M, D), (G, _, N) = x.shape, w.shape
        fused = _tgmm_bytes_per_flop(M, D, N, G, x.dtype.itemsize)
        return xla.grouped_matmul(x, w, group_sizes, bytes_per_flop=fused)
    return _gmm(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), interpret)


def _tgmm_bytes_per_flop(M: int, D: int, N: int, G: int, itemsize: int) -> float:
    """HBM bytes per FLOP of tgmm's weight gradient (x [M, D], dy [M, N], w [G, D, N], all
    of `itemsize`), from its tiles (`_gmm_layout`): for every output tile of [D, N] it
    reads each of its groups' row tiles of x and dy, so x is read once per tile of N and
    dy once per tile of D (a row tile two groups share, once per group: at most G more
    tiles); each group's [D, N] is written once. Over its 2 M D N FLOPs. (XLA's bytes of
    the counting program's stand-in, `xla.grouped_weight_grad`, count its gathers of
    every chunk's rows, which the kernel reads in place.)"""
    rows = M + G * _gmm_layout_rows(M)
    per_row = itemsize * (D * -(-N // GMM_TILE) + N * -(-D // GMM_TILE))
    return (rows * per_row + G * D * N * itemsize) / (2 * M * D * N)


def _gmm_layout(M: int, group_sizes: jax.Array) -> tuple[tuple[int, int, int], Any, Any]:
    """Megablox's tiling of M rows, and of an array of M rows: its rows padded with zeros
    to whole tiles, its rows past the groups zeroed too (`rows`); which rows are inside
    the groups ([M, 1])."""
    tm = _gmm_layout_rows(M)
    inside = (jnp.arange(M) < jnp.sum(group_sizes))[:, None]

    def rows(a):
        return jnp.pad(jnp.where(inside, a, 0), ((0, -(-M // tm) * tm - M), (0, 0)))

    return (tm, GMM_TILE, GMM_TILE), rows, inside


def _gmm_layout_rows(M: int) -> int:
    """Rows of megablox's row tile for M rows."""
    return min(GMM_ROWS, -(-M // 8) * 8)


def _gmm_rows(f, x, w, group_sizes, interpret, **kw):
    """f(x in whole tiles, ...) cut to x's rows, those past the groups zero."""
    M = x.shape[0]
    tiling, rows, inside = _gmm_layout(M, group_sizes)
    out = f(rows(x), w, group_sizes, x.dtype, tiling, interpret=interpret, **kw)[:M]
    return jnp.where(inside, out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(x, w, group_sizes, interpret):
    return _gmm_rows(gmm, x, w, group_sizes, interpret)


def _gmm_fwd(x, w, group_sizes, interpret):
    return _gmm(x, w, group_sizes, interpret), (x, w, group_sizes)


def _gmm_bwd(interpret, res, dy):
    x, w, group_sizes = res
    dx = _gmm_rows(gmm, dy, w, group_sizes, interpret, transpose_rhs=True)
    tiling, rows, _ = _gmm_layout(x.shape[0], group_sizes)
    dw = tgmm(rows(x).swapaxes(0, 1), rows(dy), group_sizes, w.dtype, tiling, interpret=interpret)
    # Under shard_map, summed over the axes the cotangent varies over and the primal
    # does not, as `xla.grouped_matmul`'s backward sums them.
    return xla.sum_to(dx, x).astype(x.dtype), xla.sum_to(dw, w).astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def decode_ops(platform: str, **conditions) -> Decode:
    """The decode step's ops on TPU (`Decode`, whatever the conditions)."""
    return Decode(platform)
