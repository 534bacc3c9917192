"""Policy losses by name: each entry is a per-token surrogate plus the
hyperparameters it reads (with its paper's defaults) and its paper's
aggregation, used when the caller does not choose one.

The defaults are those of `rl_jax.config.loss.LOSS_DEFAULTS` (a JAX-free table
the config reads as well): one table, so an unset `LossConfig` knob and
`policy_loss` without that keyword mean the same value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rl_jax.config.loss import LOSS_DEFAULTS, LossConfig
from rl_jax.losses._policy import (
    cispo_surrogate,
    clipped_surrogate,
    gspo_layout,
    reinforce_surrogate,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """A registered policy loss.

    fn(logp_bt, old_logp_bt, adv_bt, layout, **params) -> (loss_bt, stats).
    params: the hyperparameters fn reads, named like `LossConfig` fields, with
    defaults from the paper. aggregation / seq_sum_constant (None = the caller's
    budget) and the advantage estimator / normalization it pairs with: the paper's.
    """

    name: str
    fn: Callable[..., Any]
    params: dict[str, float]
    aggregation: str
    paper: str
    advantage: str = "grpo"
    adv_norm: str = "prompt"
    seq_sum_constant: float | None = None


def _token(f):
    # Token-local surrogates do not need the sequence layout.
    return lambda logp, old, adv, layout, **p: f(logp, old, adv, **p)


_REGISTRY: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    """Add a loss; `loss.name=<its name>` picks it from then on (a recipe file that
    registers one can name it), with its paper's defaults for the knobs left unset."""
    if spec.name in _REGISTRY:
        raise ValueError(f"loss {spec.name!r} is already registered")
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    unknown = sorted(set(spec.params) - fields)
    if unknown:
        raise ValueError(
            f"loss {spec.name!r}: params {unknown} are not LossConfig knobs (a loss reads "
            "its hyperparameters from the config by name)"
        )
    if spec.name not in LOSS_DEFAULTS:
        LOSS_DEFAULTS[spec.name] = {
            "aggregation": spec.aggregation,
            "advantage": spec.advantage,
            "adv_norm": spec.adv_norm,
            **({"seq_sum_constant": spec.seq_sum_constant} if spec.seq_sum_constant else {}),
            **spec.params,
        }
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> LossSpec:
    """The registered loss `name`; unknown names fail listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known losses: {names()}") from None


def names() -> list[str]:
    """Registered policy-loss names, in registration order."""
    return list(_REGISTRY)


_CLIP = _token(clipped_surrogate)
_REINFORCE = _token(reinforce_surrogate)
_PPO_PARAMS = ("eps_low", "eps_high", "dual_clip")
for _name, _fn, _keys, _paper in (
    ("ppo", _CLIP, _PPO_PARAMS, "PPO clipped surrogate, Schulman et al. 2017 (arXiv 1707.06347)"),
    ("grpo", _CLIP, _PPO_PARAMS, "GRPO, Shao et al. 2024 (arXiv 2402.03300)"),
    ("dr_grpo", _CLIP, _PPO_PARAMS, "Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783)"),
    ("dapo", _CLIP, _PPO_PARAMS, "DAPO clip-higher, Yu et al. 2025 (arXiv 2503.14476)"),
    ("reinforce_pp", _CLIP, _PPO_PARAMS, "REINFORCE++, Hu 2025 (arXiv 2501.03262)"),
    (
        "cispo",
        _token(cispo_surrogate),
        ("eps_max", "eps_min"),
        "CISPO, MiniMax-M1 (arXiv 2506.13585); ScaleRL (arXiv 2510.13786)",
    ),
    (
        "gspo",
        gspo_layout,
        ("gspo_eps_low", "gspo_eps_high"),
        "GSPO, Zheng et al. 2025 (arXiv 2507.18071)",
    ),
    ("reinforce", _REINFORCE, (), "REINFORCE, Williams 1992"),
    # RLOO's seq_sum constant 1: grad of sum_t log pi(y_t), the whole completion is one action.
    ("rloo", _REINFORCE, (), "RLOO, Ahmadian et al. 2024 (arXiv 2402.14740)"),
):
    _d = LOSS_DEFAULTS[_name]
    register(
        LossSpec(
            name=_name,
            fn=_fn,
            params={k: _d[k] for k in _keys},
            aggregation=_d["aggregation"],
            advantage=_d["advantage"],
            adv_norm=_d["adv_norm"],
            paper=_paper,
            # 0 in the table is "the generation budget", which only the trainer knows.
            seq_sum_constant=_d.get("seq_sum_constant") or None,
        )
    )
