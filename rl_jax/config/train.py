"""Trainer, evaluation and checkpoint configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.config.sampling import MAX_SAMPLES
from rl_jax.knobs import (
    ConfigError,
    DependentKnobError,
    check_choice,
    check_numbers,
    check_range,
    knob,
)

OFF_POLICY = ("on_policy", "ppo_off_policy", "pipeline")
SCHEDULES = ("constant", "cosine")
# How the trainer holds what it updates. fp32_master: float32 weights and moments, the
# forward and the sampler run a copy in model.param_dtype. fp32_moments: the weights in
# model.param_dtype, float32 moments (updates rounded into them). pure: both in
# model.param_dtype (a bfloat16 update below half a weight's last bit is lost).
PRECISIONS = ("fp32_master", "fp32_moments", "pure")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = knob(100, help="RL steps (batches of B_p prompts x n samples)")
    updates_per_batch: int = knob(1, help="optimizer steps per batch (minibatches, M in ScaleRL)")
    grad_accum: int = knob(1, help="gradient accumulation micro-batches per optimizer step")
    off_policy: str = knob("on_policy", help=f"off-policy mode, one of {OFF_POLICY}")
    off_policy_k: int = knob(
        1,
        help="k of PPO-off-policy-k / PipelineRL-k (max staleness); 1 under on_policy (a "
        "recipe's k goes back to 1 when an override switches to on_policy: docs/knobs.md)",
    )
    pipeline_waves: int = knob(
        0,
        help="PipelineRL: W, batches untrained at once (W x B_p groups in flight on the "
        "stream; 0 = the most the staleness bound allows)",
    )
    lr: float = knob(1e-6, help="peak learning rate")
    lr_sqrt_batch_ref: int = knob(0, help="if > 0: lr *= sqrt(B_p * n / this) (IsoCompute)")
    schedule: str = knob("constant", help=f"after warm-up, one of {SCHEDULES}")
    warmup_steps: float = knob(
        0,
        help="linear warm-up: a count of steps (>= 1) or a fraction (< 1) of train.steps "
        "(0.05 of 1000 steps = 50)",
    )
    adam_b1: float = knob(0.9, help="AdamW beta1")
    adam_b2: float = knob(0.999, help="AdamW beta2")
    adam_eps: float = knob(1e-8, help="AdamW epsilon (ScaleRL: 1e-15)")
    weight_decay: float = knob(0.01, help="AdamW weight decay")
    grad_clip: float = knob(1.0, help="global-norm gradient clipping (0 = off)")
    precision: str = knob(
        "fp32_master",
        help=f"trained weights and optimizer moments, one of {PRECISIONS} (float32 master "
        "weights and moments; bf16 weights with float32 moments; all in model.param_dtype)",
    )
    max_nonfinite: int = knob(5, help="stop after this many consecutive NaN/Inf updates")
    seed: int = knob(0, help="RNG seed of sampling and initialization")

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run, the schedule's length: its minibatch updates
        over grad_accum (a last partial accumulation never steps), at least 1."""
        return max(1, self.steps * self.updates_per_batch // self.grad_accum)

    @property
    def warmup_count(self) -> int:
        """Warm-up steps: warmup_steps itself, or that fraction of train.steps."""
        w = self.warmup_steps
        return int(w) if w >= 1 or w == 0 else round(w * self.steps)

    def __post_init__(self):
        check_numbers("train", self)
        check_choice("train", "off_policy", self.off_policy, OFF_POLICY)
        check_choice("train", "schedule", self.schedule, SCHEDULES)
        check_choice("train", "precision", self.precision, PRECISIONS)
        for k in ("steps", "updates_per_batch", "grad_accum", "off_policy_k", "max_nonfinite"):
            check_range("train", k, getattr(self, k), lo=1)
        for k in ("pipeline_waves", "lr_sqrt_batch_ref", "warmup_steps", "seed"):
            check_range("train", k, getattr(self, k), lo=0)
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise ConfigError(
                f"train.warmup_steps={self.warmup_steps!r}: a count must be a whole number "
                "(or a fraction of train.steps below 1)"
            )
        for k in ("lr", "weight_decay", "grad_clip"):
            check_range("train", k, getattr(self, k), lo=0.0)
        # Adam's moment decay rates: 1 would never forget, above 1 diverges.
        check_range("train", "adam_b1", self.adam_b1, lo=0.0, hi=1.0, hi_open=True)
        check_range("train", "adam_b2", self.adam_b2, lo=0.0, hi=1.0, hi_open=True)
        # eps=0 makes a zero gradient's update 0/0 = NaN.
        check_range("train", "adam_eps", self.adam_eps, lo=0.0, lo_open=True)
        if self.off_policy == "on_policy" and self.off_policy_k != 1:
            raise DependentKnobError(
                f"train.off_policy_k={self.off_policy_k} needs train.off_policy in "
                f"{OFF_POLICY[1:]}, got 'on_policy'",
                knob="train.off_policy_k",
                on=("train.off_policy",),
            )
        # Only PipelineRL keeps W batches in flight; elsewhere the knob would be ignored
        # yet change the run id.
        if self.off_policy != "pipeline" and self.pipeline_waves != 0:
            raise DependentKnobError(
                f"train.pipeline_waves={self.pipeline_waves} needs train.off_policy='pipeline', "
                f"got {self.off_policy!r}; leave it at 0",
                knob="train.pipeline_waves",
                on=("train.off_policy",),
            )


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every: int = knob(10, help="evaluate every this many steps (0 = only at the end)")
    k: int = knob(16, help="samples per validation prompt (mean@k, best@k, worst@k)")
    num_prompts: int = knob(64, help="validation prompts per evaluation")
    temperature: float = knob(1.0, help="validation sampling temperature")
    at_start: bool = knob(True, help="evaluate before the first step (R0)")
    batch_rows: int = knob(
        0,
        help="rows (prompts x k) sampled at a time, whole prompts per batch; 0 = all at "
        "once. Memory only: every row's draws are its own, so the results do not change",
    )

    def __post_init__(self):
        check_numbers("eval", self)
        check_range("eval", "k", self.k, lo=1, hi=MAX_SAMPLES)
        check_range("eval", "every", self.every, lo=0)
        check_range("eval", "num_prompts", self.num_prompts, lo=1)
        check_range("eval", "temperature", self.temperature, lo=0.0)
        check_range("eval", "batch_rows", self.batch_rows, lo=0)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = knob(0, help="save every this many steps (0 = only at the end)")
    keep: int = knob(2, help="checkpoints to keep")
    async_save: bool = knob(True, help="save in the background")
    compress: bool = knob(
        False,
        help="zstd-compress the saved arrays (~8 percent smaller for float32 weights; the save "
        "then holds an encoded host copy of the whole state)",
    )
    resume: bool = knob(True, help="resume from the newest good checkpoint in the run directory")

    def __post_init__(self):
        check_numbers("checkpoint", self)
        check_range("checkpoint", "keep", self.keep, lo=1)
        check_range("checkpoint", "every", self.every, lo=0)
