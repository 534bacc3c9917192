"""The portable implementation of every kernel op: plain JAX, lowered by XLA on any
platform. It is the default everywhere and the reference every other implementation
is tested against.

The ops of the one-token decode step (`rl_jax.models.decode`) are `Decode`'s methods,
with the weights and the engine's paged KV cache in the layouts they read (the end of
this file).

Dimension letters: B batch, T query time, S key time, H query heads, K kv heads,
R = H / K query heads per kv head, hd head width, N rows of a matmul, L layers,
D width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.kernels import loops

# Finite, so a row with every key masked (a pad query) gives a uniform softmax
# instead of NaNs that would poison gradients through the masked-out loss.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def precision(*operands: jax.Array) -> jax.lax.Precision:
    """Full float32 products when an operand is float32; the default (one pass) otherwise.

    JAX's default lets GPUs and TPUs multiply float32 in tf32 / bf16 passes. The
    sampler's and the trainer's log-probs, computed in different orders, then differ
    by ~1e-3 (measured on an H200) instead of ~1e-6, and on-policy importance ratios
    are not 1; ScaleRL's FP32 LM head would not be float32 either. A float32 model
    means float32 arithmetic; bf16 compute is the fast path. CPUs ignore this.
    """
    f32 = any(jnp.dtype(x.dtype) == jnp.float32 for x in operands)
    return jax.lax.Precision.HIGHEST if f32 else jax.lax.Precision.DEFAULT


def rms_norm(x: jax.Array, w: jax.Array, eps: float, *, dtype=None) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32; output in `dtype` (default x's)."""
    dtype = x.dtype if dtype is None else dtype
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(dtype) * w.astype(dtype)


def apply_rope(x_bthk: jax.Array, cos_btk: jax.Array, sin_btk: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + hd/2) (the "rotate half" layout of HF checkpoints)."""
    x = x_bthk.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos_btk[:, :, None, :], sin_btk[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_bthk.dtype)


def norm_rope_qk(
    q: jax.Array,
    k: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    qk_norm: tuple[jax.Array, jax.Array] | None,
    eps: float,
) -> tuple[jax.Array, jax.Array]:
    """A layer's queries and keys [B, T, heads, hd] from their projections to attention:
    RMS-normalized by qk_norm's (q's, k's) [hd] weights if given (Qwen3), then rotated
    by rope (cos, sin [B, T, hd / 2]). The model's forward and the decode step's ops
    both take this step here."""
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` at `precision(a, b)`."""
    return jnp.matmul(a, b, precision=precision(a, b))


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., D] times w [D, ...] -> [..., ...] as one 2-D matmul over all leading rows,
    in x's dtype.

    (A 3-D einsum makes XLA on CPU transpose activations for the weight gradient;
    the 2-D form lets the matmul read them in place.)"""
    lead, D = x.shape[:-1], x.shape[-1]
    out = matmul(x.reshape(-1, D), w.reshape(D, -1).astype(x.dtype))
    return out.reshape(*lead, *w.shape[1:])


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, bytes_per_flop: float | None = None
) -> jax.Array:
    """Rows of x [M, D] in consecutive groups, group g (group_sizes[g] rows) times w[g]:
    [M, N] in x's dtype, for w [G, D, N] (a mixture of experts' matmul over rows sorted
    by expert). `jax.lax.ragged_dot`: libtpu and XLA:GPU run it as one grouped matmul;
    XLA:CPU lowers it as a masked product over every group ([G, M, D] temporaries).
    Rows past sum(group_sizes) come out zero.

    The weights' gradient is `grouped_weight_grad`, not ragged_dot's own transpose (a
    ragged_dot whose contracting rows are ragged, which libtpu counts, and XLA:CPU
    computes, over every group: G / 2 times the FLOPs of the whole backward at 128
    experts). `bytes_per_flop`: a plan's counting program stands in for a platform's
    kernel of that gradient moving at most this many HBM bytes per FLOP (megablox's
    tgmm: `tpu.grouped_matmul`); its loop is counted at that ratio (`loops.scan`)."""
    return _grouped_matmul(x, w, group_sizes, loops.mode(), bytes_per_flop)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(x, w, group_sizes, mode, bytes_per_flop):
    return _ragged_dot(x, w, group_sizes)


def _ragged_dot(x, w, group_sizes):
    return jax.lax.ragged_dot(
        x, w.astype(x.dtype), group_sizes.astype(jnp.int32), precision=precision(x, w)
    )


def _grouped_matmul_fwd(x, w, group_sizes, mode, bytes_per_flop):
    return _ragged_dot(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_bwd(mode, bytes_per_flop, res, dy):
    x, w, group_sizes = res
    dx = _ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes)
    dw = grouped_weight_grad(x, dy, group_sizes, mode=mode, bytes_per_flop=bytes_per_flop)
    # Under shard_map, a cotangent is summed over the mesh axes it varies over and its
    # primal does not (rows over the batch axes for dw, a split width for dx), as
    # autodiff's own transpose sums them.
    return sum_to(dx, x).astype(x.dtype), sum_to(dw, w).astype(w.dtype), None


def _varying(x: jax.Array) -> frozenset:
    """The mesh axes x varies over inside a shard_map (none outside one)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def sum_to(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom backward's cotangent of `primal`, summed over the mesh axes it varies
    over and `primal` does not (inside a shard_map that tracks varying axes; elsewhere
    unchanged)."""
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


# Blocks of grouped_weight_grad's batched matmul per iteration of its loop: the loop
# keeps one chunk's rows and [chunk, D, N] float32 products alive, not every block's.
WEIGHT_GRAD_CHUNK = 16


def grouped_weight_grad(
    x: jax.Array,
    dy: jax.Array,
    group_sizes: jax.Array,
    *,
    mode: loops.Mode | None = None,
    bytes_per_flop: float | None = None,
) -> jax.Array:
    """sum over group g's rows of x[r]^T dy[r], [G, D, N] float32 (x [M, D], dy [M, N]).

    Each group's rows are laid out from a block boundary (blocks of `tm` rows, every
    block one group's, zero rows between groups); a loop over chunks of blocks gathers
    each chunk's rows of x and dy, multiplies each block's x_b^T dy_b and adds it into
    its group's [D, N]: the gathered rows are one chunk's at a time. FLOPs: the rows
    plus at most G blocks of padding (tm is chosen so that is <= a quarter of M).
    Gathers and dynamic slices only: libtpu's SparseCore code generator overflowed its
    stack on this loop's scatters (compiling Qwen3-30B-A3B's train step for a v5p).
    `mode`, `bytes_per_flop`: the loop's (`loops.scan`)."""
    M, D = x.shape
    G, N = group_sizes.shape[0], dy.shape[1]
    tm = int(min(512, max(8, 2 ** int(np.floor(np.log2(max(M / (4 * G), 1)))))))
    c = WEIGHT_GRAD_CHUNK
    nb = -(-(-(-M // tm) + G) // c) * c  # the rows' blocks and a partial one per group
    src, block_group = _group_blocks(group_sizes, M, tm, nb)
    prec = precision(x, dy)

    def rows(a, src_c, zero_pads):
        # A padding row (src M; clipped, the last row) must add nothing to its block's
        # product: zeroing it in the narrower of x and dy does that at the fewest
        # selects (a row that is not finite makes the step's gradients so anyway).
        out = jnp.take(a, src_c, axis=0, mode="clip")
        if zero_pads:
            out = jnp.where((src_c < M)[:, None], out, jnp.zeros((), a.dtype))
        return out.reshape(c, tm, -1)

    def chunk(dw, a):
        src_c, gc = a
        prod = jnp.einsum(
            "bmd,bmn->bdn",
            rows(x, src_c, D < N),
            rows(dy, src_c, D >= N),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        for i in range(c):
            cur = jax.lax.dynamic_index_in_dim(dw, gc[i], 0, keepdims=False)
            dw = jax.lax.dynamic_update_index_in_dim(dw, cur + prod[i], gc[i], 0)
        return dw, None

    chunks = (src.reshape(nb // c, c * tm), block_group.reshape(nb // c, c))
    # Under shard_map the carry must vary over the mesh axes the blocks vary over: a
    # select of zero against an element of each (its value never read) gives it theirs.
    zero = jnp.where(True, 0.0, (x[0, 0] + dy[0, 0] + block_group[0]).astype(jnp.float32))
    init = jnp.zeros((G, D, N), jnp.float32) + zero
    dw, _ = loops.scan(
        chunk, init, chunks, name="grouped_weight_grad", mode=mode, bytes_per_flop=bytes_per_flop
    )
    return dw


def _group_blocks(group_sizes: jax.Array, M: int, tm: int, nb: int):
    """`nb` blocks of `tm` rows, each group's rows from a block boundary: each slot's
    source row ([nb tm]; M, past the rows, where a block's group has no more) and each
    block's group ([nb]; the empty blocks at the end: the last group's, all padding)."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // tm) * tm
    pends = jnp.cumsum(padded)
    slot = jnp.arange(nb * tm)
    group = jnp.minimum(jnp.searchsorted(pends, slot, side="right"), G - 1)
    offset = slot - (pends - padded)[group]
    return jnp.where(offset < sizes[group], starts[group] + offset, M), group[::tm]


def together(fn, *args):
    """`fn(*args)`, every output computed before any is read (the reference: a plain
    call; where elementwise work fuses into reductions, as on accelerators, XLA's
    scheduler has no reason to defer one output of the LM head past the backward)."""
    return fn(*args)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum` of two operands accumulated in float32 (float32 result), in the
    operands' own dtype (accelerators multiply half precision and accumulate in float32)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=precision(a, b))


def normed_logits(
    hidden_btd: jax.Array,
    norm_w: jax.Array,
    head_vd: jax.Array,
    *,
    eps: float,
    dtype,
    einsum=einsum_f32,
) -> jax.Array:
    """The LM head: RMSNorm in `dtype`, then [B, T, D] x [V, D] -> float32 [B, T, V]."""
    h = rms_norm(hidden_btd, norm_w, eps, dtype=dtype)
    return einsum("btd,vd->btv", h, head_vd.astype(h.dtype)).astype(jnp.float32)


def attention(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask_bts: jax.Array,
    *,
    scale: float,
    einsum=einsum_f32,
) -> jax.Array:
    """Grouped-query attention; keys/values [B, K, S, hd]; scores and softmax in float32.

    mask_bts: [B or 1, T, S] bool, True where a query sees a key. Returns [B, T, H, hd].
    `einsum`: the float32-accumulating contraction (a platform's `einsum_f32`)."""
    B, T, H, hd = q_bthk.shape
    K = k_bksh.shape[1]
    q = q_bthk.reshape(B, T, K, H // K, hd)
    scores = einsum("btkrh,bksh->bkrts", q, k_bksh)
    scores = jnp.where(mask_bts[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksh.dtype)
    out = einsum("bkrts,bksh->btkrh", probs, v_bksh)
    return out.reshape(B, T, H, hd).astype(q_bthk.dtype)


# Keys of one cache block, in bytes: big caches are read block by block, and only
# the blocks written so far (`attention_cached`); small ones in one piece.
CACHE_BLOCK_BYTES = 2 << 20


def cache_block_size(batch: int, kv_heads: int, slots: int, head_dim: int, itemsize: int) -> int:
    """Slots per cache block: halve S while a block of keys exceeds CACHE_BLOCK_BYTES."""
    per_slot = batch * kv_heads * head_dim * itemsize
    block = slots
    while block % 2 == 0 and block // 2 >= 16 and block * per_slot > CACHE_BLOCK_BYTES:
        block //= 2
    return block


def online_softmax(num_blocks, block_fn, pv_spec: str, out_shape, *, einsum=einsum_f32):
    """softmax(scores) @ values over blocks 0 .. num_blocks - 1 (a traced count), one
    block at a time: flash attention's online softmax, equal to the one-pass
    softmax up to float32 rounding. float32 `out_shape` [..., hd].

    block_fn(j) -> (scores [..., blk] of block j, masked and scaled, float32; its
    values), contracted by the einsum `pv_spec` into out_shape. A block a row
    sees none of (all MASK_VALUE) adds weights of 1 there; a later visible score
    lies far above, so the rescale exp(MASK_VALUE - m) removes them exactly
    (every row must see at least one key).
    """

    def body(j, carry):
        return _online_step(*carry, *block_fn(j), pv_spec, einsum)

    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, _online_init(out_shape))
    return acc / l[..., None]


def _online_init(out_shape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax's running (max, sum, output) before any block, float32."""
    lead = tuple(out_shape[:-1])
    return (
        jnp.full(lead, -jnp.inf, jnp.float32),
        jnp.zeros(lead, jnp.float32),
        jnp.zeros(tuple(out_shape), jnp.float32),
    )


def _online_step(m, l, acc, s, vb, pv_spec: str, einsum):
    """The running (max m, sum l, output acc) after one more block of scores s and its
    values vb (contracted by `pv_spec`)."""
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = einsum(pv_spec, p.astype(vb.dtype), vb)
    return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv


def attention_cached(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask_bts: jax.Array,
    *,
    scale: float,
    filled: jax.Array,
    einsum=einsum_f32,
) -> jax.Array:
    """`attention` of T new queries over a cache whose first `filled` (dynamic) slots
    are written; keys/values [B, K, S, hd], the whole cache.

    Small caches are read in one piece. Big ones (a block of keys over
    CACHE_BLOCK_BYTES) are read by flash-decoding: an online softmax over blocks,
    only the blocks written so far, so a decode step reads the part of the cache
    in use instead of all of it (decode is bound by reading the cache once batches
    are large). Equal to `attention` up to float32 rounding. Inference only: the
    block loop has a dynamic trip count.
    """
    B, T, H, hd = q_bthk.shape
    _, K, S, _ = k_bksh.shape
    block = cache_block_size(B, K, S, hd, k_bksh.dtype.itemsize)
    if block >= S:
        return attention(q_bthk, k_bksh, v_bksh, mask_bts, scale=scale, einsum=einsum)
    R = H // K
    q = q_bthk.reshape(B, T, K, R, hd)

    def block_fn(j):
        kb = jax.lax.dynamic_slice_in_dim(k_bksh, j * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v_bksh, j * block, block, axis=2)
        mb = jax.lax.dynamic_slice_in_dim(mask_bts, j * block, block, axis=2)
        s = einsum("btkrh,bksh->bkrts", q, kb)
        return jnp.where(mb[:, None, None], s * scale, MASK_VALUE), vb

    n_blocks = (filled + block - 1) // block
    att = online_softmax(n_blocks, block_fn, "bkrts,bksh->bkrth", (B, K, R, T, hd), einsum=einsum)
    out = att.transpose(0, 3, 1, 2, 4)  # [B, T, K, R, hd]
    return out.reshape(B, T, H, hd).astype(q_bthk.dtype)


# ---- the one-token decode step ---------------------------------------------------------

# Page tables of more positions than this are read in blocks of pages
# (decode_cache_blocks), up to the furthest row's block. Up to here one pass over the
# whole table beats the block loop.
DECODE_BLOCK_MIN_SLOTS = 128
# About this many blocks per cache: the loop costs a few small kernels per block
# and a step over-reads half a block on average. Blocks of 16 to 512 slots.
DECODE_BLOCKS = 8
DECODE_BLOCK_MAX_SLOTS = 512


# Where XLA's paged reference reads a long table in blocks. On CPU a step is bound by
# reading the cache, and a loop iteration costs a few small kernels. On an
# accelerator every block of every layer adds kernel launches, against a whole
# table read at HBM bandwidth; not measured there yet, so it keeps one pass.
DECODE_BLOCK_PLATFORMS = ("cpu",)


def decode_cache_blocks(slots: int, platform: str = "cpu") -> tuple[int, int]:
    """(slots to allocate, slots per block) for `slots` positions of a row's cache, of
    which XLA's paged reference reads the blocks (`Decode.read_pages`).

    Up to DECODE_BLOCK_MIN_SLOTS, or on a platform not in DECODE_BLOCK_PLATFORMS:
    (slots, slots), one piece. Above: blocks of
    ~slots / DECODE_BLOCKS (a multiple of 16, at most DECODE_BLOCK_MAX_SLOTS),
    and the slots rounded up to whole blocks. Bench model, 64 rows, one CPU
    device, ms per decode step over a contiguous cache read whole against in
    blocks: 10.1-10.3 against 7.1-7.4 at 264 slots (blocks of 48), 25-27.5 against
    15.9 at 1032 (blocks of 144); 6.5 at 72 (one piece). A function of the slot
    count alone, so a row's numbers do not depend on how many rows share its batch.
    """
    if slots <= DECODE_BLOCK_MIN_SLOTS or platform not in DECODE_BLOCK_PLATFORMS:
        return slots, slots
    per_block = -(-slots // DECODE_BLOCKS)  # ceil
    block = min(DECODE_BLOCK_MAX_SLOTS, -(-per_block // 16) * 16)
    return -(-slots // block) * block, block


def _at(stack: jax.Array, layer) -> jax.Array:
    """Layer `layer`'s slice of a stack [L, ...] (a copy per layer and step on CPU;
    accelerators read it in place)."""
    return jax.lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False)


class Decode:
    """The ops of the one-token decode step (`rl_jax.models.decode`) in XLA: the
    reference, used on every platform that registers no decode kernels of its own.

    Weights are the model's decode layout, stacked [L, ...] (q/k/v, and gate/up, each
    concatenated into one matrix), indexed inside the scan over layers. The cache is
    the engine's paged one (`PagedKV`): a step writes each live row's key and value
    into its page and reads the row's table, every page at once, or on platforms of
    DECODE_BLOCK_PLATFORMS past DECODE_BLOCK_MIN_SLOTS positions in blocks of pages up
    to the furthest row's, with an online softmax over them (flash-decoding).

    A platform's implementation (`rl_jax.kernels.cpu.Decode`) overrides the methods
    it runs in its own kernels and names them in `platform_ops`.
    """

    platform_ops: tuple[str, ...] = ()  # ops in the platform's own kernels: none here
    # A paged cache's positions per page where the engine is not told, and the multiple
    # its pages must be of (a platform's layout may tile them).
    page_size: int = 16
    page_multiple: int = 1

    def __init__(self, platform: str, *, einsum=einsum_f32):
        self.platform = platform
        self.einsum = einsum

    # ---- weights and projections ----------------------------------------------------

    def prepare(self, layers: dict, final_norm: jax.Array, head_vd: jax.Array):
        """(layers, head) in the layout the ops below read, once per decode call
        outside the token loop. Here: as given."""
        return layers, head_vd

    def prepare_mlp(self, mlp: dict) -> dict:
        """One kind's MLP weights stacked over its layers ("mlp_norm" and "gate_up",
        "down", or a mixture of experts'), in the layout the ops below read, as
        `prepare`. Here: as given."""
        return mlp

    def grouped_matmul(self, x, w, group_sizes) -> jax.Array:
        """A mixture of experts' matmul over rows sorted by expert (`grouped_matmul`)."""
        return grouped_matmul(x, w, group_sizes)

    def embed(self, table_vd: jax.Array, tokens_b: jax.Array, dtype) -> jax.Array:
        """The rows of `tokens_b` [B], [B, D] in `dtype`."""
        return jnp.take(table_vd, tokens_b, axis=0).astype(dtype)

    def normed_dense(self, x, norm, w, layer, *, eps: float, cols: int) -> jax.Array:
        """rms_norm(x, norm[layer]) @ w[layer]: x [B, D], norm [L, D], w [L, D, N] (as
        `prepare` lays it out; `cols`: N, which a packed layout pads)."""
        return matmul(rms_norm(x, _at(norm, layer), eps), _at(w, layer))

    def swiglu(self, x, norm, w, layer, *, eps: float, cols: int) -> jax.Array:
        """SwiGLU's activation silu(h @ gate) * (h @ up) of h = rms_norm(x, norm[layer]),
        gate and up side by side in w [L, D, 2F]: [B, F] (cols = F)."""
        g, u = jnp.split(self.normed_dense(x, norm, w, layer, eps=eps, cols=2 * cols), 2, axis=1)
        return jax.nn.silu(g) * u

    def residual_dense(self, r, x, w, layer, bias=None) -> jax.Array:
        """r + (x @ w[layer] + bias): an o or down projection with its residual."""
        a = matmul(x, _at(w, layer))
        return r + (a if bias is None else a + bias)

    def logits(self, x, norm, head, *, eps: float, dtype, cols: int) -> jax.Array:
        """The LM head on x [B, D] (`normed_logits`, the norm in `dtype`): float32 [B, V]
        (cols = V)."""
        out = normed_logits(x[:, None, :], norm, head, eps=eps, dtype=dtype, einsum=self.einsum)
        return out[:, 0]

    # ---- the paged cache (`PagedKV`, the engine's) ------------------------------------

    @staticmethod
    def split_heads(qkv, rope, num_heads, cache: PagedKV, layer, qk_norm, eps):
        """One layer's step from the projection's rows qkv [B, (H + 2K) hd] (query heads,
        key heads, value heads): q [B, K, R, hd], k [B, 1, K, hd] and v [B, K, 1, hd],
        q and k through `norm_rope_qk` with `layer`'s qk_norm weights (of [L, hd]) and
        rope (cos, sin [B, 1, hd / 2])."""
        B = qkv.shape[0]
        H, K, hd = num_heads, cache.values.shape[0], cache.values.shape[-1]
        q = qkv[:, : H * hd].reshape(B, 1, H, hd)
        k = qkv[:, H * hd : (H + K) * hd].reshape(B, 1, K, hd)
        v = qkv[:, (H + K) * hd :].reshape(B, K, 1, hd)
        norms = None if qk_norm is None else tuple(_at(w, layer) for w in qk_norm)
        q, k = norm_rope_qk(q, k, rope, norms, eps)
        return q.reshape(B, K, H // K, hd), k, v

    def paged_shapes(
        self, *, kv_heads, layers, pages, page, head_dim, dtype, quantized=False
    ) -> PagedKV:
        """The shapes of a paged cache of `pages` pages of `page` positions (abstract):
        keys and values in `dtype`, or int8 with scales (`quantized`)."""
        shape = (kv_heads, layers, pages, page, head_dim)
        if not quantized:
            return PagedKV(*(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _ in range(2)))
        int8 = jax.ShapeDtypeStruct(shape, jnp.int8)
        return PagedKV(int8, int8, jax.ShapeDtypeStruct((*shape[:4], 2), jnp.float32))

    def page_keys(self, keys: jax.Array, cache: PagedKV) -> jax.Array:
        """Keys [..., P, hd] of whole pages in the layout of `cache`'s keys."""
        return keys

    def paged_axes(self, cache: PagedKV) -> PagedKV:
        """Logical axes of a paged cache's keys, values (and scales)."""
        scales = None if cache.scales is None else PAGED_LOGICAL_AXES[:4] + (None,)
        return PagedKV(PAGED_LOGICAL_AXES, PAGED_LOGICAL_AXES, scales)

    def paged_attention(
        self,
        qkv: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        cache: PagedKV,
        pages: Pages,
        pos_b: jax.Array,
        *,
        layer,
        num_heads: int,
        qk_norm: tuple[jax.Array, jax.Array] | None = None,
        eps: float = 0.0,
    ) -> tuple[jax.Array, PagedKV]:
        """One layer's attention of one new token per row (`split_heads`): row b's key and
        value written at its position pos_b[b] (where pages.live[b]), then its query over
        its positions 0 .. pos_b[b], the pages of its table that hold them. Returns
        (attention [B, K, R, hd] or [B, H hd], float32; the cache)."""
        q, k, v = self.split_heads(qkv, rope, num_heads, cache, layer, qk_norm, eps)
        B, K, R, hd = q.shape
        dtype = qkv.dtype

        def local(q, k, v, cache, table, live, pos, layer):
            cache = self.write_page(cache, k, v, table, live, pos, layer)
            return self.read_pages(q, cache, table, pos, layer, dtype, live), cache

        k, v = k.reshape(B, K, hd), v.reshape(B, K, hd)
        args = (q, k, v, cache, pages.table, pages.live, pos_b, layer)
        if pages.layout is None:
            return local(*args)
        q_spec, row, cache_spec = _paged_specs(pages.layout, cache)
        kv_spec = jax.sharding.PartitionSpec(pages.layout.rows, pages.layout.heads, None)
        in_specs = (q_spec, kv_spec, kv_spec, cache_spec, row(2), row(1), row(1))
        fn = per_device(
            local, pages.layout, (*in_specs, jax.sharding.PartitionSpec()), (q_spec, cache_spec)
        )
        return fn(*args)

    def write_page(self, cache: PagedKV, k_bkh, v_bkh, table, live, pos, layer) -> PagedKV:
        """Row b's key and value [B, K, hd] at its position pos[b] of `layer`, where
        live[b] (the page: table[b, pos[b] // P]; other rows write nothing).

        One scatter of B x K vectors into the cache seen as rows [K L N P, hd]: libtpu
        keeps the cache's layout for it. Scattering [K, B, hd] windows instead made it
        lay the cache out token-major inside the decode loop and copy the whole cache
        to and from the kernel's layout at every layer (qwen3-0.6b, 32 slots on
        v5e:2x2: 14.7 GB accessed per step against 2.3 GB)."""
        K, L, N, P = cache.values.shape[:4]
        page = jnp.take_along_axis(table, (pos // P)[:, None], axis=1, mode="clip")[:, 0]
        at = ((jnp.arange(K)[None, :] * L + layer) * N + page[:, None]) * P + (pos % P)[:, None]
        at = jnp.where(live[:, None], at, K * L * N * P).reshape(-1)  # [B K]; past the end: dropped

        def put(dst, x):  # x [B, K, d] at rows `at` of dst [K, L, N, P, d]
            flat = dst.reshape(-1, dst.shape[-1])
            flat = flat.at[at].set(x.reshape(at.shape[0], -1).astype(dst.dtype), mode="drop")
            return flat.reshape(dst.shape)

        return _put_kv(cache, put, k_bkh, v_bkh)

    def pages_read(self, filled: int, width: int, *, dtype, head_dim: int) -> int:
        """Pages of a `width`-page table a decode step reads for a row that has filled
        `filled` of them, from a cache of `dtype` and `head_dim`: here the whole table
        (blocks on DECODE_BLOCK_PLATFORMS are read up to the batch's furthest row, which a
        single row's count cannot know)."""
        return width

    def read_pages(self, q, cache: PagedKV, table, pos, layer, dtype, live=None) -> jax.Array:
        """q [B, K, R, hd] over positions 0 .. pos[b] of each row's pages of `layer`:
        [B, K, R, hd] float32 (rows not `live` [B]: anything finite, a kernel may skip
        them). Long tables on platforms of DECODE_BLOCK_PLATFORMS are read in blocks of
        pages, up to the furthest row's (an online softmax); else every page of the
        table at once. int8 pages are scaled back to `dtype`
        as they are read."""
        B, K, R, hd = q.shape
        N, P = cache.values.shape[2], cache.values.shape[3]
        table = jnp.minimum(table, N - 1)  # past a row's pages: any page, masked
        n_pages = table.shape[1]
        _, blk = decode_cache_blocks(n_pages * P, self.platform)
        per = max(1, blk // P)
        if per >= n_pages:
            per = n_pages
        else:
            table = jnp.pad(table, ((0, 0), (0, -n_pages % per)))
        span = jnp.arange(per * P)

        def gather(pages, t, channel):  # [K, B, per * P, hd] in dtype
            x = pages[:, layer, t]
            if cache.scales is not None:
                x = dequantize_int8(x, cache.scales[..., channel][:, layer, t])
            return x.reshape(K, B, per * P, hd).astype(dtype)

        def block_fn(j):
            t = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)
            kb, vb = gather(cache.keys, t, 0), gather(cache.values, t, 1)
            visible = (j * per * P + span)[None, :] <= pos[:, None]
            s = self.einsum("bkrh,kbsh->bkrs", q, kb)
            return jnp.where(visible[:, None, None, :], s * hd**-0.5, MASK_VALUE), vb

        if per == n_pages:  # one pass, one softmax
            s, vb = block_fn(0)
            probs = jax.nn.softmax(s, axis=-1).astype(dtype)
            return self.einsum("bkrs,kbsh->bkrh", probs, vb)
        n_blocks = jnp.max(pos) // (per * P) + 1
        out_shape = (B, K, R, hd)
        return online_softmax(n_blocks, block_fn, "bkrs,kbsh->bkrh", out_shape, einsum=self.einsum)

    def write_prompt(self, cache: PagedKV, k, v, table, take, *, layout=None) -> PagedKV:
        """Rows' prompt keys and values k, v [L, B, K, W, hd] (positions 0 .. W - 1, W a
        multiple of the page size, at most the table's pages) into the first W / P pages
        of their tables, where take [B]; other rows write nothing. Positions past a
        row's prompt carry whatever k and v hold there: its decode steps write them
        before they are read."""

        def local(cache, k, v, table, take):
            L, B, K, W, hd = k.shape
            N, P = cache.values.shape[2], cache.values.shape[3]
            n = W // P
            pg = jnp.where(take[:, None], table[:, :n], N)  # [B, n]
            # Page (h, l, pg) of the cache, indexed in place; pg past the end: dropped.
            # Not a scatter into a flat view of the cache: XLA:CPU gave the view's
            # reshape back a layout of its own where a dimension has size 1 (keys in
            # tiles of a page, kernels/cpu.py) and copied the whole cache twice per
            # call (bench model, 64 slots: 20 ms against 2). libtpu compiles both forms
            # to the same bytes (`rl-jax plan`, v5e:2x2).
            idx = (
                jnp.arange(K)[:, None, None, None],
                jnp.arange(L)[None, :, None, None],
                pg[None, None],
            )

            def pages(x):  # [L, B, K, W, hd] -> [K, L, B, n, P, hd]
                return x.reshape(L, B, K, n, P, hd).transpose(2, 0, 1, 3, 4, 5)

            def put(dst, x):  # x [K, L, B, n, P, ...]: one scatter of whole pages
                return dst.at[idx].set(x.astype(dst.dtype), mode="drop")

            return _put_kv(cache, put, pages(k), pages(v), lambda k: self.page_keys(k, cache))

        if layout is None:
            return local(cache, k, v, table, take)
        _, row, spec = _paged_specs(layout, cache)
        rows_kv = jax.sharding.PartitionSpec(None, layout.rows, layout.heads, None, None)
        fn = per_device(local, layout, (spec, rows_kv, rows_kv, row(2), row(1)), spec)
        return fn(cache, k, v, table, take)


# ---- the paged decode cache (the continuous-batching engine's) ---------------------------


class PagedKV(NamedTuple):
    """A paged KV cache: N pages of P positions per layer and kv head, which rows own
    through their page tables (`Pages`). Keys and values [K, L, N, P, hd] (a platform
    may keep its keys in a layout of its own: `rl_jax.kernels.cpu`, in tiles). Pages
    are split over the mesh's batch shards like the rows that own them: a device's
    rows own pages of that device only.

    Quantized (`scales` given): keys and values int8, each position's key and value of
    each kv head scaled by its own float32 scale, scales [K, L, N, P, 2] (the key's,
    the value's): max |x| / 127 over the head's hd values (`quantize_int8`)."""

    keys: jax.Array
    values: jax.Array
    scales: jax.Array | None = None


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., hd] as int8 [..., hd] and a float32 scale [...] per vector: round(x / s)
    with s = max |x| / 127 (0 for a zero vector)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def _put_kv(cache: PagedKV, put, k, v, keys=lambda k: k) -> PagedKV:
    """`cache` with k and v written by `put(dst, x)` (keys in the layout `keys` gives), or
    int8 with their scales where the cache is quantized."""
    if cache.scales is None:
        return PagedKV(put(cache.keys, keys(k)), put(cache.values, v))
    (qk, sk), (qv, sv) = quantize_int8(k), quantize_int8(v)
    scales = put(cache.scales, jnp.stack([sk, sv], axis=-1))
    return PagedKV(put(cache.keys, qk), put(cache.values, qv), scales)


def dequantize_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    """`quantize_int8`'s inverse (to its rounding): float32 q * scale."""
    return q.astype(jnp.float32) * scale[..., None]


PAGED_LOGICAL_AXES = ("kv_heads", "layers", "batch", None, "head_dim")


class PagedLayout(NamedTuple):
    """How a paged attention runs per device under `jax.shard_map`: the mesh, the mesh
    axes of the rows (and of the pages: a row's pages are on its device) and of the kv
    heads (None: not split)."""

    mesh: jax.sharding.Mesh
    rows: tuple | str | None
    heads: tuple | str | None


class Pages(NamedTuple):
    """Where each row's keys and values are in a `PagedKV`: table [B, R] int32, row b's
    position p at page table[b, p // P], offset p % P (page ids of the row's device;
    N, no page, past the row's own); live [B] bool, the rows whose key and value a step
    writes (a row that ended writes nothing: its pages may be another row's by then).
    layout: run per device (`PagedLayout`), or None (one device, or already inside a
    shard_map)."""

    table: jax.Array
    live: jax.Array
    layout: PagedLayout | None = None


def pages_needed(prompt_len: int, new_tokens: int, page: int) -> int:
    """Pages a row of `prompt_len` prompt tokens and at most `new_tokens` completion
    tokens writes: positions 0 .. prompt_len + new_tokens - 2 (the last token sampled
    is never fed back)."""
    return max(1, -(-(prompt_len + new_tokens - 1) // page))


def per_device(fn, layout: PagedLayout | AttentionLayout | None, in_specs, out_specs):
    """`fn` under `jax.shard_map` over `layout`'s mesh, or as is: without a layout, on one
    device, or inside a shard_map already (the arrays are this device's)."""
    if layout is None or layout.mesh.size == 1:
        return fn
    if jax.sharding.get_abstract_mesh().manual_axes:
        return fn
    return jax.shard_map(
        fn, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def _paged_specs(layout: PagedLayout, cache: PagedKV):
    """PartitionSpecs per device of q [B, K, R, hd], of a row array [B, ...] (by its
    ndim) and of `cache`'s arrays [K, L, N, ...]: kv heads, pages (with their rows)."""
    P = jax.sharding.PartitionSpec

    def paged(x):
        return None if x is None else P(layout.heads, None, layout.rows, *(None,) * (x.ndim - 3))

    return (
        P(layout.rows, layout.heads, None, None),
        lambda ndim: P(layout.rows, *(None,) * (ndim - 1)),
        PagedKV(*map(paged, cache)),
    )


def decode_ops(platform: str, **conditions) -> Decode:
    """The decode step's ops on `platform` (`Decode`, whatever the conditions)."""
    return Decode(platform)


class AttentionMask(NamedTuple):
    """Which keys each query sees, described instead of built as [B, T, S]: query t
    sits at key slot `offset + t` and sees key slot s when s <= offset + t,
    `kv_valid_bs[b, s]` (pads) and `q_segment_bt[b, t] == kv_segment_bs[b, s]`
    (packed rows). `block` builds any [B or 1, T, n] slice of it on demand."""

    offset: int = 0
    kv_valid_bs: jax.Array | None = None
    q_segment_bt: jax.Array | None = None
    kv_segment_bs: jax.Array | None = None

    def block(
        self, T: int, start: jax.Array | int, size: int, q_start: jax.Array | int = 0
    ) -> jax.Array:
        """Visibility of key slots start .. start + size - 1 to queries q_start ..
        q_start + T - 1: [B or 1, T, size] (slots at or past the keys' end: read
        clamped, callers drop them)."""
        k_slot = start + jnp.arange(size)
        q_slot = self.offset + q_start + jnp.arange(T)
        mask = (k_slot[None, :] <= q_slot[:, None])[None]
        if self.kv_valid_bs is not None:
            valid = jax.lax.dynamic_slice_in_dim(self.kv_valid_bs, start, size, axis=1)
            mask = mask & valid[:, None, :].astype(bool)
        if self.q_segment_bt is not None:
            seg = jax.lax.dynamic_slice_in_dim(self.kv_segment_bs, start, size, axis=1)
            q_seg = jax.lax.dynamic_slice_in_dim(self.q_segment_bt, q_start, T, axis=1)
            mask = mask & (q_seg[:, :, None] == seg[:, None, :])
        return mask

    def padded(self, pad: int, q_pad: int = 0) -> AttentionMask:
        """The same mask over keys padded with `pad` slots at the end (never visible)
        and queries padded with `q_pad` (dropped by the caller)."""

        def grow(a, n):
            return None if a is None or n == 0 else jnp.pad(a, ((0, 0), (0, n)))

        return self._replace(
            kv_valid_bs=grow(self.kv_valid_bs, pad) if pad else self.kv_valid_bs,
            kv_segment_bs=grow(self.kv_segment_bs, pad) if pad else self.kv_segment_bs,
            q_segment_bt=grow(self.q_segment_bt, q_pad) if q_pad else self.q_segment_bt,
        )


def causal_pairs(
    T: int, S: int, offset: int, block: int, kv_block: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The (query block i, key block j) pairs causality lets see each other, the ones
    `flash_attention` computes: query block i (queries i * block ..) sees key blocks
    0 .. j_i, the block of its last query's slot offset + t; S keys in blocks of
    `kv_block` (default `block`; S a multiple of it). (i [n], j [n]) int32, each query
    block's pairs in key order."""
    kb = kv_block or block
    nq, nk = -(-T // block), S // kb
    pairs = [
        (i, j)
        for i in range(nq)
        for j in range(min(nk, (offset + min((i + 1) * block, T) - 1) // kb + 1))
    ]
    i, j = np.asarray(pairs, np.int32).T
    return i, j


class AttentionLayout(NamedTuple):
    """Where `flash_attention`'s operands live: the mesh and the PartitionSpecs of q
    [B, T, H, hd] and of k / v [B, K, S, hd] (the model's, from its sharding rules).
    XLA partitions its own attention and ignores it; a kernel XLA cannot partition
    (Pallas, `rl_jax.kernels.tpu`) runs per device under `jax.shard_map` with it."""

    mesh: jax.sharding.Mesh
    q: jax.sharding.PartitionSpec
    kv: jax.sharding.PartitionSpec


def flash_attention(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask: AttentionMask,
    *,
    scale: float,
    block: int = 512,
    einsum=einsum_f32,
    layout: AttentionLayout | None = None,
    bytes_per_flop: float | None = None,
) -> jax.Array:
    """`attention` with the mask described (`AttentionMask`), queries and keys taken
    `block` slots at a time: an online softmax forward (flash attention) and a backward
    that recomputes each block's probabilities from the saved softmax statistics.
    Only the (query block, key block) pairs on or below the causal diagonal are
    computed (`causal_pairs`), one pair per step of a `loops.scan`: about half of
    T x S, as the model's causal count, and neither pass keeps more than a
    [B, H, block, block] block of scores alive. Equal to `attention` with `mask`'s
    dense form up to float32 rounding, also for rows that see no key (a uniform
    average of all S values, as there). `layout`: unused (XLA partitions this itself).
    `bytes_per_flop`: a plan's counting program stands in for a fused kernel moving
    this many HBM bytes per FLOP (`loops.scan`). [B, T, H, hd]."""
    del layout
    B, T, H, hd = q_bthk.shape
    K, S = k_bksh.shape[1], k_bksh.shape[2]
    block = min(block, S)
    pad, q_pad = -S % block, -T % block
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (k_bksh, v_bksh))
    q = jnp.pad(q_bthk, ((0, 0), (0, q_pad), (0, 0), (0, 0))).reshape(B, T + q_pad, K, H // K, hd)
    m = mask.padded(pad, q_pad)
    arrays = (m.kv_valid_bs, m.q_segment_bt, m.kv_segment_bs)
    args = (int(m.offset), T, S, scale, block, einsum, loops.mode(), bytes_per_flop)
    out = _flash(q, k, v, arrays, *args)
    return out[:, :T].reshape(B, T, H, hd).astype(q_bthk.dtype)


def _flash_pair(q, k, v, arrays, offset, S, scale, block, einsum, i, j):
    """Pair (query block i, key block j): the queries [B, bq, K, R, hd], keys and values
    [B, K, bk, hd], the scaled and masked scores [B, K, R, bq, bk] (MASK_VALUE where
    hidden, -inf at padding slots past S) and visibility [B or 1, 1, 1, bq, bk]."""
    qb = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
    kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=2)
    vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2)
    mask = AttentionMask(offset, *arrays)
    seen = mask.block(block, j * block, block, q_start=i * block)[:, None, None]
    s = einsum("btkrh,bksh->bkrts", qb, kb)
    s = jnp.where(seen, s * scale, MASK_VALUE)
    # Padding slots take no weight at all (a masked real slot takes MASK_VALUE's, as
    # in `attention`); every block holds a real slot, so the running max is finite.
    s = jnp.where(j * block + jnp.arange(block) < S, s, -jnp.inf)
    return qb, kb, vb, s, seen


def _rows(a, i, block):
    """Query block i of a [B, K, R, Tq, ...] statistic."""
    return jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=3)


def _set_rows(a, x, i, block):
    return jax.lax.dynamic_update_slice_in_dim(a, x, i * block, axis=3)


def _pair_scan(body, init, T, k, offset, block, mode, fused):
    """The carry after `body` over flash attention's (query block, key block) pairs
    (`causal_pairs`; k's padded slots), a `loops.scan` of `mode` (`fused`: its bytes
    per FLOP)."""
    pairs = tuple(jnp.asarray(a) for a in causal_pairs(T, k.shape[2], offset, block))
    carry, _ = loops.scan(
        body, init, pairs, name="flash_attention", mode=mode, bytes_per_flop=fused
    )
    return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11))
def _flash(q, k, v, arrays, offset, T, S, scale, block, einsum, mode, fused):
    return _flash_fwd(q, k, v, arrays, offset, T, S, scale, block, einsum, mode, fused)[0]


def _flash_fwd(q, k, v, arrays, offset, T, S, scale, block, einsum, mode, fused):
    B, Tq, K, R, hd = q.shape

    def body(carry, ij):
        m, l, acc = carry  # [B, K, R, Tq] (acc: x hd), set query block by query block
        i, j = ij
        _, _, vb, s, _ = _flash_pair(q, k, v, arrays, offset, S, scale, block, einsum, i, j)
        old = (_rows(a, i, block) for a in (m, l, acc))
        new = _online_step(*old, s, vb, "bkrts,bksh->bkrth", einsum)
        return tuple(_set_rows(a, x, i, block) for a, x in zip((m, l, acc), new, strict=True)), None

    init = _online_init((B, K, R, Tq, hd))
    m, l, acc = _pair_scan(body, init, T, k, offset, block, mode, fused)
    # A row that sees no key (m stays MASK_VALUE) averages all S values, as `attention`'s
    # uniform softmax does; the blocks causality skips would have been part of it.
    none = m <= MASK_VALUE
    mean_v = v[:, :, :S].astype(jnp.float32).mean(axis=2)[:, :, None, None, :]
    out = jnp.where(none[..., None], mean_v, acc / l[..., None])  # [B, K, R, Tq, hd]
    # m and l apart, not log-sum-exp m + log(l): for a row that sees no key, m is
    # MASK_VALUE, which absorbs log(l) in float32.
    return out.transpose(0, 3, 1, 2, 4), (q, k, v, arrays, out, m, l)


def _flash_bwd(offset, T, S, scale, block, einsum, mode, fused, res, d_out):
    q, k, v, arrays, out, m, l = res
    do_stat = d_out.astype(jnp.float32).transpose(0, 2, 3, 1, 4)  # [B, K, R, Tq, hd], as out
    # Row sums of dP * P, one per query: softmax's backward without P whole.
    delta = jnp.einsum("bkrth,bkrth->bkrt", do_stat, out, precision=precision(out))
    none = m <= MASK_VALUE
    do = d_out.astype(v.dtype)

    def body(carry, ij):
        dq, dk, dv = carry
        i, j = ij
        qb, kb, vb, s, seen = _flash_pair(q, k, v, arrays, offset, S, scale, block, einsum, i, j)
        m_i, l_i, delta_i, none_i = (_rows(a, i, block) for a in (m, l, delta, none))
        # Rows that see no key take nothing from here (their uniform average: below).
        p = jnp.where(none_i[..., None], 0.0, jnp.exp(s - m_i[..., None]) / l_i[..., None])
        dob = jax.lax.dynamic_slice_in_dim(do, i * block, block, axis=1)
        dv_j = einsum("bkrts,btkrh->bksh", p.astype(dob.dtype), dob)
        dp = einsum("btkrh,bksh->bkrts", dob, vb)
        ds = jnp.where(seen, p * (dp - delta_i[..., None]), 0.0) * scale
        dq_i = einsum("bkrts,bksh->btkrh", ds.astype(kb.dtype), kb)
        dk_j = einsum("bkrts,btkrh->bksh", ds.astype(qb.dtype), qb)

        def add(a, x, start, axis):
            old = jax.lax.dynamic_slice_in_dim(a, start, block, axis=axis)
            return jax.lax.dynamic_update_slice_in_dim(a, old + x, start, axis=axis)

        dq = add(dq, dq_i, i * block, 1)
        return (dq, add(dk, dk_j, j * block, 2), add(dv, dv_j, j * block, 2)), None

    init = tuple(jnp.zeros(a.shape, jnp.float32) for a in (q, k, v))
    dq, dk, dv = _pair_scan(body, init, T, k, offset, block, mode, fused)
    # Rows that see no key: out = the mean of the S values, so each value gets 1 / S of
    # their output gradient.
    d_mean = jnp.where(none[..., None], do_stat, 0.0).sum(axis=(2, 3)) / S  # [B, K, hd]
    dv = dv + jnp.where((jnp.arange(k.shape[2]) < S)[:, None], d_mean[:, :, None, :], 0.0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
