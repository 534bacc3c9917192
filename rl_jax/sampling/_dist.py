"""Next-token distributions: temperature, top-k, top-p, greedy; per-row keys.

Reported log-probs are those of the temperature-scaled distribution
`log_softmax(logits / temperature)` at the sampled token, *before* top-k/top-p
truncation (truncation only decides which tokens may be drawn). With
temperature 0 (greedy) they are `log_softmax(logits)` (temperature 1). So the
trainer recomputes them with `token_logprobs(..., temperature=t)` where t is the
sampling temperature, or 1 for greedy: see `logprob_temperature`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rl_jax.kernels.xla import matmul

# Randomness of a row never depends on which other rows share its batch, nor on
# the device count: every draw comes from fold_in(fold_in(seed, row_id), step).
# The interruption length has its own stream, folded in before the row id.
_INTERRUPT_STREAM = 0x5EED1E57


def logprob_temperature(temperature: float) -> float:
    """The temperature the reported log-probs are computed at (1 for greedy)."""
    return float(temperature) if temperature > 0 else 1.0


def row_keys(key: jax.Array, row_ids: jax.Array) -> jax.Array:
    """Per-row keys `fold_in(key, row_id)`: [B] typed keys."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row_ids)


def step_keys(rkeys: jax.Array, step: jax.Array) -> jax.Array:
    """Per-row keys for one decode step: `fold_in(row_key, step)`; [B]."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(rkeys, step)


def uniforms(keys: jax.Array) -> jax.Array:
    """One float32 uniform in [0, 1) per key: the draw `sample_logits` makes from it."""
    flat = keys.reshape(-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(flat)
    return u.reshape(keys.shape)


def step_uniforms(rkeys: jax.Array, steps: jax.Array) -> jax.Array:
    """The uniforms of steps `steps` [T] for rows with keys `rkeys` [B]: [B, T], column t
    the draw of `sample_logits(..., step_keys(rkeys, steps[t]))`, so a decode loop can
    make a chunk's draws in one call before it starts. (Inside the loop, on CPU, the
    two threefry hashes per step are each a rolled while loop: ~45 us a step on the
    bench model, for 64 rows.)"""
    keys = jax.vmap(lambda t: step_keys(rkeys, t), out_axes=1)(steps)
    return uniforms(keys)


def row_step_uniforms(rkeys: jax.Array, start_b: jax.Array, n: int) -> jax.Array:
    """The uniforms of steps start_b[b] .. start_b[b] + n - 1 of each row: [B, n], entry
    [b, j] equal to `step_uniforms(rkeys, steps)` at row b, step start_b[b] + j. For
    rows at different steps (a continuous-batching engine's slots)."""
    steps_bn = start_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)), in_axes=(0, 0))
    return uniforms(fold(rkeys, steps_bn))


def interrupt_lengths(key: jax.Array, row_ids: jax.Array, lo: int, hi: int) -> jax.Array:
    """Forced-interruption lengths, uniform integers in [lo, hi] per row: [B] int32."""
    keys = row_keys(jax.random.fold_in(key, _INTERRUPT_STREAM), row_ids)
    draw = jax.vmap(lambda k: jax.random.randint(k, (), lo, hi + 1, dtype=jnp.int32))
    return draw(keys)


def _truncation_floor(scaled_bv: jax.Array, *, top_k: int, top_p: float) -> jax.Array:
    """Smallest scaled logit still allowed per row after top-k then top-p: [B, 1]."""
    v = scaled_bv.shape[-1]
    if 0 < top_k < v:
        top_bk = jax.lax.top_k(scaled_bv, top_k)[0]  # [B, k], descending
    else:
        top_bk = -jnp.sort(-scaled_bv, axis=-1)  # [B, V], descending
    if top_p < 1.0:
        probs_bk = jax.nn.softmax(top_bk, axis=-1)  # renormalised over the top-k
        mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
        # Keep the smallest prefix whose mass reaches top_p (always the best token).
        keep_bk = mass_before_bk < top_p
        return jnp.min(jnp.where(keep_bk, top_bk, jnp.inf), axis=-1, keepdims=True)
    return top_bk[:, -1:]


def sample_logits(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. Returns (tokens [B] int32, logprobs [B] float32).

    `temperature`, `top_p`, `top_k` are Python numbers (static). Sampling is
    exact inverse-CDF sampling with one uniform per row (`uniforms(keys_b)`), which
    costs one random number per row instead of V (Gumbel-max); the log-prob is of
    the temperature-scaled distribution before truncation (module docstring).
    """
    u_b = None if temperature <= 0 else uniforms(keys_b)
    return sample_with_uniforms(logits_bv, u_b, temperature=temperature, top_p=top_p, top_k=top_k)


def sample_with_uniforms(
    logits_bv: jax.Array,
    uniform_b: jax.Array | None,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """`sample_logits` with the rows' uniforms given (`uniforms`, `step_uniforms`);
    greedy (temperature 0) needs none."""
    logits_bv = logits_bv.astype(jnp.float32)
    if temperature <= 0:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
        return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
    scaled_bv = logits_bv / temperature
    # log_softmax's own formula, with its exponentials kept as the draw's weights
    # (unnormalised: the inverse CDF scales by their total).
    shifted_bv = scaled_bv - jnp.max(scaled_bv, axis=-1, keepdims=True)
    weights_bv = jnp.exp(shifted_bv)
    logp_bv = shifted_bv - jnp.log(jnp.sum(weights_bv, axis=-1, keepdims=True))
    v = logits_bv.shape[-1]
    if (0 < top_k < v) or top_p < 1.0:
        floor_b1 = _truncation_floor(scaled_bv, top_k=top_k, top_p=top_p)
        weights_bv = jnp.where(scaled_bv >= floor_b1, weights_bv, 0.0)
    tokens_b = inverse_cdf(weights_bv, uniform_b)
    return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]


def _prefix_sums(x_bn: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis, as x @ upper-triangular ones.

    One matmul: every column is reduced in the same order, so the sums never
    decrease along a row and a zero term repeats the previous sum exactly (a
    zero-weight index is never the first to reach a target). XLA:CPU's cumsum is
    a reduce-window: 0.24 ms for [64, 512], 51 ms for [64, 151936] (2 cores).
    """
    n = x_bn.shape[-1]
    return matmul(x_bn, jnp.triu(jnp.ones((n, n), x_bn.dtype)))


def inverse_cdf(weights_bv: jax.Array, uniform_b: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative weight reaches (1 - u) x the total:
    a draw from the weights' distribution (nonnegative, a positive total). [B] int32.

    In two levels, so no prefix sum is longer than ~sqrt(V): blocks of c (a power of
    two >= sqrt(V)) slots, the prefix sums of block totals pick a block, then those
    within it pick the slot. A zero-weight slot is never drawn (_prefix_sums).
    """
    B, V = weights_bv.shape
    c = 1 << max(0, math.ceil(math.log2(math.sqrt(V))))
    nb = -(-V // c)
    w_bnc = jnp.pad(weights_bv, ((0, 0), (0, nb * c - V))).reshape(B, nb, c)
    block_cdf_bn = _prefix_sums(jnp.sum(w_bnc, axis=-1))
    # u in [0, 1): target in (0, total], and the last prefix sum is the total.
    target_b = (1.0 - uniform_b) * block_cdf_bn[:, -1]
    j_b = jnp.argmax(block_cdf_bn >= target_b[:, None], axis=-1)
    before_b = jnp.where(
        j_b > 0, jnp.take_along_axis(block_cdf_bn, jnp.maximum(j_b - 1, 0)[:, None], -1)[:, 0], 0.0
    )
    block_bc = jnp.take_along_axis(w_bnc, j_b[:, None, None], axis=1)[:, 0]
    cdf_bc = _prefix_sums(block_bc)
    # What remains after the blocks before: > 0, and at most this block's own total
    # (the two levels round differently).
    rest_b = jnp.minimum(target_b - before_b, cdf_bc[:, -1])
    i_b = jnp.argmax(cdf_bc >= rest_b[:, None], axis=-1)
    return (j_b * c + i_b).astype(jnp.int32)
