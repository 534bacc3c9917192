"""LoRA: low-rank adapters trained on a frozen base model."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_numbers, check_range, knob

# Weights an adapter can target: the layers' projections (stacked [L, ...]) and the
# untied LM head. A model may lack one (a tied head): preflight checks against the spec.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
DEFAULT_TARGETS = "q,k,v,o,gate,up,down"


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    enabled: bool = knob(False, help="train adapters on a frozen base (false: every weight)")
    rank: int = knob(8, help="adapter rank r (>= 1)")
    alpha: float = knob(16.0, help="adapter scale numerator: W + (alpha / r) A B")
    targets: str = knob(
        DEFAULT_TARGETS, help=f"comma-separated weights that get adapters, of {LORA_TARGETS}"
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

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
        # Off, the knobs would be ignored yet change the run id (and likely mean a
        # forgotten lora.enabled=true).
        if not self.enabled:
            for name, default in (("rank", 8), ("alpha", 16.0), ("targets", DEFAULT_TARGETS)):
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"lora.{name}={getattr(self, name)!r} needs lora.enabled=true "
                        "(or leave it at its default)"
                    )
