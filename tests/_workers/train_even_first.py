"""`rl-jax ...` with the tests' `test_even_first` verifier registered (see test_train_loop)."""

import sys

from rl_jax.cli import main
from rl_jax.rewards._registry import _REGISTRY, _LocalRewardFn, register

if "test_even_first" not in _REGISTRY:

    @register("test_even_first")
    def _even_first(scale, timeout_s, workers):
        return _LocalRewardFn(
            "test_even_first",
            scale,
            score=lambda c, a: float(c[:1] in "02468"),
            well_formed=lambda c: True,
        )


# The tiny RL run the trainer tests share (with this verifier, a random policy's
# samples disagree within a group, so every step has a learning signal).
TINY_RUN = [
    "model.preset=tiny",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "rewards.name=test_even_first",
    "data.prompts_per_batch=4",
    "data.train_size=64",
    "data.val_size=8",
    "sampling.n=4",
    "sampling.max_new_tokens=6",
    "sampling.length_control=truncate",
    "eval.k=2",
    "eval.num_prompts=8",
    "train.lr=1e-3",
    "train.off_policy=on_policy",
    "train.off_policy_k=1",
    "logging.progress=false",
    "logging.tensorboard=false",
    "data.no_positive_resampling=false",
]


if __name__ == "__main__":
    sys.exit(main())
