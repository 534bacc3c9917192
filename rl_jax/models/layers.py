"""Pure math of the decoder: arrays in, arrays out. The hot ops (attention, dense
projections, float32 contractions) are kernels, `rl_jax.kernels`; RMSNorm, RoPE and
the q/k norm and rotation of a layer (`norm_rope_qk`) are the kernels' reference ones
(`rl_jax.kernels.xla`, which the decode step's ops apply too), named here with the
rest of the layer math.

Dimension letters: B batch, T query time, S key time (T without a cache, the
cache length with one), D width, F MLP width, H query heads, K kv heads,
R = H / K query heads per kv head, hd head width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.kernels.xla import apply_rope as apply_rope
from rl_jax.kernels.xla import matmul
from rl_jax.kernels.xla import norm_rope_qk as norm_rope_qk
from rl_jax.kernels.xla import rms_norm as rms_norm
from rl_jax.models.spec import ModelSpec, RopeScaling


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
    return rope_angles(jnp.arange(num_positions, dtype=jnp.float32), spec)


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


@jax.custom_vjp
def swiglu(h: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    """(silu(h wg) * (h wu)) wd for h [..., D], as 2-D matmuls (the decoder's MLP).

    Its backward keeps only h and the two [N, F] projections and recomputes
    the gate's elementwise terms (autodiff of the plain form keeps five
    [N, F] arrays per layer, most of a train step's memory)."""
    return _swiglu_fwd(h, wg, wu, wd)[0]


def _swiglu_fwd(h, wg, wu, wd):
    lead, D = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, D)
    g, u = matmul(x, wg), matmul(x, wu)
    out = matmul(jax.nn.silu(g) * u, wd).reshape(*lead, -1)
    return out, (x, g, u, wg, wu, wd)


def _swiglu_bwd(res, dy):
    x, g, u, wg, wu, wd = res
    lead, D = dy.shape[:-1], dy.shape[-1]
    dy = dy.reshape(-1, D)
    # Tie the recomputation below to the cotangent (a data dependency: XLA on CPU
    # drops optimization barriers before scheduling), so that it can neither merge
    # with the forward's nor run early; either would keep [N, F] temporaries
    # of every layer alive across the whole backward pass. 0 * dy is 0 or NaN,
    # and a NaN there is a NaN gradient anyway.
    g = g + 0 * dy[:1, :1]
    s = jax.nn.sigmoid(g)
    act = g * s
    dprod = matmul(dy, wd.T)
    dwd = matmul((act * u).T, dy)
    du = dprod * act
    dg = dprod * u * s * (1 + g * (1 - s))
    dx = matmul(dg, wg.T) + matmul(du, wu.T)
    return dx.reshape(*lead, -1), matmul(x.T, dg), matmul(x.T, du), dwd


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


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
