"""ScaleRL leave-one-out (arXiv 2510.13786): ScaleRL with each component reverted in turn.

Paper scale: 48 prompts x 16 samples, 12k thinking + 2k answer tokens with
forced interruptions, lr 5e-7 after 100 warm-up steps, mean@16 on 1,000
held-out prompts. Point it at a real model and data set, e.g.

    rl-jax grid scalerl_loo --set model.path=/ckpt/Qwen3-8B \\
        --set data.source=file --set data.path=/data/polaris.jsonl

Every variant sits within +-0.02 of ScaleRL's asymptote A in the paper; ScaleRL
has the highest B. The report compares each variant's fitted (A, B, C_mid)
with ScaleRL's. `scalerl_loo_cpu` is this grid sized for a 2-core CPU.
"""

from rl_jax.grid import Axis, Budget, EarlyStop, GridSpec, ReportSpec
from rl_jax.scaling import PaperFinding

# Each entry reverts one ScaleRL choice to the common alternative it beat.
REVERTED = {
    "scalerl": {},
    "loss=dapo": {"loss.name": "dapo"},
    "offpolicy=ppo": {"train.off_policy": "ppo_off_policy"},
    "fp32head=off": {"model.fp32_lm_head": False},
    "agg=sample": {"loss.aggregation": "sample"},
    "norm=prompt": {"loss.adv_norm": "prompt"},
    "zerovar=off": {"data.zero_variance_filter": False},
    "npr=off": {"data.no_positive_resampling": False},
}

# The paper's leave-one-out result (PAPERS.md section 1): every reverted variant lands within
# +-0.02 of ScaleRL's A, and ScaleRL has the highest B. Where the paper's forward ablations
# (adding the component to the pre-ScaleRL baseline) measured more, the note says so.
_LOO = "leave-one-out: A within +-0.02 of ScaleRL's, ScaleRL has the highest B"
PAPER = {
    "loss=dapo": PaperFinding("tie", "lower", f"{_LOO}; CISPO vs DAPO: B 2.01 vs 1.77"),
    "offpolicy=ppo": PaperFinding(
        "tie", "lower", f"{_LOO}; PipelineRL-8 vs PPO-off-policy-8: same A, higher B"
    ),
    "fp32head=off": PaperFinding(
        "tie", "lower", f"{_LOO}; added to the baseline, the FP32 head raised A 0.52 -> 0.61"
    ),
    "agg=sample": PaperFinding(
        "tie", "lower", f"{_LOO}; prompt-average aggregation gave the highest A when added"
    ),
    "norm=prompt": PaperFinding(
        "tie", "lower", f"{_LOO}; batch, prompt or no std normalization perform about the same"
    ),
    "zerovar=off": PaperFinding("tie", "lower", f"{_LOO}; zero-variance filtering raised A"),
    "npr=off": PaperFinding("tie", "lower", f"{_LOO}; No-Positive-Resampling raised A and B"),
}

# The paper's settings on top of the (CPU-sized) scalerl recipe.
PAPER_SIZES = {
    "sampling.n": 16,
    "data.prompts_per_batch": 48,
    "sampling.max_prompt_len": 1024,
    "sampling.max_new_tokens": 14336,
    "sampling.interrupt_lo": 10240,
    # 12,288 thinking tokens at most, less room for the injected text (Qwen3 tokenizes it
    # in about 20): the interruption, its text and the 2,048-token answer fit the 14,336.
    "sampling.interrupt_hi": 12288 - 64,
    "sampling.answer_budget": 2048,
    "sampling.interrupt_text": (
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    ),
    "train.lr": 5e-7,
    "train.warmup_steps": 100,
    "eval.k": 16,
    "eval.num_prompts": 1000,
}


def grid() -> GridSpec:
    return GridSpec(
        name="scalerl_loo",
        recipe="scalerl",
        base=PAPER_SIZES,
        axes=(Axis.variants("variant", REVERTED),),
        # About 5,000 steps of 768 rollouts, the length of the paper's 8B runs.
        budget=Budget(amount=768 * 5000, unit="rollouts"),
        evals_per_run=50,  # the paper evaluates every 100 steps
        checkpoints_per_run=50,
        report=ReportSpec(kind="compare", x="flops", baseline="scalerl", paper=PAPER),
        early_stop=EarlyStop(threshold=0.05, min_fraction=0.4),
        description="ScaleRL leave-one-out ablations",
    )
