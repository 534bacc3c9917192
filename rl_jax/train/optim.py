"""Optimizer and learning-rate schedule (optax)."""

from __future__ import annotations

import math

import optax

from rl_jax.config import TrainConfig


def peak_lr(
    cfg: TrainConfig, *, prompts_per_batch: int, samples_per_prompt: int, lr_scale: float = 1.0
) -> float:
    """cfg.lr, times sqrt(B / ref) when lr_sqrt_batch_ref > 0 (IsoCompute: lr ~ sqrt(B_p * n)),
    times lr_scale (LoRA's: `LoraConfig.lr_factor`)."""
    lr = cfg.lr * lr_scale
    if cfg.lr_sqrt_batch_ref <= 0:
        return lr
    return lr * math.sqrt(prompts_per_batch * samples_per_prompt / cfg.lr_sqrt_batch_ref)


def lr_schedule(cfg: TrainConfig, peak: float, total_updates: int) -> optax.Schedule:
    """Linear warm-up (update s < W gets peak * (s + 1) / W), then constant or cosine."""
    warm = cfg.warmup_count
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:  # cosine, validated in TrainConfig
        after = optax.cosine_decay_schedule(peak, decay_steps=max(1, total_updates - warm))
    if warm == 0:
        return after
    return optax.join_schedules(
        [optax.linear_schedule(peak / warm, peak, max(warm - 1, 0)), after], boundaries=[warm]
    )


def make_optimizer(
    cfg: TrainConfig, *, prompts_per_batch: int, samples_per_prompt: int, lr_scale: float = 1.0
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with global-norm clipping; gradient accumulation via optax.MultiSteps. The
    schedule counts optimizer steps (MultiSteps steps the inner AdamW, and its schedule,
    once per train.grad_accum minibatch updates): `TrainConfig.optimizer_steps`. lr_scale
    multiplies the rate (LoRA's adapters: `LoraConfig.lr_factor`)."""
    peak = peak_lr(
        cfg,
        prompts_per_batch=prompts_per_batch,
        samples_per_prompt=samples_per_prompt,
        lr_scale=lr_scale,
    )
    sched = lr_schedule(cfg, peak, cfg.optimizer_steps)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(
            sched,
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
    )
    tx = optax.chain(*parts)
    if cfg.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum)
    return tx, sched
