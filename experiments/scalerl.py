"""ScaleRL (arXiv 2510.13786), sized for the CPU demo; scale it up with flags.

CISPO, prompt-mean aggregation, batch-std advantage normalization, FP32 LM
head, zero-variance filtering, No-Positive-Resampling, PipelineRL-8, forced
interruptions, no KL.
"""

from rl_jax.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)


def recipe() -> RunConfig:
    return RunConfig(
        name="scalerl",
        model=ModelConfig(preset="tiny", fp32_lm_head=True),
        sampling=SamplingConfig(
            n=8,
            temperature=1.0,
            max_new_tokens=10,
            length_control="interrupt",
            # Arithmetic answers take ~4 tokens: a row still going at 6-7 tokens is
            # interrupted with ";" and given 2 more tokens to answer.
            interrupt_lo=6,
            interrupt_hi=7,
            interrupt_text=";",
            answer_budget=2,
        ),
        loss=LossConfig(name="cispo", aggregation="prompt", adv_norm="batch", eps_max=5.0),
        data=DataConfig(
            source="arith",
            task="add",
            difficulty=2,
            prompts_per_batch=16,
            zero_variance_filter=True,
            no_positive_resampling=True,
        ),
        train=TrainConfig(
            steps=1000,
            off_policy="pipeline",
            off_policy_k=8,
            # On the tiny model, Adam steps of 1e-4 already move token probabilities
            # by 10x within PipelineRL's 8-step window and the run collapses; RL
            # wants a learning rate well below the warm-up's (1e-3). At 5e-5 and a
            # constant rate (the paper's) the late curve still has transient
            # collapses on 2 cores' small batches; a cosine decay keeps it monotone.
            lr=5e-5,
            warmup_steps=50,
            schedule="cosine",
            adam_eps=1e-15,
            weight_decay=0.01,
        ),
        eval=EvalConfig(every=50, k=4, num_prompts=128),
        # A kill loses at most 100 steps (about a minute on 2 cores; each checkpoint of
        # the tiny model is about 2 MB). PipelineRL drains its stream at each checkpoint.
        checkpoint=CheckpointConfig(every=100),
    )
