"""Pilot for the CPU ScaleRL study: baseline over a long budget, two seeds."""

from rl_jax.grid import Budget, load_spec
from rl_jax.grid.spec import Axis


def grid():
    return load_spec("scalerl_loo").replace(
        name="pilot",
        base={"eval.num_prompts": 512},
        axes=(Axis.of("data.difficulty", [2]),),
        seeds=(0, 1),
        budget=Budget(amount=128 * 1600, unit="rollouts"),
        evals_per_run=32,
        checkpoints_per_run=4,
        warm_start=0.45,
        early_stop=None,
    )
