"""Pure math of the decoder: arrays in, arrays out.

Dimension letters: B batch, T query time, S key time (T without a cache, the
cache length with one), D width, F MLP width, H query heads, K kv heads,
R = H / K query heads per kv head, hd head width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.spec import ModelSpec, RopeScaling

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


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` at `precision(a, b)`."""
    return jnp.matmul(a, b, precision=precision(a, b))


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum` of two operands accumulated in float32 (float32 result).

    XLA:CPU's generic dot kernel has no bf16 x bf16 -> f32 (jax 0.10: "Unsupported
    element type for DotThunk::Execute"), which some attention layouts reach; on CPU,
    which has no bf16 matrix units to lose, half-precision operands are upcast first.
    Accelerators keep their operands' dtype and accumulate in float32.
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=precision(a, b))


def sum_leading(g: jax.Array, ndim: int) -> jax.Array:
    """g summed over all but its last `ndim` axes, accumulated in float32: the gradient
    of a parameter broadcast over the leading axes (a bias, a norm scale).

    A matmul with a ones vector, not a reduce: XLA:CPU's column reductions run at
    ~3 GB/s (its tree-reduction rewrite makes them strided 32x32 reduce-windows),
    1.3-1.5 ms for a [64, 63, 256] gradient, against 0.5-0.7 ms as a matrix-vector
    product (bench train step: a bias or norm gradient per projection and layer).
    Accelerators reduce well and keep the plain sum (on a TPU a matrix-vector
    product would take the matrix unit for a memory-bound pass).
    """
    lead = g.shape[: g.ndim - ndim]
    if jax.default_backend() != "cpu":
        return jnp.sum(g, axis=tuple(range(len(lead))), dtype=jnp.float32)
    rows = g.reshape(int(np.prod(lead, dtype=np.int64)), -1)
    ones = jnp.ones((rows.shape[0],), rows.dtype)
    return einsum_f32("n,nd->d", ones, rows).reshape(g.shape[g.ndim - ndim :])


@jax.custom_vjp
def add_bias(x: jax.Array, b: jax.Array) -> jax.Array:
    """x + b, b broadcast over x's leading axes (b.shape == x.shape[-b.ndim:]), in x's
    dtype; b's gradient by `sum_leading`."""
    return x + b.astype(x.dtype)


def _add_bias_fwd(x, b):
    return add_bias(x, b), b


def _add_bias_bwd(b, g):
    return g, sum_leading(g, b.ndim).astype(b.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, *, dtype=None) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32; output in `dtype` (default x's)."""
    dtype = x.dtype if dtype is None else dtype
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale_last(y.astype(dtype), w.astype(dtype))


@jax.custom_vjp
def scale_last(y: jax.Array, w: jax.Array) -> jax.Array:
    """y * w for w [D] over y's last axis (a norm's scale); w's gradient by `sum_leading`."""
    return y * w


def _scale_last_fwd(y, w):
    return y * w, (y, w)


def _scale_last_bwd(res, g):
    y, w = res
    return g * w, sum_leading(g * y, 1).astype(w.dtype)


scale_last.defvjp(_scale_last_fwd, _scale_last_bwd)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [hd / 2] in float32, as transformers computes them (Llama 3.1
    scaling included: long wavelengths divided by `factor`, a smooth ramp between)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv
    old = scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_table(spec: ModelSpec, num_positions: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotation angles of positions 0 .. num_positions - 1, [N, hd / 2]
    float32: for `rope_angles(..., table=)`."""
    inv = jnp.asarray(rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling))
    ang = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def rope_angles(
    positions_bt: jax.Array,
    spec: ModelSpec,
    *,
    table: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotation angles, [B, T, hd / 2] float32.

    table: `rope_table` of a bound on the positions (every one below it); cos and
    sin are then read from it (bit-identical values). Without one, XLA fuses the
    cos and sin into every consumer and evaluates them per element there: in
    each layer's q and k rotation, and again wherever the rotated keys are
    written (~0.3 ms of a 6 ms decode step on the bench workload). Build the
    table outside a loop: XLA does not hoist it. Out-of-range positions read
    the table's last row.
    """
    if table is None:
        inv = jnp.asarray(rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling))
        ang = positions_bt.astype(jnp.float32)[..., None] * inv
        return jnp.cos(ang), jnp.sin(ang)
    return tuple(jnp.take(t, positions_bt, axis=0, mode="clip") for t in table)


def apply_rope(x_bthk: jax.Array, cos_btk: jax.Array, sin_btk: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + hd/2) (the "rotate half" layout of HF checkpoints)."""
    x = x_bthk.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos_btk[:, :, None, :], sin_btk[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_bthk.dtype)


def attention_mask(
    T: int,
    S: int,
    *,
    cache_index: jax.Array | int | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_valid_bs: jax.Array | None = None,
) -> jax.Array:
    """Which keys each query may see: [B or 1, T, S] bool.

    Without a cache, query t sits in slot t and keys are the same T tokens.
    With a cache, query t sits in slot cache_index + t of an S-slot cache.
    Key slot s is visible when s <= the query's slot, `kv_valid[b, s]`
    (left padding, unwritten slots) and, for packed rows, the segment ids match.
    """
    offset = 0 if cache_index is None else cache_index
    q_slot = offset + jnp.arange(T)
    k_slot = jnp.arange(S)
    mask = (k_slot[None, :] <= q_slot[:, None])[None]  # [1, T, S]
    if segment_ids_bt is not None:
        if cache_index is not None:
            raise ValueError("segment_ids_bt (packed rows) is not supported with a KV cache")
        mask = mask & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    if kv_valid_bs is not None:
        if kv_valid_bs.shape[-1] != S:
            raise ValueError(
                f"kv_valid_bs has {kv_valid_bs.shape[-1]} slots but the keys have {S} "
                "(the cache length with a cache, T without)"
            )
        mask = mask & kv_valid_bs[:, None, :].astype(bool)
    return mask


def attention(
    q_bthk: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array, *, scale: float
) -> jax.Array:
    """Grouped-query attention; keys/values [B, K, S, hd]; scores and softmax in float32.

    Returns [B, T, H, hd]."""
    B, T, H, hd = q_bthk.shape
    K = k_bksh.shape[1]
    q = q_bthk.reshape(B, T, K, H // K, hd)
    scores = einsum_f32("btkrh,bksh->bkrts", q, k_bksh)
    scores = jnp.where(mask_bts[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksh.dtype)
    out = einsum_f32("bkrts,bksh->btkrh", probs, v_bksh)
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


def online_softmax(num_blocks, block_fn, pv_spec: str, out_shape) -> jax.Array:
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
        m, l, acc = carry
        s, vb = block_fn(j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = einsum_f32(pv_spec, p.astype(vb.dtype), vb)
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    lead = tuple(out_shape[:-1])
    init = (
        jnp.full(lead, -jnp.inf, jnp.float32),
        jnp.zeros(lead, jnp.float32),
        jnp.zeros(tuple(out_shape), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return acc / l[..., None]


def attention_cached(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask_bts: jax.Array,
    *,
    scale: float,
    filled: jax.Array,
    block: int,
) -> jax.Array:
    """`attention` over the first `filled` (dynamic) slots of a cache, `block` slots at a time.

    Flash-decoding: an online softmax over blocks, so a decode step reads the
    part of the cache in use instead of all of it (decode is bound by reading
    the cache once batches are large). Equal to `attention` up to float32
    rounding. Inference only: the loop has a dynamic trip count.
    """
    B, T, H, hd = q_bthk.shape
    K = k_bksh.shape[1]
    R = H // K
    q = q_bthk.reshape(B, T, K, R, hd)

    def block_fn(j):
        kb = jax.lax.dynamic_slice_in_dim(k_bksh, j * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v_bksh, j * block, block, axis=2)
        mb = jax.lax.dynamic_slice_in_dim(mask_bts, j * block, block, axis=2)
        s = einsum_f32("btkrh,bksh->bkrts", q, kb)
        return jnp.where(mb[:, None, None], s * scale, MASK_VALUE), vb

    n_blocks = (filled + block - 1) // block
    att = online_softmax(n_blocks, block_fn, "bkrts,bksh->bkrth", (B, K, R, T, hd))
    out = att.transpose(0, 3, 1, 2, 4)  # [B, T, K, R, hd]
    return out.reshape(B, T, H, hd).astype(q_bthk.dtype)


def logprobs_from_logits(
    logits_btv: jax.Array, targets_bt: jax.Array, temperature: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log p(target) and entropy of softmax(logits / temperature), float32 [B, T].

    The sampler's decode step and the trainer's `token_logprobs` both call this,
    so their log-probs agree to float32 rounding. `temperature` must be > 0.
    """
    z = logits_btv.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    p = jnp.exp(z - lse[..., None])
    entropy = lse - jnp.sum(p * z, axis=-1)
    return picked - lse, entropy
