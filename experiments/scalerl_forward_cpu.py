"""`scalerl_forward` sized for a 2-core CPU: the tiny model on 2-digit addition."""

from rl_jax.grid import Axis, Budget, load_spec

# One alternative per axis of the full grid: 8 runs instead of 14.
KEEP = (
    "baseline",
    "loss=cispo",
    "offpolicy=pipeline-k8",
    "agg=prompt",
    "norm=batch",
    "fp32head",
    "zerovar",
    "npr",
)


def grid():
    full = load_spec("scalerl_forward")
    paper_sizes = dict(load_spec("scalerl_loo").base)
    (change,) = full.axes
    return full.replace(
        name="scalerl_forward_cpu",
        # The baseline's recipe choices carry over; the paper's sizes do not.
        base={k: v for k, v in full.base if k not in paper_sizes},
        axes=(Axis(name=change.name, points=tuple(p for p in change.points if p.label in KEEP)),),
        budget=Budget(amount=128 * 400, unit="rollouts"),  # 400 steps of 16 x 8
        evals_per_run=8,
        # Runs take about two minutes: a checkpoint at the end only (a killed run restarts).
        checkpoints_per_run=0,
        warm_start=0.45,  # from the demo's supervised warm-up, as `rl-jax demo` does
    )
