"""The FP32 LM head where it can act: ScaleRL and `fp32head=off` under bfloat16 compute.

In `scalerl_study_cpu` the model computes in float32, so `fp32head=off` ran the
baseline's numbers bit for bit. Here both arms compute in bfloat16
(`model.compute_dtype=bfloat16`) and differ in one knob, `model.fp32_lm_head`:

- ScaleRL: the final RMSNorm and the [B, T, D] x [V, D] head matmul in float32,
  on the float32 weights;
- `fp32head=off`: both in bfloat16, the logits rounded to bfloat16 before the
  float32 softmax.

The mechanism the paper names acts here: CISPO's importance ratio divides the
trainer's log-probs (a full forward) by the sampler's (the KV-cache decode, a
different order of bfloat16 operations), and the head's rounding is part of
their mismatch.

Why the weights stay float32 (`model.param_dtype=float32`, `train.precision`
left at `fp32_master`): the model casts each weight to the compute dtype where
it uses it, so every bfloat16 matmul of the body sees the same bfloat16 weights
as a bfloat16 model with float32 masters would (docs/precision.md: identical
runs), and the optimizer keeps every small update in both arms. The one place
the arms differ is the head: in float32 on the float32 masters, as ScaleRL's
head, or in bfloat16. A bfloat16 `param_dtype` would also round the FP32 head's
weights to bfloat16 (a head in float32 arithmetic on bfloat16 values), and
`fp32_moments` or `pure` would lose small Adam steps in both arms alike, a
confound in neither arm's favour but noise in both.

Both arms of a seed start from the same supervised warm-up, the float32 one of
`scalerl_study_cpu` (`warm_start_overrides`): a warm-up in each arm's own
precision would stop at a different greedy pass rate per arm (0.55-0.75 across
seeds in the study), and that difference would swamp the head's. Each seed's two
runs thus share their start (the warm-up and the sampling seed), and the report
compares them seed by seed (`ReportSpec(paired=True)`), decided before the runs.
The study's budget, evaluations and eval size, 3 seeds (59.5 min with --jobs 2
on the loaded 2-core machine; a bfloat16 step costs about twice a float32 one
here, experiments/results/scalerl_cpu/README.md):

    rl-jax grid scalerl_fp32head_bf16_cpu --jobs 2 --out grids
    rl-jax study scalerl_fp32head_bf16_cpu --from grids/scalerl_fp32head_bf16_cpu \\
        --out experiments/results/scalerl_cpu/fp32head_bf16
"""

import dataclasses

from rl_jax.grid import load_spec


def grid():
    study = load_spec("scalerl_study_cpu")
    pair = load_spec("scalerl_fp32head_bf16")  # the two arms and the paper's finding
    return study.replace(
        name="scalerl_fp32head_bf16_cpu",
        base={**dict(study.base), "model.compute_dtype": "bfloat16"},
        axes=pair.axes,
        # The float32 warm-up of scalerl_study_cpu's baseline, for both arms.
        warm_start_overrides={"model.compute_dtype": "float32", "model.fp32_lm_head": True},
        # Each seed's two runs share the warm-up and the sampling seed: compared seed by seed.
        report=dataclasses.replace(study.report, paper=pair.report.paper, paired=True),
        description=pair.description,
    )
