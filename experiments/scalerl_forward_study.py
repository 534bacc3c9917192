"""ScaleRL's forward ablations with 3 seeds per variant, at the paper's scale.

`scalerl_forward` adds each ScaleRL choice to the DAPO-era baseline with one seed;
the paper reads its +-0.02 tie band on A from three identical runs. With seeds,
`rl-jax study scalerl_forward_study --from grids/scalerl_forward_study --out DIR`
classifies each choice's effect on A and B against the seed noise
(rl_jax.scaling.analyse_study). `scalerl_forward_study_cpu` is this study sized for
a 2-core CPU.
"""

from rl_jax.grid import load_spec


def grid():
    return load_spec("scalerl_forward").replace(name="scalerl_forward_study", seeds=(0, 1, 2))
