"""The FP32 LM head ablation of `scalerl_loo` where it can act: both arms compute in bfloat16.

ScaleRL against `fp32head=off` at the paper's sizes, 3 seeds, with
`model.compute_dtype=bfloat16` on both arms (the weights and optimizer stay as the
recipe holds them: float32 masters), so that the arms differ only in whether the
final norm and the LM head run in float32. `scalerl_fp32head_bf16_cpu` is this pair
sized for a 2-core CPU (why each choice: its docstring).
"""

import dataclasses

from rl_jax.grid import Axis, load_spec

ARMS = ("scalerl", "fp32head=off")


def grid():
    loo = load_spec("scalerl_loo")
    (variants,) = loo.axes
    return loo.replace(
        name="scalerl_fp32head_bf16",
        base={**dict(loo.base), "model.compute_dtype": "bfloat16"},
        axes=(
            Axis(name=variants.name, points=tuple(p for p in variants.points if p.label in ARMS)),
        ),
        seeds=(0, 1, 2),
        report=dataclasses.replace(
            loo.report, paper={k: v for k, v in loo.report.paper if k in ARMS}
        ),
        description="ScaleRL vs fp32head=off under bfloat16 compute",
    )
