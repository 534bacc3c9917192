"""Compute accounting: every counter a curve can be fitted against (DESIGN.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ComputeCounters:
    """Cumulative counters; `add` returns the per-step increments for logging."""

    rollouts: int = 0  # completed sampled rows used for training
    prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    sampler_flops: float = 0.0
    trainer_flops: float = 0.0
    eval_flops: float = 0.0
    device_seconds: float = 0.0  # wall seconds x devices, training work only
    eval_device_seconds: float = 0.0

    @property
    def flops(self) -> float:
        """Training compute (sampler + trainer); evaluation is accounted separately."""
        return self.sampler_flops + self.trainer_flops

    def add(self, **inc) -> dict[str, float]:
        for k, v in inc.items():
            if not hasattr(self, k):
                raise KeyError(f"unknown compute counter {k!r}")
            setattr(self, k, getattr(self, k) + v)
        return inc

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["flops"] = self.flops
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ComputeCounters:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
