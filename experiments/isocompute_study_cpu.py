"""The CPU IsoCompute study: `isocompute_cpu` widened to n in 2..32 and B_p in 2..16.

Run it (with --jobs 2 on the 2-core machine; the time is in
experiments/results/isocompute_cpu/README.md) and rebuild its report from the curves:

    rl-jax grid isocompute_study_cpu --jobs 2 --out grids
    rl-jax study isocompute_study_cpu --from grids/isocompute_study_cpu \
        --out experiments/results/isocompute_cpu

The choices come from a pilot (n in {2, 32} x B_p in {2, 16} on the easy split at
4,096 rollouts, experiments/results/isocompute_cpu/README.md):
- at 4,096 rollouts the smallest batch led (n = 2, B_p = 2: 0.338 -> 0.572) and
  n = 32 trailed (0.412-0.479): the frontier's n* can only move if the budget is
  several times larger, so every run gets 24,576 rollouts (6,144 steps at
  B = 4, 48 at B = 512);
- 16 evaluations per run (every 1,536 rollouts) span a 16x range of compute for
  the frontier and n*(C); each evaluation is 128 problems x k = 4;
- n over five powers of 2 and B_p over four; B_p x n <= B_max with B_max = 512
  on the easy split (every cell) and 128 on the hard one (as the paper's hard
  B_max is a quarter of its easy one): 37 runs of one seed;
- the step cost on 2 cores is about 50 ms at B = 4 and 2 s at B = 512, so the
  small-batch cells take the longest (about 6 minutes each).
"""

from rl_jax.grid import Axis, Budget, load_spec

BUDGET = 24 * 1024  # rollouts per run


def grid():
    return load_spec("isocompute_cpu").replace(
        name="isocompute_study_cpu",
        axes=(
            Axis.variants(
                "split",
                {
                    "easy": {"data.reverse_digits": True},
                    "hard": {"data.reverse_digits": False},
                },
                vars={"easy": {"B_max": 512}, "hard": {"B_max": 128}},
            ),
            Axis.of("sampling.n", [2, 4, 8, 16, 32], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4, 8, 16], short="bp"),
        ),
        budget=Budget(amount=BUDGET, unit="rollouts"),
        evals_per_run=16,
    )
