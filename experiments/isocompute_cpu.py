"""`isocompute` sized for a 2-core CPU: the tiny model on arithmetic, splits by difficulty.

The `isocompute` recipe as it is (CPU-sized, lr 1.4e-4 at B = 1024 scaled by
sqrt(B_p * n / 1024)), from the demo's supervised warm-up. Easy = 2-digit
addition answered least-significant digit first, hard = the same problems
answered in the usual order (the CPU stand-in for avg@16 bands; 4,096 training
and 128 validation problems each); n and B_p in {2, 4, 8} under B_max = 32
(easy) and 16 (hard), all at one budget of 16,384 rollouts (512 to 4,096
steps): 14 runs of one to five minutes each, with --jobs 2 about half an hour
on 2 cores.
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
                    # Answers least-significant digit first are much easier for a small
                    # model to learn than the usual order (carries flow the way it writes).
                    # (1-digit addition as the easy split does not work: its 100 problems
                    # leave ~70 to train on, which the warm-up memorizes, so every RL group
                    # is all-correct and validation never moves.)
                    "easy": {"data.reverse_digits": True},
                    "hard": {"data.reverse_digits": False},
                },
                vars={"easy": {"B_max": 32}, "hard": {"B_max": 16}},
            ),
            Axis.of("sampling.n", [2, 4, 8], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4, 8], short="bp"),
        ),
        budget=Budget(amount=16 * 1024, unit="rollouts"),
        evals_per_run=8,
        # Runs take a few minutes: a checkpoint at the end only (a killed run restarts).
        checkpoints_per_run=0,
        warm_start=0.45,
    )
