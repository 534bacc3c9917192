"""DAPO (Qwen2.5 style): clip-higher (0.2 / 0.28), token-mean aggregation, dynamic
sampling (resample until the batch holds B_p groups with reward variance), the soft
overlong penalty, no KL, on-policy.
"""

import dataclasses

from _cpu import CHECKPOINT, DATA, EVAL, MODEL, SAMPLING, TRAIN

from rl_jax.config import LossConfig, RewardConfig, RunConfig


def recipe() -> RunConfig:
    return RunConfig(
        name="dapo",
        model=MODEL,
        sampling=SAMPLING,
        loss=LossConfig(
            name="dapo", aggregation="token", adv_norm="prompt", eps_low=0.2, eps_high=0.28
        ),
        rewards=RewardConfig(name="auto", overlong_penalty=True, overlong_max=10, overlong_cache=4),
        data=dataclasses.replace(
            DATA,
            dynamic_sampling=True,
            max_resample_rounds=3,
            zero_variance_filter=True,
            no_positive_resampling=False,
        ),
        train=TRAIN,
        eval=EVAL,
        checkpoint=CHECKPOINT,
    )
