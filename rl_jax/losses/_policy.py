"""Per-token policy-gradient surrogates: arrays in, per-token losses out.

Sign convention: every function returns a per-token LOSS to minimize, i.e.
minus the paper's objective term; aggregation (`aggregate`) turns it into the
scalar. Log-probs are of the sampled tokens. `old_logp` is the policy the
importance ratio is taken against (the policy at the start of the batch's
updates, or the sampler's); it is treated as a constant (stop-gradient).

Each function also returns per-token statistics ([B, T] float arrays):
'ratio' (the importance ratio it used), 'clip_low' and 'clip_high' (1 where the
low / high clip or truncation is active, i.e. where it changes the gradient).

Ratios are exp(clip(log-ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)): beyond e^20
(~5e8) a token is wildly off-policy, and the clamp keeps values and gradients
finite (and zero-gradient there) instead of overflowing float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._inputs import Layout, f32, masked

Array = jax.Array
sg = jax.lax.stop_gradient

MAX_LOG_RATIO = 20.0


def clamped_ratio(log_ratio: Array) -> Array:
    """exp(log_ratio) with the log-ratio clipped to +-MAX_LOG_RATIO (see the module doc)."""
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def clipped_surrogate(
    logp: Array,
    old_logp: Array,
    adv: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate, with DAPO's asymmetric clip and optional dual clip.

    r = exp(logp - sg(old_logp)),
    J = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),
    dual clip (c > 1, negative A only): J = max(J, c A),
    loss = -J.

    PPO (Schulman et al. 2017, arXiv 1707.06347) uses eps_low = eps_high; DAPO
    (Yu et al. 2025, arXiv 2503.14476) "clip-higher" raises eps_high (0.28 vs
    0.2); dual clip is from Ye et al. 2020 (arXiv 1912.09729). GRPO (Shao et al.
    2024, arXiv 2402.03300), Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) and
    REINFORCE++ (Hu 2025, arXiv 2501.03262) use this same token surrogate and
    differ in advantages and aggregation.

    Args: logp, old_logp, adv: [B, T]. Returns (loss_bt, stats).
    """
    r = clamped_ratio(logp - sg(old_logp))
    obj = jnp.minimum(r * adv, jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * adv)
    neg = adv < 0
    stats = {
        "ratio": sg(r),
        "clip_low": (neg & (r < 1.0 - eps_low)).astype(jnp.float32),
        "clip_high": ((adv > 0) & (r > 1.0 + eps_high)).astype(jnp.float32),
    }
    if dual_clip > 0:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip!r} must be 0 (off) or > 1")
        obj = jnp.where(neg, jnp.maximum(obj, dual_clip * adv), obj)
        stats["clip_dual"] = (neg & (r > dual_clip)).astype(jnp.float32)
    return -obj, stats


def cispo_surrogate(
    logp: Array, old_logp: Array, adv: Array, *, eps_max: float, eps_min: float = 0.0
) -> tuple[Array, dict[str, Array]]:
    """CISPO: REINFORCE weighted by a truncated, stop-gradient IS ratio.

    rho = exp(logp - old_logp),  w = sg(clip(rho, eps_min, eps_max)),
    loss = -w A logp,  so  grad loss = -sg(min(rho, eps_max)) A grad logp
    (with eps_min = 0). Unlike PPO's clip, truncation never zeroes a token's
    gradient; it only bounds its weight. MiniMax-M1 (arXiv 2506.13585); the
    ScaleRL form (arXiv 2510.13786): J = (1/T) sum sg(min(rho, eps_max)) A log pi.

    The loss VALUE is a surrogate (it involves logp itself); only its gradient
    is meaningful. Args: logp, old_logp, adv: [B, T]. Returns (loss_bt, stats).
    """
    rho = clamped_ratio(sg(logp) - sg(old_logp))
    w = jnp.clip(rho, eps_min, eps_max)
    stats = {
        "ratio": rho,
        "clip_low": (rho < eps_min).astype(jnp.float32),
        "clip_high": (rho > eps_max).astype(jnp.float32),
    }
    return -w * adv * logp, stats


def reinforce_surrogate(logp: Array, old_logp: Array, adv: Array) -> tuple[Array, dict[str, Array]]:
    """Vanilla REINFORCE (Williams 1992): loss = -A logp, grad = -A grad logp.

    No importance ratio: an on-policy estimator (use `tis` to correct the
    sampler/trainer mismatch). RLOO (Ahmadian et al. 2024, arXiv 2402.14740) is
    this loss on leave-one-out advantages, summed over each sequence's tokens.
    The ratio in the stats is only reported. Returns (loss_bt, stats).
    """
    zeros = jnp.zeros_like(logp)
    stats = {"ratio": clamped_ratio(sg(logp) - sg(old_logp)), "clip_low": zeros, "clip_high": zeros}
    return -adv * logp, stats


def gspo_layout(
    logp: Array,
    old_logp: Array,
    adv: Array,
    layout: Layout,
    *,
    gspo_eps_low: float,
    gspo_eps_high: float,
) -> tuple[Array, dict[str, Array]]:
    """`gspo_surrogate` on a prepared `Layout` (used inside `policy_loss`)."""
    m = layout.mask
    d = masked(logp - sg(old_logp), m)
    n_s = layout.seq_sum(m.astype(jnp.float32))
    log_s = layout.seq_sum(d) / jnp.maximum(n_s, 1.0)  # [S]
    s = sg(clamped_ratio(log_s))
    s_bt = layout.seq_broadcast(s)
    # Token form: value s_i, gradient s_i * grad logp_t (GSPO's eq. for GSPO-token).
    s_it = s_bt * jnp.exp(logp - sg(logp))
    obj = jnp.minimum(s_it * adv, jnp.clip(s_it, 1.0 - gspo_eps_low, 1.0 + gspo_eps_high) * adv)
    stats = {
        "ratio": s_bt,
        "clip_low": ((adv < 0) & (s_bt < 1.0 - gspo_eps_low)).astype(jnp.float32),
        "clip_high": ((adv > 0) & (s_bt > 1.0 + gspo_eps_high)).astype(jnp.float32),
    }
    return -obj, stats


def gspo_surrogate(
    logp: Array,
    old_logp: Array,
    adv: Array,
    mask: Array,
    *,
    gspo_eps_low: float,
    gspo_eps_high: float,
    seq_ids: Array | None = None,
    num_seqs: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level clipped ratio.

    s_i = exp((1/|y_i|) sum_{t in y_i} (logp_t - old_logp_t))  (length-normalized
    sequence ratio over the sequence's trained tokens), clipped like PPO at the
    sequence level with [1 - gspo_eps_low, 1 + gspo_eps_high].

    Implemented in the paper's token form (GSPO-token):
    s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)), whose value is s_i and whose gradient
    is s_i grad logp_t, and loss_t = -min(s_it A_t, clip(s_it) A_t). With a
    per-sequence advantage and 'sample' aggregation this equals sequence-level
    GSPO in value and gradient: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), with
    grad s_i = s_i (1/|y_i|) sum_t grad logp_t. Other aggregations reweigh tokens.

    Args: logp, old_logp, adv, mask: [B, T]; seq_ids/num_seqs for packed rows.
    Returns (loss_bt, stats).
    """
    m = jnp.asarray(mask) > 0
    if seq_ids is not None and num_seqs is None:
        raise ValueError("seq_ids given without num_seqs (the static number of sequences)")
    layout = Layout(
        mask=m,
        group_bt=jnp.zeros(m.shape, jnp.int32),
        seq_ids=None if seq_ids is None else jnp.asarray(seq_ids, jnp.int32),
        num_seqs=num_seqs or m.shape[0],
    )
    return gspo_layout(
        masked(f32(logp), m),
        masked(f32(old_logp), m),
        masked(f32(adv), m),
        layout,
        gspo_eps_low=gspo_eps_low,
        gspo_eps_high=gspo_eps_high,
    )


def clipped_value_loss(
    values: Array, returns: Array, old_values: Array | None = None, *, clip: float = 0.2
) -> tuple[Array, Array]:
    """PPO critic loss, per token (or per row), with value clipping.

    v_clip = old_values + clip(values - old_values, -clip, clip),
    loss = 0.5 * max((values - returns)^2, (v_clip - returns)^2);
    unclipped 0.5 * (values - returns)^2 when old_values is None or clip == 0.
    (PPO2 baselines; Schulman et al. 2017.) Returns (loss, clipped indicator).
    """
    values = f32(values)
    returns = sg(f32(returns))
    err = jnp.square(values - returns)
    if old_values is None or clip <= 0:
        return 0.5 * err, jnp.zeros_like(err)
    old_values = sg(f32(old_values))
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    err_c = jnp.square(v_clip - returns)
    return 0.5 * jnp.maximum(err, err_c), (err_c > err).astype(jnp.float32)
