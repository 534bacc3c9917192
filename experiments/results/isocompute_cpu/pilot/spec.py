from rl_jax.grid import Axis, Budget, load_spec


def grid():
    base = load_spec("isocompute_cpu")
    return base.replace(
        name="iso_pilot",
        axes=(
            Axis.variants(
                "split", {"easy": {"data.reverse_digits": True}}, vars={"easy": {"B_max": 1024}}
            ),
            Axis.of("sampling.n", [2, 32], short="n"),
            Axis.of("data.prompts_per_batch", [2, 16], short="bp"),
        ),
        budget=Budget(amount=4096, unit="rollouts"),
        evals_per_run=4,
    )
