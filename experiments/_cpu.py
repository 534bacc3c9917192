"""Shared CPU sizing of the recipes: the tiny model on the built-in arithmetic task.

Each recipe keeps its own algorithmic choices and takes these sizes, so every
recipe runs on a 2-core CPU by default and scales up with flags
(model.path=..., data.source=file, sampling.max_new_tokens=..., ...).
"""

from rl_jax.config import DataConfig, EvalConfig, ModelConfig, SamplingConfig, TrainConfig

MODEL = ModelConfig(preset="tiny")
DATA = DataConfig(source="arith", task="add", difficulty=2, prompts_per_batch=8)
SAMPLING = SamplingConfig(n=8, temperature=1.0, max_new_tokens=10)
TRAIN = TrainConfig(steps=60, lr=1e-3, warmup_steps=5)
EVAL = EvalConfig(every=10, k=4, num_prompts=64)
