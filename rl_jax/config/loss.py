"""Loss configuration: which loss, how it is aggregated and regularized.

The choices below mirror the registries of `rl_jax.losses` (which imports JAX;
this module must not): tests/test_losses.py checks that both lists agree.

Knobs that a loss's paper fixes (aggregation, advantage estimator and
normalization, clip ranges) default to None, "this loss's default": the
`LOSS_DEFAULTS` table below, which the loss registry of `rl_jax.losses` reads
too. Changing `loss.name` alone therefore gives that loss as its paper defines
it; a knob set explicitly wins. `LossConfig.resolved()` fills the unset knobs
(the trainer, `rl-jax config` and `run_id` all see resolved configs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rl_jax.knobs import (
    ConfigError,
    DependentKnobError,
    check_choice,
    check_numbers,
    check_range,
    knob,
)

AGGREGATIONS = ("token", "sample", "prompt", "seq_sum")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "gae")
ADV_NORMS = ("batch", "prompt", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")

_PPO_CLIP = {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 0.0}


def _paper(aggregation: str, advantage: str, adv_norm: str, **knobs: float) -> dict[str, Any]:
    """A loss's row of LOSS_DEFAULTS: its aggregation, advantage estimator and
    normalization, and the values of the knobs it reads."""
    return {"aggregation": aggregation, "advantage": advantage, "adv_norm": adv_norm, **knobs}


# Each loss as its paper defines it: the value of every unset (None) knob of
# LossConfig when loss.name is that loss. seq_sum_constant 0 = the generation
# budget (sampling.max_new_tokens), Dr. GRPO's constant.
LOSS_DEFAULTS: dict[str, dict[str, Any]] = {
    # PPO-RLHF: learned critic with GAE, advantages whitened over the batch,
    # token-mean loss, symmetric clip 0.2 (Schulman et al. 2017; needs
    # model.value_head=true).
    "ppo": _paper("token", "gae", "batch", **_PPO_CLIP),
    # GRPO (DeepSeekMath): group mean / prompt std, per-sample token mean, clip 0.2.
    "grpo": _paper("sample", "grpo", "prompt", **_PPO_CLIP),
    # Dr. GRPO: no std normalization, token sums over a constant (the budget).
    "dr_grpo": _paper("seq_sum", "grpo", "none", seq_sum_constant=0.0, **_PPO_CLIP),
    # DAPO: token-mean loss, clip-higher 0.2 / 0.28, GRPO advantages.
    "dapo": _paper("token", "grpo", "prompt", **{**_PPO_CLIP, "eps_high": 0.28}),
    # CISPO as ScaleRL uses it: prompt-mean loss, batch-std advantages, eps_max 5.
    "cispo": _paper("prompt", "grpo", "batch", eps_max=5.0, eps_min=0.0),
    # GSPO: sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], GRPO advantages, mean over samples.
    "gspo": _paper("sample", "grpo", "prompt", gspo_eps_low=3e-4, gspo_eps_high=4e-4),
    # REINFORCE with the group mean as baseline, unnormalized, token mean.
    "reinforce": _paper("token", "grpo", "none"),
    # RLOO: leave-one-out baseline, unnormalized, the completion's log-prob summed.
    "rloo": _paper("seq_sum", "rloo", "none", seq_sum_constant=1.0),
    # REINFORCE++: PPO clip 0.2, advantages z-scored over the batch, token mean.
    "reinforce_pp": _paper("token", "reinforce_pp", "batch", **_PPO_CLIP),
}


def loss_names() -> tuple[str, ...]:
    """The policy losses `loss.name` may pick: every loss `rl_jax.losses.register` knows
    (registering one adds its paper's defaults to LOSS_DEFAULTS: one list, the registry's)."""
    return tuple(LOSS_DEFAULTS)


# What a knob a loss does not read resolves to: one value whatever the loss, so that
# a knob no loss of the run reads never tells two run ids apart.
SHARED_DEFAULTS: dict[str, Any] = {
    "eps_low": 0.2,
    "eps_high": 0.28,
    "dual_clip": 0.0,
    "eps_max": 5.0,
    "eps_min": 0.0,
    "gspo_eps_low": 3e-4,
    "gspo_eps_high": 4e-4,
    "seq_sum_constant": 0.0,
}
PER_LOSS_KNOBS = ("aggregation", "advantage", "adv_norm", *SHARED_DEFAULTS)

_UNSET = "None = this loss's default (rl_jax.config.loss.LOSS_DEFAULTS)"


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    name: str = knob(
        "cispo",
        help=f"policy loss: one registered in rl_jax.losses (built in: {', '.join(LOSS_DEFAULTS)})",
    )
    aggregation: str | None = knob(None, help=f"loss aggregation, one of {AGGREGATIONS}; {_UNSET}")
    advantage: str | None = knob(
        None, help=f"advantage estimator, one of {ADV_ESTIMATORS}; {_UNSET}"
    )
    adv_norm: str | None = knob(
        None,
        help=f"advantage normalization by the std of, one of {ADV_NORMS}; {_UNSET} "
        "('batch' instead of 'prompt' with advantage 'gae')",
    )
    adv_eps: float = knob(1e-6, help="added to the std before dividing advantages by it")
    group_baseline: bool = knob(
        True, help="reinforce_pp advantages: subtract the group mean first (REINFORCE++-baseline)"
    )
    eps_low: float | None = knob(None, help=f"PPO/DAPO lower clip: ratio >= 1 - eps_low; {_UNSET}")
    eps_high: float | None = knob(
        None, help=f"PPO/DAPO upper clip: ratio <= 1 + eps_high; {_UNSET}"
    )
    dual_clip: float | None = knob(
        None, help=f"PPO dual clip c (> 1) for negative advantages (0 = off); {_UNSET}"
    )
    eps_max: float | None = knob(None, help=f"CISPO: upper truncation of the IS weight; {_UNSET}")
    eps_min: float | None = knob(
        None, help=f"CISPO: lower truncation of the IS weight (0 = none); {_UNSET}"
    )
    gspo_eps_low: float | None = knob(None, help=f"GSPO lower clip of the sequence ratio; {_UNSET}")
    gspo_eps_high: float | None = knob(
        None, help=f"GSPO upper clip of the sequence ratio; {_UNSET}"
    )
    seq_sum_constant: float | None = knob(
        None, help=f"seq_sum aggregation's divisor (0 = sampling.max_new_tokens); {_UNSET}"
    )
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
    router_aux_coef: float = knob(
        0.0,
        help="mixture of experts: coefficient of the router's load-balancing loss (Switch "
        "Transformer's E x sum_e f_e P_e per layer, 1 when balanced; 0 = off): docs/moe.md",
    )
    router_z_coef: float = knob(
        0.0,
        help="mixture of experts: coefficient of the router's z-loss (ST-MoE's mean squared "
        "log-sum-exp of the router logits; 0 = off)",
    )
    gamma: float = knob(1.0, help="GAE discount")
    lam: float = knob(1.0, help="GAE lambda")

    def __post_init__(self):
        check_numbers("loss", self)
        check_choice("loss", "name", self.name, loss_names())
        # Knobs left unset (None) are this loss's defaults; set ones are checked as given.
        for k, choices in (
            ("aggregation", AGGREGATIONS),
            ("advantage", ADV_ESTIMATORS),
            ("adv_norm", ADV_NORMS),
        ):
            if getattr(self, k) is not None:
                check_choice("loss", k, getattr(self, k), choices)
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
            "router_aux_coef",
            "router_z_coef",
        ):
            if getattr(self, k) is not None:
                check_range("loss", k, getattr(self, k), lo=0.0)
        if self.eps_max is not None:
            check_range("loss", "eps_max", self.eps_max, lo=0.0, lo_open=True)
        check_range("loss", "tis_cap", self.tis_cap, lo=0.0, lo_open=True)
        check_range("loss", "gamma", self.gamma, lo=0.0, hi=1.0)
        check_range("loss", "lam", self.lam, lo=0.0, hi=1.0)
        if self.dual_clip is not None and self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ConfigError(f"loss.dual_clip={self.dual_clip!r} must be 0 (off) or > 1")
        # Constraints between knobs hold for the values the loss will use.
        r = {**self._unset_values(), **self._set_values()}
        if r["eps_min"] >= r["eps_max"]:
            raise ConfigError(
                f"loss.eps_min={r['eps_min']!r} must be below loss.eps_max={r['eps_max']!r}"
                + ("" if self.eps_max is not None else f" (loss {self.name!r}'s default)")
            )
        if r["advantage"] == "gae" and r["adv_norm"] == "prompt":
            raise DependentKnobError(
                "loss.adv_norm='prompt' normalizes group advantages; loss.advantage='gae' "
                "takes one of ['batch', 'none']",
                knob="loss.adv_norm",
                on=("loss.advantage", "loss.name"),
            )

    def _set_values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in PER_LOSS_KNOBS if getattr(self, k) is not None}

    def _unset_values(self) -> dict[str, Any]:
        """Values of the unset per-loss knobs: the loss's own, else the shared ones."""
        own = {**SHARED_DEFAULTS, **LOSS_DEFAULTS[self.name]}
        advantage = own["advantage"] if self.advantage is None else self.advantage
        if advantage == "gae" and own["adv_norm"] == "prompt":
            # GAE's advantages are per token, not per group: whiten over the batch.
            own["adv_norm"] = "batch"
        return {k: own[k] for k in PER_LOSS_KNOBS if getattr(self, k) is None}

    def resolved(self) -> LossConfig:
        """This config with every unset knob at loss.name's default; idempotent."""
        unset = self._unset_values()
        return dataclasses.replace(self, **unset) if unset else self
