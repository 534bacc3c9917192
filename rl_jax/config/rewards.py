"""Reward configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_choice, check_numbers, check_range, knob
from rl_jax.rewards import names as reward_names

SCALES = ("pm1", "01")
# DAPO's soft overlong window over its generation budget: 4096 of 20480 tokens.
OVERLONG_CACHE_FRACTION = 0.2


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    name: str = knob(
        "auto",
        help="verifier by name (rl_jax.rewards.names()); 'auto' = the data's own verifier "
        "(arith, countdown; numeric or math by a file's layout and answers)",
    )
    scale: str = knob("pm1", help=f"reward scale: 'pm1' (+1/-1) or '01' (1/0); one of {SCALES}")
    timeout_s: float = knob(
        2.0,
        help="per-call time limit of a sandboxed verifier (math, gym; code: the wall time of "
        "a program and all its tests)",
    )
    workers: int = knob(2, help="sandbox worker processes for math-verify / reasoning-gym / code")
    code_partial: bool = knob(
        False,
        help="code: reward the fraction of tests passed instead of 1 only when all pass "
        "(pass@k still counts only programs that pass every test)",
    )
    code_memory_mb: int = knob(512, help="code: address-space limit of a program's process, MiB")
    format_coef: float = knob(
        0.0, help="format reward: added when an answer can be read from the completion"
    )
    overlong_penalty: bool = knob(
        False, help="DAPO overlong penalty clip((L_max - |y|)/L_cache - 1, -1, 0)"
    )
    overlong_max: int = knob(
        0, help="DAPO L_max (generated tokens; 0 = sampling.max_new_tokens, the budget)"
    )
    overlong_cache: int = knob(
        0,
        help="DAPO L_cache, the soft-penalty window below L_max (generated tokens; 0 = a "
        "fifth of L_max, DAPO's 4096 of 20480)",
    )

    def overlong_window(self, max_new_tokens: int) -> tuple[int, int]:
        """(L_max, L_cache) of the overlong penalty, its unset (0) parts filled in: L_max
        the generation budget, L_cache a fifth of L_max (at least 1)."""
        l_max = self.overlong_max or max_new_tokens
        return l_max, self.overlong_cache or max(1, round(l_max * OVERLONG_CACHE_FRACTION))

    def __post_init__(self):
        check_numbers("rewards", self)
        if not self.name:
            raise ConfigError("rewards.name is empty; use a verifier name or 'auto'")
        if self.name != "auto":
            # Checked now, not when the trainer builds the verifier after JAX has started
            # and the model has loaded.
            check_choice("rewards", "name", self.name, ["auto", *reward_names()])
        check_choice("rewards", "scale", self.scale, SCALES)
        check_range("rewards", "timeout_s", self.timeout_s, lo=0.0, lo_open=True)
        check_range("rewards", "workers", self.workers, lo=1)
        # Below ~64 MiB the interpreter itself cannot start.
        check_range("rewards", "code_memory_mb", self.code_memory_mb, lo=64, hi=1 << 20)
        check_range("rewards", "overlong_max", self.overlong_max, lo=0)
        check_range("rewards", "overlong_cache", self.overlong_cache, lo=0)
        # Set (nonzero) ones are checked here; with one left to its default, the filled-in
        # window is checked by RunConfig, which knows the generation budget.
        if self.overlong_penalty and self.overlong_max and self.overlong_cache:
            check_overlong_window(self.overlong_max, self.overlong_cache)


def check_overlong_window(l_max: int, l_cache: int, *, filled: str = "") -> None:
    if not 0 < l_cache < l_max:
        raise ConfigError(
            "rewards.overlong_penalty=true needs 0 < rewards.overlong_cache < "
            f"rewards.overlong_max, got {l_cache}, {l_max}{filled}"
        )
