"""Math + code in one run (ScaleRL's generalization study), sized for a 2-core CPU: the
tiny model on a mixture of 2-digit addition and the generated code task (one-operation
functions such as `plus(n)` returning n plus 7, four assert tests each), half of each
batch from each, every evaluation reporting val/arith/pass@1 and val/code/pass@1 beside
the mixture's val/pass@1.

The tiny model starts from random weights; a supervised warm-up on the tasks' answers
and reference programs gives RL groups with both right and wrong samples:

    python -m rl_jax.cli.warm_train --target 0.3 code_mix_cpu
    rl-jax fit runs/code_mix_cpu --metric val/code/pass@1    # or every task's: --per-task

GRPO-style group advantages with CISPO's truncated importance weights, prompt-mean
aggregation, zero-variance filtering, on-policy. experiments/results/code_mix_cpu/ has the
measured curves and fits; code_mix_tpu is the TPU-sized recipe (math and code files from a
bucket).
"""

from _cpu import CHECKPOINT

from rl_jax.config import (
    DataConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)


def recipe() -> RunConfig:
    return RunConfig(
        name="code_mix_cpu",
        model=ModelConfig(preset="tiny", fp32_lm_head=True),
        # A one-operation function is ~30 characters (`def plus(n):\n    return n + 7`);
        # an addition's answer 3. Rows end at EOS, so arithmetic rows stay short.
        sampling=SamplingConfig(n=8, temperature=1.0, max_new_tokens=40),
        loss=LossConfig(name="cispo", aggregation="prompt", adv_norm="batch", eps_max=5.0),
        data=DataConfig(
            mixture="{arith: {weight: 1}, code: {weight: 1, difficulty: 1}}",
            prompts_per_batch=16,
            train_size=2048,
            zero_variance_filter=True,
            no_positive_resampling=False,
        ),
        # Programs run in 2 sandbox workers (one per core); a program of the code task takes
        # ~30 ms, a hostile one its 2 s limit at most.
        rewards=RewardConfig(timeout_s=2.0, workers=2),
        train=TrainConfig(steps=200, lr=5e-5, warmup_steps=20, schedule="cosine"),
        # 32 prompts per task (the validation problems interleave the tasks).
        eval=EvalConfig(every=20, k=4, num_prompts=64),
        checkpoint=CHECKPOINT,
    )
