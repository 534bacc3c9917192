"""Policy losses by name: each entry is a per-token surrogate plus the
hyperparameters it reads (with its paper's defaults) and its paper's
aggregation, used when the caller does not choose one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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
    defaults from the paper. aggregation / seq_sum_constant: the paper's.
    """

    name: str
    fn: Callable[..., Any]
    params: dict[str, float]
    aggregation: str
    paper: str
    seq_sum_constant: float | None = None


def _token(f):
    # Token-local surrogates do not need the sequence layout.
    return lambda logp, old, adv, layout, **p: f(logp, old, adv, **p)


_REGISTRY: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"loss {spec.name!r} is already registered")
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
_SYM = {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 0.0}
for _name, _params, _agg, _paper in (
    ("ppo", _SYM, "token", "PPO clipped surrogate, Schulman et al. 2017 (arXiv 1707.06347)"),
    ("grpo", _SYM, "sample", "GRPO, Shao et al. 2024 (arXiv 2402.03300)"),
    ("dr_grpo", _SYM, "seq_sum", "Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783)"),
    (
        "dapo",
        {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 0.0},
        "token",
        "DAPO clip-higher, Yu et al. 2025 (arXiv 2503.14476)",
    ),
    ("reinforce_pp", _SYM, "token", "REINFORCE++, Hu 2025 (arXiv 2501.03262)"),
):
    register(LossSpec(name=_name, fn=_CLIP, params=_params, aggregation=_agg, paper=_paper))

register(
    LossSpec(
        name="cispo",
        fn=_token(cispo_surrogate),
        params={"eps_max": 5.0, "eps_min": 0.0},
        aggregation="token",
        paper="CISPO, MiniMax-M1 (arXiv 2506.13585); ScaleRL (arXiv 2510.13786)",
    )
)
register(
    LossSpec(
        name="gspo",
        fn=gspo_layout,
        params={"gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4},
        aggregation="sample",
        paper="GSPO, Zheng et al. 2025 (arXiv 2507.18071)",
    )
)
register(
    LossSpec(
        name="reinforce",
        fn=_REINFORCE,
        params={},
        aggregation="token",
        paper="REINFORCE, Williams 1992",
    )
)
register(
    LossSpec(
        name="rloo",
        fn=_REINFORCE,
        params={},
        aggregation="seq_sum",
        seq_sum_constant=1.0,  # grad of sum_t log pi(y_t): the whole completion is one action
        paper="RLOO, Ahmadian et al. 2024 (arXiv 2402.14740)",
    )
)
