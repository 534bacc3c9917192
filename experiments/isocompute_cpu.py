"""`isocompute` sized for a 2-core CPU: the tiny model on arithmetic, splits by difficulty.

Easy = 1-digit, hard = 2-digit addition (the CPU stand-in for avg@16 bands);
n and B_p in {2, 4, 8} (hard: 4, 8 only for B_p) under B_max = 32 (easy) and 16 (hard),
all at one rollout budget. About 30 minutes on 2 cores with --jobs 2.
"""

from rl_jax.grid import Axis, Budget, load_spec


def grid():
    full = load_spec("isocompute")
    return full.replace(
        name="isocompute_cpu",
        base={
            **dict(full.base),
            "sampling.max_new_tokens": 10,
            "train.lr": 1e-3,
            "train.lr_sqrt_batch_ref": 16,
        },
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
        budget=Budget(amount=16 * 48, unit="rollouts"),
        evals_per_run=6,
        checkpoints_per_run=3,
    )
