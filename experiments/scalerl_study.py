"""The ScaleRL leave-one-out grid with 3 seeds per variant, at the paper's scale.

`scalerl_loo` runs one seed per variant; the paper reads its +-0.02 tie band on A
from three identical runs. With seeds, `rl-jax study scalerl_study --from
grids/scalerl_study --out DIR` classifies each component's effect on A and B
against the seed noise (rl_jax.scaling.analyse_study). `scalerl_study_cpu` is
this study sized for a 2-core CPU.
"""

from rl_jax.grid import load_spec


def grid():
    return load_spec("scalerl_loo").replace(name="scalerl_study", seeds=(0, 1, 2))
