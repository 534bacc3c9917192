"""Logging configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import knob


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = knob(True, help="write TensorBoard event files (tensorboardX)")
    wandb: bool = knob(False, help="log to Weights & Biases (if installed)")
    wandb_project: str = knob("rl_jax", help="W&B project name")
    progress: bool = knob(True, help="console progress bar")
