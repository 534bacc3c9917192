"""Reward configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import check_choice, check_range, knob

SCALES = ("pm1", "01")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    name: str = knob("arith", help="verifier by name (rl_jax.rewards.names())")
    scale: str = knob("pm1", help=f"reward scale: 'pm1' (+1/-1) or '01' (1/0); one of {SCALES}")
    timeout_s: float = knob(2.0, help="per-call time limit of a verifier")
    workers: int = knob(2, help="verifier worker processes (math-verify)")
    format_coef: float = knob(0.0, help="weight of an optional format reward")
    overlong_penalty: bool = knob(False, help="DAPO overlong penalty")
    overlong_max: int = knob(0, help="DAPO L_max (tokens)")
    overlong_cache: int = knob(0, help="DAPO L_cache (tokens)")

    def __post_init__(self):
        check_choice("rewards", "scale", self.scale, SCALES)
        check_range("rewards", "timeout_s", self.timeout_s, lo=0.0, lo_open=True)
