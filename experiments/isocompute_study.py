"""The IsoCompute grid as a study, at the paper's scale.

`isocompute` is already the paper's grid (n in 8..2048 x B_p in 32..1024 under
B_max, easy and hard splits); this names it as a study so that `rl-jax study
isocompute_study --from grids/isocompute_study --out DIR` tests the paper's
findings on its curves (rl_jax.scaling.analyse_isocompute).
`isocompute_study_cpu` is the study sized for a 2-core CPU.
"""

from rl_jax.grid import load_spec


def grid():
    return load_spec("isocompute").replace(name="isocompute_study")
