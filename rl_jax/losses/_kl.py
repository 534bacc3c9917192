"""Regularizers: KL-to-reference estimators (Schulman, "Approximating KL
Divergence", 2020) and the per-token entropy the entropy bonus uses.

Tokens are sampled from the policy q = pi_theta; p = pi_ref. With the log-ratio
log r = log p(y) - log q(y) = ref_logp - logp, the estimators of KL(q || p) are

    k1 = -log r                  unbiased; a single sample can be negative;
                                 its gradient logp' has zero mean under q, so as a
                                 loss term it pulls nothing in expectation: use it in
                                 the reward (REINFORCE++, PPO-RLHF).
    k2 = (log r)^2 / 2           biased (exact to second order as q -> p), always
                                 >= 0; E_q[grad k2] = grad KL(q || p) exactly, so it
                                 is the estimator whose gradient is right in the loss.
    k3 = (r - 1) - log r         unbiased and always >= 0 (GRPO's KL term).

k3 exponentiates the log-ratio; it is evaluated at min(log r, K3_MAX_LOG_RATIO)
so that a token the policy has all but ruled out (log r > 20) gives a large
finite penalty (about 5e8) instead of overflowing float32 and its gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._inputs import f32, masked

Array = jax.Array

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_MAX_LOG_RATIO = 20.0


def kl_penalty(logp: Array, ref_logp: Array, estimator: str = "k3") -> Array:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    Args:
      logp: [...] policy log-probs of the sampled tokens (differentiable).
      ref_logp: [...] reference log-probs of the same tokens.
      estimator: 'k1', 'k2' or 'k3' (see the module docstring).
    Returns: [...] per-token estimates, same shape; not masked or reduced.
    """
    log_r = f32(ref_logp) - f32(logp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        log_r = jnp.minimum(log_r, K3_MAX_LOG_RATIO)
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"kl estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")


def kl_shaped_rewards(
    rewards: Array,
    logp_bt: Array,
    ref_logp_bt: Array,
    mask_bt: Array,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> Array:
    """Rewards with the KL penalty subtracted (KL "in the reward", no gradient).

    r'_b = r_b - kl_coef * sum_t kl_bt for sequence rewards [B], or
    r'_bt = r_bt - kl_coef * kl_bt for per-token rewards [B, T] (e.g. before GAE),
    with kl_bt = kl_penalty(logp, ref_logp, estimator) on trained tokens only.
    `logp_bt` should be the behaviour policy's log-probs (sampler or old policy):
    the penalty is part of the return, computed before any update.
    """
    m = jnp.asarray(mask_bt) > 0
    kl_bt = masked(kl_penalty(logp_bt, ref_logp_bt, estimator), m)
    kl_bt = jax.lax.stop_gradient(kl_bt)
    rewards = f32(rewards)
    if rewards.ndim == 1:
        return rewards - kl_coef * kl_bt.sum(axis=-1)
    return rewards - kl_coef * kl_bt


def entropy_from_logits(logits_btv: Array) -> Array:
    """Per-token entropy of softmax(logits): H = logsumexp(z) - sum_v softmax(z)_v z_v.

    For `LossInputs.entropy` ([B, T, V] -> [B, T], float32, differentiable).
    The entropy bonus of IsoCompute's easy-set recipe; off in ScaleRL.
    """
    z = f32(logits_btv)
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
