"""Shared CPU sizing of the recipes: the tiny model on the built-in arithmetic task.

Each recipe keeps its own algorithmic choices and takes these sizes, so every
recipe runs on a 2-core CPU by default (a few minutes from the demo's warm-up)
and scales up with flags (model.path=..., data.source=file,
sampling.max_new_tokens=..., ...).
"""

from rl_jax.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    SamplingConfig,
    TrainConfig,
)

MODEL = ModelConfig(preset="tiny")
DATA = DataConfig(source="arith", task="add", difficulty=2, prompts_per_batch=16)
SAMPLING = SamplingConfig(n=8, temperature=1.0, max_new_tokens=10)
# RL on the tiny model wants a learning rate far below its supervised warm-up's
# (1e-3): at 1e-4 Adam's steps already move token probabilities 10x within a few
# updates and runs collapse. The cosine decay keeps small-batch curves monotone
# at their end (recipes that follow a paper's constant schedule say so).
TRAIN = TrainConfig(steps=1000, lr=5e-5, warmup_steps=50, schedule="cosine")
EVAL = EvalConfig(every=50, k=4, num_prompts=128)
# A kill loses at most 100 steps (about a minute on 2 cores); the tiny model's checkpoint
# (weights and Adam moments) is about 2 MB, two kept.
CHECKPOINT = CheckpointConfig(every=100)
