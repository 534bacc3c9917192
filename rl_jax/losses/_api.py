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
from rl_jax.losses._policy import MAX_LOG_RATIO, clipped_value_loss
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
    layout = make_layout(inputs, num_seqs=num_seqs, num_groups=num_groups)
    m = layout.mask
    mf = m.astype(jnp.float32)
    n_tok = mf.sum()

    def reduce(x_bt):
        return aggregate_layout(
            x_bt, layout, agg, num_groups=num_groups, seq_sum_constant=seq_sum_constant
        )

    def token_mean(x_bt):
        return masked(sg(x_bt), m).sum() / jnp.maximum(n_tok, 1.0)

    logp = masked(f32(inputs.logp), m)
    sampler = sg(masked(f32(inputs.sampler_logp), m))
    if inputs.old_logp is not None:
        old = sg(masked(f32(inputs.old_logp), m))
    else:
        old = sg(logp) if tis else sampler
    adv = sg(masked(per_token(inputs.advantages, layout), m))

    pg_bt, stats = spec.fn(logp, old, adv, layout, **hp)
    metrics = {}
    if tis:
        w_raw = jnp.exp(jnp.clip(old - sampler, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        w = jnp.minimum(w_raw, tis_cap)
        pg_bt = pg_bt * w
        metrics["tis_weight_mean"] = token_mean(w)
        metrics["tis_clip_frac"] = token_mean((w_raw > tis_cap).astype(jnp.float32))
    pg = reduce(pg_bt)
    loss = pg
    ratio = stats["ratio"]
    metrics |= {
        "pg_loss": pg,
        "ratio_mean": token_mean(ratio),
        "ratio_max": jnp.where(m, ratio, 0.0).max(),
        "ratio_min": jnp.where(n_tok > 0, jnp.where(m, ratio, jnp.inf).min(), 0.0),
        "clip_frac_low": token_mean(stats["clip_low"]),
        "clip_frac_high": token_mean(stats["clip_high"]),
        "masked_frac": 1.0 - mf.mean(),
        "tokens": n_tok,
        "adv_mean": token_mean(adv),
    }
    if "clip_dual" in stats:
        metrics["clip_frac_dual"] = token_mean(stats["clip_dual"])

    if kl_coef > 0 and inputs.ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef!r} > 0 needs LossInputs.ref_logp")
    if inputs.ref_logp is not None:
        kl_bt = kl_penalty(logp, masked(f32(inputs.ref_logp), m), kl_estimator)
        metrics["kl"] = token_mean(kl_bt)
        if kl_coef > 0:
            loss = loss + kl_coef * reduce(kl_bt)

    if entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef!r} > 0 needs LossInputs.entropy")
    if inputs.entropy is not None:
        ent_bt = masked(f32(inputs.entropy), m)
        metrics["entropy"] = token_mean(ent_bt)
        if entropy_coef > 0:
            loss = loss - entropy_coef * reduce(ent_bt)

    if inputs.values is not None:
        if inputs.returns is None:
            raise ValueError("LossInputs.values given without LossInputs.returns (critic targets)")
        old_v = None if inputs.old_values is None else per_token(inputs.old_values, layout)
        v_bt, v_clipped = clipped_value_loss(
            per_token(inputs.values, layout),
            per_token(inputs.returns, layout),
            old_v,
            clip=value_clip,
        )
        v_loss = reduce(masked(v_bt, m))
        metrics["value_loss"] = v_loss
        metrics["value_clip_frac"] = token_mean(v_clipped)
        loss = loss + value_coef * v_loss

    metrics["loss"] = loss
    return loss, metrics


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
