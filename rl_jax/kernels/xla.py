"""The portable implementation of every kernel op: plain JAX, lowered by XLA on any
platform. It is the default everywhere and the reference every other implementation
is tested against.

Dimension letters: B batch, T query time, S key time, H query heads, K kv heads,
R = H / K query heads per kv head, hd head width, N rows of a matmul.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., D] times w [D, ...] -> [..., ...] as one 2-D matmul over all leading rows,
    in x's dtype.

    (A 3-D einsum makes XLA on CPU transpose activations for the weight gradient;
    the 2-D form lets the matmul read them in place.)"""
    lead, D = x.shape[:-1], x.shape[-1]
    out = matmul(x.reshape(-1, D), w.reshape(D, -1).astype(x.dtype))
    return out.reshape(*lead, *w.shape[1:])


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum` of two operands accumulated in float32 (float32 result), in the
    operands' own dtype (accelerators multiply half precision and accumulate in float32)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=precision(a, b))


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
        m, l, acc = carry
        s, vb = block_fn(j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = einsum(pv_spec, p.astype(vb.dtype), vb)
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


class AttentionMask(NamedTuple):
    """Which keys each query sees, described instead of built as [B, T, S]: query t
    sits at key slot `offset + t` and sees key slot s when s <= offset + t,
    `kv_valid_bs[b, s]` (pads) and `q_segment_bt[b, t] == kv_segment_bs[b, s]`
    (packed rows). `block` builds any [B or 1, T, n] slice of it on demand."""

    offset: int = 0
    kv_valid_bs: jax.Array | None = None
    q_segment_bt: jax.Array | None = None
    kv_segment_bs: jax.Array | None = None

    def block(self, T: int, start: jax.Array | int, size: int) -> jax.Array:
        """Visibility of key slots start .. start + size - 1 to the T queries: [B or 1, T, size]
        (slots at or past the keys' end: read clamped, callers drop them)."""
        k_slot = start + jnp.arange(size)
        mask = (k_slot[None, :] <= self.offset + jnp.arange(T)[:, None])[None]
        if self.kv_valid_bs is not None:
            valid = jax.lax.dynamic_slice_in_dim(self.kv_valid_bs, start, size, axis=1)
            mask = mask & valid[:, None, :].astype(bool)
        if self.q_segment_bt is not None:
            seg = jax.lax.dynamic_slice_in_dim(self.kv_segment_bs, start, size, axis=1)
            mask = mask & (self.q_segment_bt[:, :, None] == seg[:, None, :])
        return mask

    def padded(self, pad: int) -> AttentionMask:
        """The same mask over keys padded with `pad` slots at the end (never visible)."""
        if pad == 0:
            return self

        def grow(a):
            return None if a is None else jnp.pad(a, ((0, 0), (0, pad)))

        return self._replace(
            kv_valid_bs=grow(self.kv_valid_bs), kv_segment_bs=grow(self.kv_segment_bs)
        )


def flash_attention(
    q_bthk: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    mask: AttentionMask,
    *,
    scale: float,
    block: int = 512,
    einsum=einsum_f32,
) -> jax.Array:
    """`attention` with the mask described (`AttentionMask`) and keys read `block` slots
    at a time: an online softmax forward (flash attention) and a backward that
    recomputes each block's probabilities from the saved softmax statistics. Neither keeps
    more than [B, H, T, block] scores alive, instead of the [B, H, T, S] of `attention`.
    Equal to `attention` with `mask`'s dense form up to float32 rounding, also for
    rows that see no key (a uniform average, as there). [B, T, H, hd]."""
    B, T, H, hd = q_bthk.shape
    K, S = k_bksh.shape[1], k_bksh.shape[2]
    block = min(block, S)
    pad = -S % block
    k = jnp.pad(k_bksh, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v_bksh, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q = q_bthk.reshape(B, T, K, H // K, hd)
    out = _flash(q, k, v, tuple(mask.padded(pad)), S, scale, block, einsum)
    return out.reshape(B, T, H, hd).astype(q_bthk.dtype)


def _flash_scores(q, k, v, mask, j, S, scale, block, einsum):
    """Block j's keys and values [B, K, block, hd], its scaled and masked scores
    [B, K, R, T, block] (MASK_VALUE where hidden, -inf at padding slots past S) and
    its visibility [B or 1, 1, 1, T, block]."""
    start = j * block
    kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2)
    vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2)
    seen = AttentionMask(*mask).block(q.shape[1], start, block)[:, None, None]
    s = einsum("btkrh,bksh->bkrts", q, kb)
    s = jnp.where(seen, s * scale, MASK_VALUE)
    # Padding slots take no weight at all (a masked real slot takes MASK_VALUE's, as
    # in `attention`); every block holds a real slot, so the running max is finite.
    s = jnp.where(start + jnp.arange(block) < S, s, -jnp.inf)
    return kb, vb, s, seen


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, mask, S, scale, block, einsum):
    return _flash_fwd(q, k, v, mask, S, scale, block, einsum)[0]


def _flash_fwd(q, k, v, mask, S, scale, block, einsum):
    B, T, K, R, hd = q.shape

    def body(carry, j):
        m, l, acc = carry
        _, vb, s, _ = _flash_scores(q, k, v, mask, j, S, scale, block, einsum)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = einsum("bkrts,bksh->bkrth", p.astype(vb.dtype), vb)
        return (m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv), None

    init = (
        jnp.full((B, K, R, T), -jnp.inf, jnp.float32),
        jnp.zeros((B, K, R, T), jnp.float32),
        jnp.zeros((B, K, R, T, hd), jnp.float32),
    )
    # `jax.lax.scan` (not fori_loop): `rl-jax plan` unrolls these to count every block.
    (m, l, acc), _ = jax.lax.scan(body, init, jnp.arange(k.shape[2] // block))
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B, T, K, R, hd]
    # m and l apart, not log-sum-exp m + log(l): for a row that sees no key, m is
    # MASK_VALUE, which absorbs log(l) in float32.
    return out, (q, k, v, mask, out, m, l)


def _flash_bwd(S, scale, block, einsum, res, d_out):
    q, k, v, mask, out, m, l = res
    d_out = d_out.astype(jnp.float32)
    # Row sums of dP * P, one per query: softmax's backward without P whole.
    delta = jnp.einsum("btkrh,btkrh->bkrt", d_out, out, precision=precision(out))
    do = d_out.astype(v.dtype)

    def body(dq, j):
        kb, vb, s, seen = _flash_scores(q, k, v, mask, j, S, scale, block, einsum)
        p = jnp.exp(s - m[..., None]) / l[..., None]
        dv = einsum("bkrts,btkrh->bksh", p.astype(do.dtype), do)
        dp = einsum("btkrh,bksh->bkrts", do, vb)
        ds = jnp.where(seen, p * (dp - delta[..., None]), 0.0) * scale
        dq = dq + einsum("bkrts,bksh->btkrh", ds.astype(kb.dtype), kb)
        dk = einsum("bkrts,btkrh->bksh", ds.astype(q.dtype), q)
        return dq, (dk, dv)

    n = k.shape[2] // block
    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), jnp.arange(n))

    def unblock(d, like):  # [n, B, K, block, hd] -> [B, K, n * block, hd]
        return d.transpose(1, 2, 0, 3, 4).reshape(like.shape).astype(like.dtype)

    return dq.astype(q.dtype), unblock(dk, k), unblock(dv, v), None


_flash.defvjp(_flash_fwd, _flash_bwd)
