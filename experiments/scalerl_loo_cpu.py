"""`scalerl_loo` sized for a 2-core CPU: the tiny model on 2-digit addition."""

from rl_jax.grid import Budget, load_spec


def grid():
    return load_spec("scalerl_loo").replace(
        name="scalerl_loo_cpu",
        base={},  # the scalerl recipe is CPU-sized already
        budget=Budget(amount=128 * 400, unit="rollouts"),  # 400 steps of 16 x 8
        evals_per_run=8,
        # Runs take about two minutes: a checkpoint at the end only (a killed run restarts).
        checkpoints_per_run=0,
        warm_start=0.45,  # from the demo's supervised warm-up, as `rl-jax demo` does
        early_stop=None,
    )
