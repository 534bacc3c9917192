"""Loss configuration: which loss, how it is aggregated and regularized.

The choices below mirror the registries of `rl_jax.losses` (which imports JAX;
this module must not): tests/test_losses.py checks that both lists agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_choice, check_numbers, check_range, knob

LOSSES = ("ppo", "grpo", "dr_grpo", "dapo", "cispo", "gspo", "reinforce", "rloo", "reinforce_pp")
AGGREGATIONS = ("token", "sample", "prompt", "seq_sum")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "gae")
ADV_NORMS = ("batch", "prompt", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    name: str = knob("cispo", help=f"policy loss, one of {LOSSES}")
    aggregation: str = knob("prompt", help=f"loss aggregation, one of {AGGREGATIONS}")
    advantage: str = knob("grpo", help=f"advantage estimator, one of {ADV_ESTIMATORS}")
    adv_norm: str = knob("batch", help=f"advantage normalization by the std of, one of {ADV_NORMS}")
    adv_eps: float = knob(1e-6, help="added to the std before dividing advantages by it")
    group_baseline: bool = knob(
        True, help="reinforce_pp advantages: subtract the group mean first (REINFORCE++-baseline)"
    )
    eps_low: float = knob(0.2, help="PPO/DAPO lower clip: ratio >= 1 - eps_low")
    eps_high: float = knob(0.28, help="PPO/DAPO upper clip: ratio <= 1 + eps_high")
    dual_clip: float = knob(0.0, help="PPO dual clip c (> 1) for negative advantages (0 = off)")
    eps_max: float = knob(5.0, help="CISPO: upper truncation of the IS weight")
    eps_min: float = knob(0.0, help="CISPO: lower truncation of the IS weight (0 = none)")
    gspo_eps_low: float = knob(3e-4, help="GSPO lower clip of the sequence ratio")
    gspo_eps_high: float = knob(4e-4, help="GSPO upper clip of the sequence ratio")
    seq_sum_constant: float = knob(0.0, help="Dr. GRPO seq_sum normalizer (0 = max_new_tokens)")
    tis: bool = knob(False, help="truncated importance sampling vs the sampler's log-probs")
    tis_cap: float = knob(2.0, help="truncated IS cap C: weight = min(exp(old - sampler), C)")
    kl_coef: float = knob(0.0, help="KL-to-reference coefficient (0 = off)")
    kl_estimator: str = knob("k3", help=f"KL estimator, one of {KL_ESTIMATORS}")
    kl_in_reward: bool = knob(
        False, help="subtract KL from the reward instead of adding it to the loss"
    )
    entropy_coef: float = knob(0.0, help="entropy bonus coefficient (0 = off)")
    value_coef: float = knob(0.5, help="PPO critic loss coefficient")
    value_clip: float = knob(0.2, help="PPO clipped value loss range (0 = unclipped)")
    gamma: float = knob(1.0, help="GAE discount")
    lam: float = knob(1.0, help="GAE lambda")

    def __post_init__(self):
        check_numbers("loss", self)
        check_choice("loss", "name", self.name, LOSSES)
        check_choice("loss", "aggregation", self.aggregation, AGGREGATIONS)
        check_choice("loss", "advantage", self.advantage, ADV_ESTIMATORS)
        check_choice("loss", "adv_norm", self.adv_norm, ADV_NORMS)
        check_choice("loss", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for k in (
            "eps_low",
            "eps_high",
            "kl_coef",
            "entropy_coef",
            "eps_min",
            "gspo_eps_low",
            "gspo_eps_high",
            "seq_sum_constant",
            "value_coef",
            "value_clip",
            "adv_eps",
        ):
            check_range("loss", k, getattr(self, k), lo=0.0)
        check_range("loss", "eps_max", self.eps_max, lo=0.0, lo_open=True)
        check_range("loss", "tis_cap", self.tis_cap, lo=0.0, lo_open=True)
        check_range("loss", "gamma", self.gamma, lo=0.0, hi=1.0)
        check_range("loss", "lam", self.lam, lo=0.0, hi=1.0)
        if self.eps_min >= self.eps_max:
            raise ConfigError(
                f"loss.eps_min={self.eps_min!r} must be below loss.eps_max={self.eps_max!r}"
            )
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ConfigError(f"loss.dual_clip={self.dual_clip!r} must be 0 (off) or > 1")
