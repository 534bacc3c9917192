"""Logging configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import check_range, knob


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = knob(True, help="write TensorBoard event files (tensorboardX)")
    wandb: bool = knob(False, help="log to Weights & Biases (if installed)")
    wandb_project: str = knob("rl_jax", help="W&B project name")
    progress: bool = knob(True, help="console progress bar")
    samples_every: int = knob(
        -1,
        help="every this many steps, a few (prompt, completion, reward, verdict) rows to "
        "<run>/samples.jsonl and TensorBoard text (-1 = at every eval.every, 0 = off)",
    )
    samples_rows: int = knob(4, help="rows written each time (one completion per prompt)")

    def __post_init__(self):
        check_range("logging", "samples_every", self.samples_every, lo=-1)
        check_range("logging", "samples_rows", self.samples_rows, lo=1, hi=1024)
