"""`scalerl_loo` sized for a 2-core CPU: the tiny model on 2-digit addition."""

from rl_jax.grid import Budget, load_spec


def grid():
    return load_spec("scalerl_loo").replace(
        name="scalerl_loo_cpu",
        base={},  # the scalerl recipe is CPU-sized already
        budget=Budget(amount=64 * 40, unit="rollouts"),  # 40 steps of 8 x 8
        evals_per_run=5,
        checkpoints_per_run=4,
        early_stop=None,
    )
