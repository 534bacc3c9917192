"""ScaleRL's design choices added one at a time to the pre-ScaleRL baseline (arXiv 2510.13786 s3).

The baseline is the common recipe ScaleRL started from: DAPO loss with
asymmetric clipping, PPO-off-policy-8, sample-average aggregation, prompt-level
advantage normalization, bf16 LM head, no filters. Each variant changes one
axis: the loss type (CISPO, GSPO), the off-policy algorithm and k, loss
aggregation, advantage normalization, the FP32 LM head, and the zero-variance
and No-Positive-Resampling filters. Paper scale; `scalerl_forward_cpu` is the
2-core version. Point it at a model and data as in scalerl_loo.
"""

from rl_jax.grid import Axis, GridSpec, ReportSpec, load_spec
from rl_jax.scaling import PaperFinding

BASELINE = {
    "loss.name": "dapo",
    "train.off_policy": "ppo_off_policy",
    "train.off_policy_k": 8,
    "loss.aggregation": "sample",
    "loss.adv_norm": "prompt",
    "model.fp32_lm_head": False,
    "data.zero_variance_filter": False,
    "data.no_positive_resampling": False,
}

CHANGES = {
    "baseline": {},
    "loss=cispo": {"loss.name": "cispo"},
    "loss=gspo": {"loss.name": "gspo"},
    "offpolicy=pipeline-k8": {"train.off_policy": "pipeline"},
    "offpolicy=pipeline-k4": {"train.off_policy": "pipeline", "train.off_policy_k": 4},
    "offpolicy=pipeline-k16": {"train.off_policy": "pipeline", "train.off_policy_k": 16},
    "offpolicy=ppo-k1": {"train.off_policy": "on_policy", "train.off_policy_k": 1},
    "agg=prompt": {"loss.aggregation": "prompt"},
    "agg=token": {"loss.aggregation": "token"},
    "norm=batch": {"loss.adv_norm": "batch"},
    "norm=none": {"loss.adv_norm": "none"},
    "fp32head": {"model.fp32_lm_head": True},
    "zerovar": {"data.zero_variance_filter": True},
    "npr": {"data.no_positive_resampling": True},
}

# What the paper reports for each choice added to this baseline (PAPERS.md section 1; a
# direction the paper does not state is ''). Its abstract sums the ablations up: loss
# aggregation, normalization, curriculum and the off-policy algorithm "primarily modulate
# compute efficiency without materially shifting the asymptote".
PAPER = {
    "loss=cispo": PaperFinding("", "higher", "CISPO vs DAPO: B 2.01 vs 1.77"),
    "offpolicy=pipeline-k8": PaperFinding(
        "tie", "higher", "PipelineRL-8 vs PPO-off-policy-8: same A, higher B (less idle time)"
    ),
    "fp32head": PaperFinding("higher", "", "FP32 LM head: A 0.52 -> 0.61"),
    "agg=prompt": PaperFinding("higher", "", "prompt-average aggregation gave the highest A"),
    "norm=batch": PaperFinding(
        "tie", "tie", "batch, prompt or no std normalization perform about the same"
    ),
    "zerovar": PaperFinding("higher", "", "zero-variance filtering: higher A"),
    "npr": PaperFinding("higher", "higher", "No-Positive-Resampling: higher A and B"),
}


def grid() -> GridSpec:
    loo = load_spec("scalerl_loo")
    return GridSpec(
        name="scalerl_forward",
        recipe="scalerl",
        base={**dict(loo.base), **BASELINE},
        axes=(Axis.variants("change", CHANGES),),
        budget=loo.budget,
        evals_per_run=loo.evals_per_run,
        checkpoints_per_run=loo.checkpoints_per_run,
        report=ReportSpec(kind="compare", x="flops", baseline="baseline", paper=PAPER),
        description="ScaleRL choices added one at a time to the DAPO-era baseline",
    )
