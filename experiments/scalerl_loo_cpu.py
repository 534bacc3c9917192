"""`scalerl_loo` sized for a 2-core CPU: the tiny model on 2-digit addition."""

from rl_jax.grid import Budget, load_spec


def grid():
    return load_spec("scalerl_loo").replace(
        name="scalerl_loo_cpu",
        base={},  # the scalerl recipe is CPU-sized already
        budget=Budget(amount=64 * 40, unit="rollouts"),  # 40 steps of 8 x 8
        evals_per_run=5,
        # Runs take a minute or two: a checkpoint at the end only (a killed run restarts).
        checkpoints_per_run=0,
        warm_start=0.3,  # from the demo's supervised warm-up, as `rl-jax demo` does
        early_stop=None,
    )
