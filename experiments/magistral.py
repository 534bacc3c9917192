"""Magistral (Mistral) style GRPO: no KL, clip-higher (eps_high 0.28), token-level
loss normalization, advantages normalized over the batch, groups with zero
advantage filtered out.
"""

import dataclasses

from _cpu import CHECKPOINT, DATA, EVAL, MODEL, SAMPLING, TRAIN

from rl_jax.config import LossConfig, RunConfig


def recipe() -> RunConfig:
    return RunConfig(
        name="magistral",
        model=MODEL,
        sampling=SAMPLING,
        loss=LossConfig(
            name="grpo", aggregation="token", adv_norm="batch", eps_low=0.2, eps_high=0.28
        ),
        data=dataclasses.replace(DATA, zero_variance_filter=True, no_positive_resampling=False),
        train=TRAIN,
        eval=EVAL,
        checkpoint=CHECKPOINT,
    )
