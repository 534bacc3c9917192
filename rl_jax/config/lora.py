"""LoRA: low-rank adapters trained on a frozen base model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_jax.knobs import ConfigError, DependentKnobError, check_numbers, check_range, knob

# Weights an adapter can target: the layers' projections (stacked [L, ...]) and the
# untied LM head. A model may lack one (a tied head): preflight checks against the spec.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
DEFAULT_TARGETS = "q,k,v,o,gate,up,down"
# LoRA's learning rate over a full fine-tune's (train.lr) when lora.lr_scale is 0. Adapters
# start at B = 0 and move the weights only through a rank-r product scaled by alpha / r: at
# a full fine-tune's rate they barely move them. About 10x is common practice (Schulman et
# al., "LoRA Without Regret", Thinking Machines 2025: LoRA's best rate is ~10x full
# fine-tuning's, for supervised and RL training alike).
LORA_LR_SCALE = 10.0


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    enabled: bool = knob(False, help="train adapters on a frozen base (false: every weight)")
    rank: int = knob(8, help="adapter rank r (>= 1)")
    alpha: float = knob(16.0, help="adapter scale numerator: W + (alpha / r) A B")
    targets: str = knob(
        DEFAULT_TARGETS, help=f"comma-separated weights that get adapters, of {LORA_TARGETS}"
    )
    lr_scale: float = knob(
        0.0,
        help="learning rate of the adapters (and a critic's head) as a multiple of train.lr; "
        f"0 = {LORA_LR_SCALE:g} (LoRA wants ~10x a full fine-tune's rate; docs/precision.md)",
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def lr_factor(self) -> float:
        """What train.lr is multiplied by for the weights this config trains: 1 without
        adapters, else lr_scale (0: LORA_LR_SCALE)."""
        if not self.enabled:
            return 1.0
        return self.lr_scale or LORA_LR_SCALE

    def resolved(self) -> LoraConfig:
        """lr_scale filled in when adapters are on (the run id hashes the rate they train
        at); idempotent."""
        if self.enabled and not self.lr_scale:
            return dataclasses.replace(self, lr_scale=LORA_LR_SCALE)
        return self

    @property
    def target_names(self) -> tuple[str, ...]:
        """The targets in the order of LORA_TARGETS (so equal sets give equal adapters)."""
        names = {t.strip() for t in str(self.targets).split(",") if t.strip()}
        return tuple(t for t in LORA_TARGETS if t in names)

    def __post_init__(self):
        check_numbers("lora", self)
        check_range("lora", "rank", self.rank, lo=1, hi=2**31 - 1)
        check_range("lora", "alpha", self.alpha, lo=0.0, lo_open=True)
        names = [t.strip() for t in str(self.targets).split(",") if t.strip()]
        unknown = [t for t in names if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(
                f"lora.targets={self.targets!r}: unknown {unknown}; allowed: {list(LORA_TARGETS)}"
            )
        if not names:
            raise ConfigError(
                f"lora.targets={self.targets!r} names no weight; allowed: {list(LORA_TARGETS)}"
            )
        check_range("lora", "lr_scale", self.lr_scale, lo=0.0)
        # Off, the knobs would be ignored yet change the run id (and likely mean a
        # forgotten lora.enabled=true).
        if not self.enabled:
            for f in dataclasses.fields(self):
                if f.name != "enabled" and getattr(self, f.name) != f.default:
                    raise DependentKnobError(
                        f"lora.{f.name}={getattr(self, f.name)!r} needs lora.enabled=true "
                        "(or leave it at its default)",
                        knob=f"lora.{f.name}",
                        on=("lora.enabled",),
                    )
