"""`isocompute` sized for a 2-core CPU: the tiny model on arithmetic, splits by difficulty.

The `isocompute` recipe as it is (CPU-sized, lr 1.4e-4 at B = 1024 scaled by
sqrt(B_p * n / 1024)), from the demo's supervised warm-up. Easy = 1-digit,
hard = 2-digit addition (the CPU stand-in for avg@16 bands); n and B_p in
{2, 4, 8} under B_max = 32 (easy) and 16 (hard), all at one budget of 16,384
rollouts (512 to 4,096 steps): 14 runs of one to five minutes each, with
--jobs 2 about half an hour on 2 cores.
"""

from rl_jax.grid import Axis, Budget, load_spec


def grid():
    return load_spec("isocompute").replace(
        name="isocompute_cpu",
        base={},
        axes=(
            Axis.variants(
                "split",
                {
                    # 1-digit addition has 100 distinct problems: the sets must fit in them.
                    "easy": {"data.difficulty": 1, "data.train_size": 68, "data.val_size": 32},
                    "hard": {"data.difficulty": 2, "data.train_size": 4096, "data.val_size": 32},
                },
                vars={"easy": {"B_max": 32}, "hard": {"B_max": 16}},
            ),
            Axis.of("sampling.n", [2, 4, 8], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4, 8], short="bp"),
        ),
        budget=Budget(amount=16 * 1024, unit="rollouts"),
        evals_per_run=8,
        # Runs take a minute or two: a checkpoint at the end only (a killed run restarts).
        checkpoints_per_run=0,
        warm_start=0.45,
    )
