"""The CPU ScaleRL forward study: ScaleRL's choices added one at a time to the DAPO-era
baseline (`scalerl_forward_cpu`), 3 seeds, with the design of `scalerl_study_cpu`.

Run it (1 h 35 min with --jobs 2 on the 2-core machine) and rebuild its report from
the curves (experiments/results/scalerl_cpu/README.md says what it shows):

    rl-jax grid scalerl_forward_study_cpu --jobs 2 --out grids
    rl-jax study scalerl_forward_study_cpu --from grids/scalerl_forward_study_cpu \\
        --out experiments/results/scalerl_cpu/forward

Everything that sizes a run is the leave-one-out study's (its docstring says why:
constant learning rate, 6,144 training problems, 800 steps of 16 prompts x 8
samples, 24 evaluations of 512 prompts x k = 4, 3 seeds, fits from 10% of compute
with R0 fitted), so that the two studies' curves line up step for step and their
seed noise can be compared.

What differs from the leave-one-out study, decided before the runs:
- The FP32 head is left out: the tiny model computes in float32, where the head's
  precision changes nothing (the leave-one-out study's `fp32head=off` runs were
  its baseline's bit for bit). `scalerl_fp32head_bf16_cpu` is the pair where it acts.
- The report compares recipes seed by seed (`ReportSpec(paired=True)`): each seed's
  runs start from the same supervised warm-up (the warm-up's knobs are the same in
  every variant) and the same sampling seed, so the seed's start, the largest part
  of the leave-one-out study's seed noise, cancels from each difference.
"""

import dataclasses

from rl_jax.grid import Axis, load_spec

STUDY = load_spec("scalerl_study_cpu")  # the design both CPU studies share


def grid():
    forward = load_spec("scalerl_forward_cpu")
    (change,) = forward.axes
    kept = tuple(p for p in change.points if p.label != "fp32head")
    return forward.replace(
        name="scalerl_forward_study_cpu",
        base={**dict(forward.base), **dict(STUDY.base)},
        axes=(Axis(name=change.name, points=kept),),
        seeds=STUDY.seeds,
        budget=STUDY.budget,
        evals_per_run=STUDY.evals_per_run,
        checkpoints_per_run=STUDY.checkpoints_per_run,
        report=dataclasses.replace(
            STUDY.report,
            baseline=forward.report.baseline,
            paper={k: v for k, v in forward.report.paper if k != "fp32head"},
            paired=True,
        ),
        description="ScaleRL's choices added one at a time, 3 seeds, 2-core CPU",
    )
