"""Advantage estimators and normalization; GAE for PPO's critic.

Group estimators take one scalar reward per row and the prompt (group) each
row belongs to: rows sharing a `group_ids` value are the G samples of one
prompt. `valid_b` marks rows that exist (False for padding or dropped rows):
invalid rows get advantage 0 and do not enter any mean or std. Reductions are
segment sums over a static `num_groups` (group_ids in [0, num_groups)).

The public functions validate their arguments (eagerly, where the values are
concrete) and then run one jitted computation, static in the estimator choice
and group count: called on host arrays they compile once per shape instead of
dispatching op by op; called inside a jit they simply inline.

Standard deviations are the unbiased sample std (ddof=1, as in the GRPO
implementations of TRL and verl); a group or batch with one valid row has std 0.
Normalizing divides by (std + eps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rl_jax.losses._inputs import check_ids, f32, masked

Array = jax.Array

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
ADV_NORMS = ("batch", "prompt", "none")


def _group_stats(x_b, valid, group_ids, num_groups):
    """Per-group count, mean and sum of squared deviations of x over valid rows."""
    vf = valid.astype(jnp.float32)
    n_g = jax.ops.segment_sum(vf, group_ids, num_groups)
    sum_g = jax.ops.segment_sum(masked(x_b, valid), group_ids, num_groups)
    mean_g = sum_g / jnp.maximum(n_g, 1.0)
    dev = masked(x_b - mean_g[group_ids], valid)
    ss_g = jax.ops.segment_sum(jnp.square(dev), group_ids, num_groups)
    return n_g, sum_g, mean_g, ss_g


def _batch_mean_std(x_b, valid, ddof):
    vf = valid.astype(jnp.float32)
    n = vf.sum()
    mean = masked(x_b, valid).sum() / jnp.maximum(n, 1.0)
    ss = jnp.square(masked(x_b - mean, valid)).sum()
    return mean, jnp.sqrt(ss / jnp.maximum(n - ddof, 1.0))


def zero_variance_groups(
    rewards_b: Array, group_ids_b: Array, *, num_groups: int, valid_b: Array | None = None
) -> tuple[Array, Array]:
    """Which groups have all their valid rewards equal (no learning signal).

    The one definition of a zero-variance group in rl_jax: the trainer's
    zero-variance filter (ScaleRL), DAPO's dynamic sampling and the
    `train/zero_variance_frac` metric all call this. Pass the rewards the
    advantages are computed from (the trainer passes the shaped rewards: verifier
    reward plus format reward and overlong penalty), so that a zero-variance group
    is exactly one whose group-baseline advantages ('grpo', 'rloo') are all zero.
    (A KL penalty in the reward is not part of it: it differs between any two
    samples, so it would leave no group zero-variance, and dynamic sampling has to
    decide before any log-prob is computed.)

    Returns (zero_var_g [P] bool, present_g [P] bool): present_g marks groups with
    at least one valid row; zero_var_g is only true for present groups. Row-level
    filter for ScaleRL's zero-variance filtering: `zero_var_g[group_ids_b]`.
    """
    rewards_b = f32(rewards_b)
    group_ids_b = jnp.asarray(group_ids_b, jnp.int32)
    valid = jnp.ones(rewards_b.shape, bool) if valid_b is None else jnp.asarray(valid_b) > 0
    check_ids("group_ids_b", group_ids_b, num_groups, "num_groups", valid)
    return _zero_variance_groups(rewards_b, group_ids_b, valid, num_groups)


@functools.partial(jax.jit, static_argnums=3)
def _zero_variance_groups(rewards_b, group_ids_b, valid, num_groups):
    hi = jax.ops.segment_max(jnp.where(valid, rewards_b, -jnp.inf), group_ids_b, num_groups)
    lo = jax.ops.segment_min(jnp.where(valid, rewards_b, jnp.inf), group_ids_b, num_groups)
    n_g = jax.ops.segment_sum(valid.astype(jnp.float32), group_ids_b, num_groups)
    present = n_g > 0
    return present & (hi == lo), present


def _check_names(estimator: str, norm: str) -> None:
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"advantage estimator={estimator!r} is not one of {list(ADV_ESTIMATORS)}"
            + ("; GAE needs values: use gae_advantages" if estimator == "gae" else "")
        )
    if norm not in ADV_NORMS:
        raise ValueError(f"advantage norm={norm!r} is not one of {list(ADV_NORMS)}")


def compute_advantages(
    rewards_b: Array,
    group_ids_b: Array,
    *,
    estimator: str = "grpo",
    norm: str = "prompt",
    num_groups: int,
    valid_b: Array | None = None,
    group_baseline: bool = True,
    eps: float = 1e-6,
    ddof: int = 1,
) -> tuple[Array, dict[str, Array]]:
    """Per-row advantages from per-row scalar rewards.

    Estimators (the centered advantage c_i of row i in group g with n_g rows):
      'grpo': c_i = r_i - mean_g(r)  (group-mean baseline; Shao et al. 2024,
              arXiv 2402.03300).
      'rloo': c_i = r_i - (sum_g r - r_i) / (n_g - 1)  (leave-one-out baseline;
              Ahmadian et al. 2024, arXiv 2402.14740); 0 when n_g = 1.
      'reinforce_pp': c_i = b_i - mean_batch(b) with b_i = r_i - mean_g(r) if
              group_baseline else r_i (REINFORCE++ global batch normalization, Hu
              2025, arXiv 2501.03262; with the group baseline, its "-baseline"
              variant). Pair with norm='batch' for the paper's z-score.
    Normalization of c:
      'prompt': c_i / (std_g(c) + eps)   (GRPO),
      'batch':  c_i / (std_batch(c) + eps)  over all valid rows (REINFORCE++;
                ScaleRL's choice),
      'none':   c_i   (Dr. GRPO, arXiv 2503.20783).
    GAE for PPO's learned critic is `gae_advantages` (it needs values).

    Args:
      rewards_b: [B] rewards. group_ids_b: [B] ints in [0, num_groups).
      num_groups: static number of prompts P.
      valid_b: [B] rows that exist (default: all).
    Returns:
      (adv_b [B] float32, info) with scalar info: 'groups' (present groups),
      'reward_mean', 'reward_std', 'adv_mean', 'adv_std', all over valid rows.
      Which groups are zero-variance is `zero_variance_groups`' to say (callers
      that filter them pass the survivors as `valid_b`).
    """
    _check_names(estimator, norm)
    r = f32(rewards_b)
    if r.ndim != 1:
        raise ValueError(f"rewards_b must be [B]; got shape {tuple(r.shape)}")
    group_ids_b = jnp.asarray(group_ids_b, jnp.int32)
    valid = jnp.ones(r.shape, bool) if valid_b is None else jnp.asarray(valid_b) > 0
    check_ids("group_ids_b", group_ids_b, num_groups, "num_groups", valid)
    return _compute_advantages(
        r,
        group_ids_b,
        valid,
        eps,
        estimator=estimator,
        norm=norm,
        num_groups=num_groups,
        group_baseline=group_baseline,
        ddof=ddof,
    )


@functools.partial(
    jax.jit, static_argnames=("estimator", "norm", "num_groups", "group_baseline", "ddof")
)
def _compute_advantages(
    r, group_ids_b, valid, eps, *, estimator, norm, num_groups, group_baseline, ddof
):
    r = masked(r, valid)

    n_g, sum_g, mean_g, _ = _group_stats(r, valid, group_ids_b, num_groups)
    n_i = n_g[group_ids_b]
    if estimator == "grpo":
        c = r - mean_g[group_ids_b]
    elif estimator == "rloo":
        loo_mean = (sum_g[group_ids_b] - r) / jnp.maximum(n_i - 1.0, 1.0)
        c = jnp.where(n_i > 1, r - loo_mean, 0.0)
    else:
        b = r - mean_g[group_ids_b] if group_baseline else r
        c = b - _batch_mean_std(b, valid, ddof)[0]
    c = masked(c, valid)

    if norm == "prompt":
        n_g, _, _, ss_g = _group_stats(c, valid, group_ids_b, num_groups)
        std_g = jnp.sqrt(ss_g / jnp.maximum(n_g - ddof, 1.0))
        adv = c / (std_g[group_ids_b] + eps)
    elif norm == "batch":
        adv = c / (_batch_mean_std(c, valid, ddof)[1] + eps)
    else:
        adv = c
    adv = masked(adv, valid)

    r_mean, r_std = _batch_mean_std(r, valid, ddof)
    a_mean, a_std = _batch_mean_std(adv, valid, ddof)
    info = {
        "groups": (n_g > 0).sum().astype(jnp.float32),
        "reward_mean": r_mean,
        "reward_std": r_std,
        "adv_mean": a_mean,
        "adv_std": a_std,
    }
    return adv, info


def terminal_rewards(
    rewards: Array, mask_bt: Array, *, seq_ids: Array | None = None, num_seqs: int | None = None
) -> Array:
    """Place each sequence's scalar reward on its last trained token; [B, T].

    Unpacked: rewards [B], one sequence per row. Packed: rewards [num_seqs],
    indexed by `seq_ids` [B, T]. Sequences with no trained token get nothing.
    """
    if seq_ids is not None and num_seqs is None:
        raise ValueError("seq_ids given without num_seqs (the static number of sequences)")
    return _terminal_rewards(f32(rewards), jnp.asarray(mask_bt) > 0, seq_ids, num_seqs)


@functools.partial(jax.jit, static_argnums=3)
def _terminal_rewards(rewards, m, seq_ids, num_seqs):
    b, t = m.shape
    if seq_ids is None:
        seq = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        num_seqs = b
    else:
        seq = jnp.asarray(seq_ids, jnp.int32)
    flat = jnp.where(m, jnp.arange(b * t, dtype=jnp.int32).reshape(b, t), -1)
    last_s = jax.ops.segment_max(flat.ravel(), seq.ravel(), num_seqs)  # [S]; <0 if empty
    # Empty sequences scatter out of bounds, which `mode="drop"` discards.
    idx = jnp.where(last_s >= 0, last_s, b * t)
    out = jnp.zeros((b * t,), jnp.float32).at[idx].add(rewards, mode="drop")
    return out.reshape(b, t)


@jax.jit
def gae_advantages(
    rewards_bt: Array,
    values_bt: Array,
    mask_bt: Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    seq_ids: Array | None = None,
) -> tuple[Array, Array]:
    """Generalized advantage estimation over each sequence's trained tokens.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},
    returns_t = A_t + V_t  (Schulman et al. 2016, arXiv 1506.02438; PPO).
    "t+1" is the next TRAINED token of the same sequence: masked tokens inside a
    completion (e.g. injected interruption text) are skipped, not treated as
    steps; after a sequence's last trained token V = A = 0 (episode end).
    Rewards are per token, e.g. `terminal_rewards` (optionally minus a per-token
    KL via `kl_shaped_rewards`). Packed rows pass `seq_ids` [B, T]: the
    recursion restarts where the sequence changes.

    Args: rewards_bt, values_bt, mask_bt: [B, T]. Returns (adv_bt, returns_bt),
    both 0 on masked tokens and without gradient.
    """
    m = jnp.asarray(mask_bt) > 0
    r = masked(f32(rewards_bt), m)
    v = masked(jax.lax.stop_gradient(f32(values_bt)), m)
    b, t = m.shape
    seq = jnp.zeros((b, t), jnp.int32) if seq_ids is None else jnp.asarray(seq_ids, jnp.int32)

    def step(carry, xs):
        next_v, next_a, next_seq = carry
        r_t, v_t, m_t, s_t = xs
        cont = (s_t == next_seq).astype(jnp.float32)
        delta = r_t + gamma * cont * next_v - v_t
        a_t = delta + gamma * lam * cont * next_a
        new = (
            jnp.where(m_t, v_t, next_v),
            jnp.where(m_t, a_t, next_a),
            jnp.where(m_t, s_t, next_seq),
        )
        return new, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros((b,), jnp.float32)
    init = (zeros, zeros, jnp.full((b,), -1 if seq_ids is not None else 0, jnp.int32))
    # Time-major reverse scan: carries the next trained token's value and advantage.
    _, adv_tb = jax.lax.scan(step, init, (r.T, v.T, m.T, seq.T), reverse=True)
    adv = adv_tb.T
    return adv, masked(adv + v, m)
