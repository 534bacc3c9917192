"""Next-token distributions: temperature, top-k, top-p, greedy; per-row keys.

Reported log-probs are those of the temperature-scaled distribution
`log_softmax(logits / temperature)` at the sampled token, *before* top-k/top-p
truncation (truncation only decides which tokens may be drawn). With
temperature 0 (greedy) they are `log_softmax(logits)` (temperature 1). So the
trainer recomputes them with `token_logprobs(..., temperature=t)` where t is the
sampling temperature, or 1 for greedy: see `logprob_temperature`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    exact inverse-CDF sampling with one uniform per row, which costs one
    random number per row instead of V (Gumbel-max); the log-prob is of the
    temperature-scaled distribution before truncation (module docstring).
    """
    logits_bv = logits_bv.astype(jnp.float32)
    if temperature <= 0:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
        return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
    scaled_bv = logits_bv / temperature
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    probs_bv = jnp.exp(logp_bv)
    v = logits_bv.shape[-1]
    if (0 < top_k < v) or top_p < 1.0:
        floor_b1 = _truncation_floor(scaled_bv, top_k=top_k, top_p=top_p)
        probs_bv = jnp.where(scaled_bv >= floor_b1, probs_bv, 0.0)
    cdf_bv = jnp.cumsum(probs_bv, axis=-1)
    uniform_b = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_b)
    # u in (0, total]: the first index with cdf >= u has positive probability.
    u_b1 = ((1.0 - uniform_b) * cdf_bv[:, -1])[:, None]
    tokens_b = jnp.minimum(jnp.sum(cdf_bv < u_b1, axis=-1), v - 1).astype(jnp.int32)
    return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
