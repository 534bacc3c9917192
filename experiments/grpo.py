"""GRPO as in DeepSeekMath / DeepSeek-R1 (the ScaleRL paper's baseline).

Group-mean baseline normalized by the prompt's std, PPO clip 0.2 (symmetric),
sample-mean aggregation, k3 KL to the reference in the loss (coefficient 0.04),
on-policy.
"""

import dataclasses

from _cpu import CHECKPOINT, DATA, EVAL, MODEL, SAMPLING, TRAIN

from rl_jax.config import LossConfig, RunConfig


def recipe() -> RunConfig:
    return RunConfig(
        name="grpo",
        model=MODEL,
        sampling=SAMPLING,
        loss=LossConfig(
            name="grpo",
            aggregation="sample",
            adv_norm="prompt",
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.04,
            kl_estimator="k3",
        ),
        data=dataclasses.replace(DATA, zero_variance_filter=False, no_positive_resampling=False),
        train=TRAIN,
        eval=EVAL,
        checkpoint=CHECKPOINT,
    )
