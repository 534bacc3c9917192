"""`policy_loss`: the one entry point the trainer calls, and its config glue."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl_jax.config.loss import LossConfig
from rl_jax.losses._advantages import compute_advantages, gae_advantages, terminal_rewards
from rl_jax.losses._aggregate import AGGREGATIONS, aggregate_layout
from rl_jax.losses._inputs import LossInputs, f32, make_layout, masked, per_token
from rl_jax.losses._kl import kl_penalty, kl_shaped_rewards
from rl_jax.losses._policy import clamped_ratio, clipped_value_loss
from rl_jax.losses._registry import get

Array = jax.Array
sg = jax.lax.stop_gradient


def policy_loss(
    name: str,
    inputs: LossInputs,
    *,
    aggregation: str | None = None,
    num_groups: int | None = None,
    num_seqs: int | None = None,
    seq_sum_constant: float | None = None,
    tis: bool = False,
    tis_cap: float = 2.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    value_coef: float = 0.5,
    value_clip: float = 0.2,
    **params: float,
) -> tuple[Array, dict[str, Array]]:
    """Scalar loss to MINIMIZE (minus the objective) and scalar metrics.

        loss = agg(w * pg_t) + kl_coef * agg(kl_t) - entropy_coef * agg(H_t)
               + value_coef * agg(value_loss_t)

    pg_t is the registered loss `name`'s per-token surrogate (see `names()`),
    agg the aggregation and w the truncated-IS weight (1 unless `tis`).

    Importance ratio: against `inputs.old_logp` when given, else against
    `inputs.sampler_logp`. With tis=True (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; IsoCompute's healthy
    recipe) the sampler/trainer mismatch is corrected by the weight
    w = min(exp(old_logp - sampler_logp), tis_cap), stop-gradient; the ratio is
    then against old_logp, or against sg(logp) when old_logp is None (on-policy:
    the old policy is the current one, so the ratio is 1 with gradient grad logp).

    Args:
      name: registered loss; `params` are its hyperparameters (e.g. eps_max for
        cispo, eps_low/eps_high/dual_clip for the PPO family, gspo_eps_low/high
        for gspo); unset ones take the paper's defaults (`get(name).params`).
      aggregation: 'token' | 'sample' | 'prompt' | 'seq_sum'; None = the paper's.
      num_groups: static number of prompts P (group_ids in [0, P)); needed by
        'prompt'. num_seqs: static number of sequences, for packed inputs.
      seq_sum_constant: 'seq_sum' divisor; None = the loss's default, else T.
      kl_coef, kl_estimator: KL to `inputs.ref_logp` in the loss (0 = off; for
        KL in the reward use `kl_shaped_rewards` before the advantages).
      entropy_coef: bonus on `inputs.entropy` (0 = off).
      value_coef, value_clip: critic loss, added when `inputs.values` is given
        (needs `inputs.returns`; clipped around `inputs.old_values` if given).
    Jit: `inputs` are arrays (traced); `name` and every other argument are Python
    values fixed at trace time (close over them or mark them static), as a
    trainer does with its LossConfig (`loss_from_config`).

    Returns:
      (loss, metrics): scalar float32 arrays, jit-safe. Metrics (token means over
      trained tokens, whatever the aggregation): 'loss', 'pg_loss', 'ratio_mean',
      'ratio_max', 'ratio_min', 'clip_frac_low', 'clip_frac_high' (+ 'clip_frac_dual'
      with dual clip), 'masked_frac' (tokens of the [B, T] grid not trained),
      'tokens', 'adv_mean'; with tis: 'tis_weight_mean', 'tis_clip_frac'; with
      ref_logp: 'kl'; with entropy: 'entropy'; with values: 'value_loss',
      'value_clip_frac'. Zero-variance groups are found from the rewards, by
      `zero_variance_groups`.
    """
    spec, hp, agg, seq_sum_constant = _resolve(name, params, aggregation, seq_sum_constant)
    layout = make_layout(inputs, num_seqs=num_seqs, num_groups=num_groups)
    m = layout.mask
    n_tok = m.astype(jnp.float32).sum()

    def reduce(x_bt):
        return aggregate_layout(
            x_bt, layout, agg, num_groups=num_groups, seq_sum_constant=seq_sum_constant
        )

    def token_mean(x_bt):
        return masked(sg(x_bt), m).sum() / jnp.maximum(n_tok, 1.0)

    logp, old, sampler, adv = _policy_inputs(inputs, layout, tis=tis)
    pg_bt, stats = spec.fn(logp, old, adv, layout, **hp)
    metrics = {}
    if tis:
        pg_bt, metrics = _truncated_is(pg_bt, old, sampler, cap=tis_cap, mean=token_mean)
    pg = reduce(pg_bt)
    metrics |= _pg_metrics(pg, stats, adv, m, n_tok, token_mean)
    loss, kl_metrics = _kl_term(
        pg, inputs, logp, m, coef=kl_coef, estimator=kl_estimator, reduce=reduce, mean=token_mean
    )
    loss, entropy_metrics = _entropy_term(
        loss, inputs, m, coef=entropy_coef, reduce=reduce, mean=token_mean
    )
    loss, value_metrics = _value_term(
        loss, inputs, layout, coef=value_coef, clip=value_clip, reduce=reduce, mean=token_mean
    )
    metrics |= kl_metrics | entropy_metrics | value_metrics
    metrics["loss"] = loss
    return loss, metrics


def _policy_inputs(inputs: LossInputs, layout, *, tis: bool):
    """(logp, old logp, sampler logp, advantages) [B, T] masked to trained tokens, all but logp
    stop-gradient; the old policy is the sampler's unless given (or, with tis, the current)."""
    m = layout.mask
    logp = masked(f32(inputs.logp), m)
    sampler = sg(masked(f32(inputs.sampler_logp), m))
    if inputs.old_logp is not None:
        old = sg(masked(f32(inputs.old_logp), m))
    else:
        old = sg(logp) if tis else sampler
    adv = sg(masked(per_token(inputs.advantages, layout), m))
    return logp, old, sampler, adv


def _truncated_is(pg_bt, old, sampler, *, cap: float, mean):
    """(pg_bt weighted by min(exp(old - sampler), cap), the weights' metrics)."""
    w_raw = clamped_ratio(old - sampler)
    w = jnp.minimum(w_raw, cap)
    metrics = {
        "tis_weight_mean": mean(w),
        "tis_clip_frac": mean((w_raw > cap).astype(jnp.float32)),
    }
    return pg_bt * w, metrics


def _resolve(name: str, params: dict, aggregation: str | None, seq_sum_constant: float | None):
    """(the loss's spec, its hyperparameters over its defaults, the aggregation, the seq_sum
    divisor): unset ones are the loss's own."""
    spec = get(name)
    unknown = sorted(set(params) - set(spec.params))
    if unknown:
        raise ValueError(
            f"loss {name!r} does not take {unknown}; it takes {sorted(spec.params)} "
            "(plus the shared keywords of policy_loss)"
        )
    hp = {**spec.params, **params}
    agg = spec.aggregation if aggregation is None else aggregation
    if agg not in AGGREGATIONS:
        raise ValueError(f"aggregation={agg!r} is not one of {list(AGGREGATIONS)}")
    if seq_sum_constant is None:
        seq_sum_constant = spec.seq_sum_constant
    return spec, hp, agg, seq_sum_constant


def _pg_metrics(pg, stats, adv, m, n_tok, mean) -> dict[str, Array]:
    """The surrogate's metrics: its ratio's range and clipped fractions over trained tokens."""
    ratio = stats["ratio"]
    metrics = {
        "pg_loss": pg,
        "ratio_mean": mean(ratio),
        "ratio_max": jnp.where(m, ratio, 0.0).max(),
        "ratio_min": jnp.where(n_tok > 0, jnp.where(m, ratio, jnp.inf).min(), 0.0),
        "clip_frac_low": mean(stats["clip_low"]),
        "clip_frac_high": mean(stats["clip_high"]),
        "masked_frac": 1.0 - m.astype(jnp.float32).mean(),
        "tokens": n_tok,
        "adv_mean": mean(adv),
    }
    if "clip_dual" in stats:
        metrics["clip_frac_dual"] = mean(stats["clip_dual"])
    return metrics


def _kl_term(loss, inputs: LossInputs, logp, m, *, coef, estimator, reduce, mean):
    """(loss + coef * agg(KL to the reference), {"kl": its token mean}) where ref_logp is given."""
    if coef > 0 and inputs.ref_logp is None:
        raise ValueError(f"kl_coef={coef!r} > 0 needs LossInputs.ref_logp")
    if inputs.ref_logp is None:
        return loss, {}
    kl_bt = kl_penalty(logp, masked(f32(inputs.ref_logp), m), estimator)
    metrics = {"kl": mean(kl_bt)}
    if coef > 0:
        loss = loss + coef * reduce(kl_bt)
    return loss, metrics


def _entropy_term(loss, inputs: LossInputs, m, *, coef, reduce, mean):
    """(loss - coef * agg(entropy), {"entropy": its token mean}) where entropy is given."""
    if coef > 0 and inputs.entropy is None:
        raise ValueError(f"entropy_coef={coef!r} > 0 needs LossInputs.entropy")
    if inputs.entropy is None:
        return loss, {}
    ent_bt = masked(f32(inputs.entropy), m)
    metrics = {"entropy": mean(ent_bt)}
    if coef > 0:
        loss = loss - coef * reduce(ent_bt)
    return loss, metrics


def _value_term(loss, inputs: LossInputs, layout, *, coef, clip, reduce, mean):
    """(loss + coef * critic loss, its metrics) where values are given."""
    if inputs.values is None:
        return loss, {}
    if inputs.returns is None:
        raise ValueError("LossInputs.values given without LossInputs.returns (critic targets)")
    old_v = None if inputs.old_values is None else per_token(inputs.old_values, layout)
    v_bt, v_clipped = clipped_value_loss(
        per_token(inputs.values, layout),
        per_token(inputs.returns, layout),
        old_v,
        clip=clip,
    )
    v_loss = reduce(masked(v_bt, layout.mask))
    metrics = {"value_loss": v_loss, "value_clip_frac": mean(v_clipped)}
    return loss + coef * v_loss, metrics


def loss_from_config(
    cfg: LossConfig,
    inputs: LossInputs,
    *,
    num_groups: int,
    max_tokens: int,
    num_seqs: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """`policy_loss` with every knob from a `LossConfig`.

    max_tokens: the generation budget, Dr. GRPO's seq_sum divisor when
    cfg.seq_sum_constant is 0. Knobs cfg leaves unset take cfg.name's defaults
    (`LossConfig.resolved`). With cfg.kl_in_reward the KL is left out of the
    loss (it belongs in the rewards: `advantages_from_config` applies it).
    """
    cfg = cfg.resolved()
    spec = get(cfg.name)
    return policy_loss(
        cfg.name,
        inputs,
        aggregation=cfg.aggregation,
        num_groups=num_groups,
        num_seqs=num_seqs,
        seq_sum_constant=cfg.seq_sum_constant or float(max_tokens),
        tis=cfg.tis,
        tis_cap=cfg.tis_cap,
        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
        value_coef=cfg.value_coef,
        value_clip=cfg.value_clip,
        **{k: getattr(cfg, k) for k in spec.params},
    )


def _kl_rewards(cfg: LossConfig, rewards, behaviour_logp_bt, ref_logp_bt, mask_bt):
    if not (cfg.kl_in_reward and cfg.kl_coef > 0):
        return rewards
    if behaviour_logp_bt is None or ref_logp_bt is None or mask_bt is None:
        raise ValueError(
            "loss.kl_in_reward with loss.kl_coef > 0 needs behaviour_logp_bt, "
            "ref_logp_bt and mask_bt to subtract the KL from the rewards"
        )
    return kl_shaped_rewards(
        rewards,
        behaviour_logp_bt,
        ref_logp_bt,
        mask_bt,
        kl_coef=cfg.kl_coef,
        estimator=cfg.kl_estimator,
    )


def advantages_from_config(
    cfg: LossConfig,
    rewards_b: Array,
    group_ids_b: Array,
    *,
    num_groups: int,
    valid_b: Array | None = None,
    behaviour_logp_bt: Array | None = None,
    ref_logp_bt: Array | None = None,
    mask_bt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Group advantages [B] per cfg.advantage / cfg.adv_norm (not 'gae': see
    `gae_from_config`); unset knobs take cfg.name's defaults. With
    cfg.kl_in_reward, rewards first lose kl_coef * sum_t KL_t, computed from the
    behaviour policy's log-probs."""
    cfg = cfg.resolved()
    if cfg.advantage == "gae":
        raise ValueError("loss.advantage='gae' needs critic values: use gae_from_config")
    rewards_b = _kl_rewards(cfg, rewards_b, behaviour_logp_bt, ref_logp_bt, mask_bt)
    return compute_advantages(
        rewards_b,
        group_ids_b,
        estimator=cfg.advantage,
        norm=cfg.adv_norm,
        num_groups=num_groups,
        valid_b=valid_b,
        group_baseline=cfg.group_baseline,
        eps=cfg.adv_eps,
    )


def gae_from_config(
    cfg: LossConfig,
    rewards_b: Array,
    values_bt: Array,
    mask_bt: Array,
    *,
    seq_ids: Array | None = None,
    num_seqs: int | None = None,
    behaviour_logp_bt: Array | None = None,
    ref_logp_bt: Array | None = None,
) -> tuple[Array, Array]:
    """PPO advantages: sequence rewards on the last trained token (minus a
    per-token KL with cfg.kl_in_reward), GAE with cfg.gamma / cfg.lam; then
    cfg.adv_norm 'batch' whitens over trained tokens (mean 0, std 1), 'none'
    leaves them (unset: cfg.name's default, 'batch' where that is 'prompt').
    Returns (adv_bt, returns_bt)."""
    # (LossConfig refuses adv_norm='prompt' with GAE: it normalizes group advantages.)
    cfg = dataclasses.replace(cfg, advantage="gae").resolved()
    r_bt = terminal_rewards(rewards_b, mask_bt, seq_ids=seq_ids, num_seqs=num_seqs)
    r_bt = _kl_rewards(cfg, r_bt, behaviour_logp_bt, ref_logp_bt, mask_bt)
    adv, ret = gae_advantages(
        r_bt, values_bt, mask_bt, gamma=cfg.gamma, lam=cfg.lam, seq_ids=seq_ids
    )
    if cfg.adv_norm == "batch":
        m = jnp.asarray(mask_bt) > 0
        n = jnp.maximum(m.sum(), 1)
        mean = adv.sum() / n
        var = jnp.square(masked(adv - mean, m)).sum() / jnp.maximum(n - 1, 1)
        adv = masked((adv - mean) / (jnp.sqrt(var) + cfg.adv_eps), m)
    return adv, ret
