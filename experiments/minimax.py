"""MiniMax-M1 style: CISPO (truncated IS weight, eps_max 5) with token-mean
aggregation and PPO-off-policy-k (k = 2 minibatches sampled with the same weights,
then k updates), no KL.
"""

import dataclasses

from _cpu import CHECKPOINT, DATA, EVAL, MODEL, SAMPLING, TRAIN

from rl_jax.config import LossConfig, RunConfig


def recipe() -> RunConfig:
    return RunConfig(
        name="minimax",
        model=MODEL,
        sampling=SAMPLING,
        loss=LossConfig(name="cispo", aggregation="token", adv_norm="prompt", eps_max=5.0),
        data=dataclasses.replace(DATA, no_positive_resampling=False),
        train=dataclasses.replace(TRAIN, off_policy="ppo_off_policy", off_policy_k=2),
        eval=EVAL,
        checkpoint=CHECKPOINT,
    )
