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


class Crash(Exception):
    """Raised from a step hook: a run stopped after a step's metrics row, before its
    evaluation and checkpoint."""


def run_loop(trainer, crash_at: int | None = None):
    """`trainer.run_loop()`, or, with crash_at, the run stopped by Crash at that step."""
    import pytest

    if crash_at is None:
        trainer.run_loop()
        return trainer

    def hook(t):
        if t.step == crash_at:
            raise Crash

    trainer.step_hooks.append(hook)
    with pytest.raises(Crash):
        trainer.run_loop()
    return trainer


if __name__ == "__main__":
    sys.exit(main())


def even_first_mass(trainer, weights, num_prompts: int = 16) -> float:
    """The probability a policy with `weights` gives an even digit as the first token of
    its answer, averaged over validation prompts: what the verifier rewards, read off the
    model instead of sampled (a learning signal without sampling noise)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rl_jax.models import Transformer, positions_from_valid

    tok = trainer.tokenizer
    ids = [tok.encode(p.prompt) for p in trainer.parts.val_problems[:num_prompts]]
    T = max(map(len, ids))
    tokens = np.full((len(ids), T), tok.pad_id, np.int32)
    valid = np.zeros((len(ids), T), bool)
    for i, x in enumerate(ids):  # left-padded, as the sampler feeds them
        tokens[i, T - len(x) :] = x
        valid[i, T - len(x) :] = True
    model = Transformer(trainer.spec, dict(weights))
    valid = jnp.asarray(valid)
    h, _ = model(jnp.asarray(tokens), positions_from_valid(valid), kv_valid_bs=valid)
    p = jax.nn.softmax(model.logits(h[:, -1:])[:, 0], axis=-1)
    even = [tok.encode(c)[0] for c in "02468"]
    return float(np.asarray(p[:, even].sum(axis=-1)).mean())
