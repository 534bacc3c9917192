"""PPO with a learned critic: a value head on the policy trunk, GAE advantages
(gamma = lambda = 1 for terminal rewards), clipped value loss, PPO clip 0.2,
token-mean aggregation, two minibatch updates per batch.
"""

import dataclasses

from _cpu import CHECKPOINT, DATA, EVAL, MODEL, SAMPLING, TRAIN

from rl_jax.config import LossConfig, RunConfig


def recipe() -> RunConfig:
    return RunConfig(
        name="ppo",
        model=dataclasses.replace(MODEL, value_head=True),
        sampling=SAMPLING,
        loss=LossConfig(
            name="ppo",
            aggregation="token",
            advantage="gae",
            adv_norm="batch",
            eps_low=0.2,
            eps_high=0.2,
            value_coef=0.5,
            value_clip=0.2,
            gamma=1.0,
            lam=1.0,
        ),
        data=dataclasses.replace(DATA, zero_variance_filter=False, no_positive_resampling=False),
        train=dataclasses.replace(TRAIN, updates_per_batch=2),
        eval=EVAL,
        checkpoint=CHECKPOINT,
    )
