"""Math + code in one run (ScaleRL's generalization study) on Qwen3-1.7B, sized for one TPU
v5p-8 slice (4 chips): half of each batch from competition math (MATH layout, the math
verifier), half from code problems with tests (any code layout: MBPP, HumanEval, APPS /
TACO, LiveCodeBench or rl_jax's own; the sandboxed code verifier), a sigmoid per task.

The files are read from $RL_JAX_DATA (default: data/ beside the launch directory, as
qwen3_math reads its own; a bucket with RL_JAX_DATA=gs://BUCKET/data): math/train.jsonl and
code/train.jsonl. Each task holds out 256 validation problems; each evaluation samples
128 of each (val/math/pass@1, val/code/pass@1 and the mixture's val/pass@1).

    rl-jax plan code_mix_tpu model.path="''" --topology v5p:2x2x1 --memory-only   # fits
    RL_JAX_DATA=gs://BUCKET/data tpu_setup/launch.sh ... -- rl-jax train code_mix_tpu \
        mesh.distributed=true
    rl-jax fit runs/code_mix_tpu --x flops      # one fit per task: tasks.md

Programs run on the TPU hosts' CPUs, 32 at a time per host (rewards.workers), each in its
own sandbox (docs/code.md) with 4 s and 1 GiB. ScaleRL's choices otherwise, as
qwen3_math: CISPO, prompt-mean aggregation, batch-std advantages, FP32 LM head,
zero-variance filtering, No-Positive-Resampling, PipelineRL-4, no KL.
"""

import os

from rl_jax.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LossConfig,
    MeshConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)

DATA = os.environ.get("RL_JAX_DATA", "data").rstrip("/")
TOPOLOGY = "v5p-8"  # the slice the shapes below are sized for (tests/test_plan_recipes.py)


def mixture(data: str) -> str:
    return (
        f"{{math: {{source: file, path: '{data}/math/train.jsonl', format: math, "
        f"val_size: 256, weight: 1}}, "
        f"code: {{source: file, path: '{data}/code/train.jsonl', val_size: 256, weight: 1}}}}"
    )


def recipe() -> RunConfig:
    return RunConfig(
        name="code_mix_tpu",
        # bfloat16 weights and compute (float32 masters, FP32 LM head): the engine's KV
        # cache for 1024 + 2048 tokens is most of a chip's HBM.
        model=ModelConfig(
            preset="qwen3-1.7b",
            path="models/Qwen3-1.7B",
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            fp32_lm_head=True,
            remat="full",
            scan_layers=True,
            logprob_chunk=512,
        ),
        # Tensor parallel over the 4 chips (rl-jax plan --search ranks it first here).
        mesh=MeshConfig(data=1, fsdp=1, tensor=4),
        # Code problems state their task at length (LiveCodeBench, APPS): 1024 prompt tokens.
        # 256 decode slots (half a batch's rows at a time; the stream refills them).
        sampling=SamplingConfig(
            n=16,
            temperature=1.0,
            max_new_tokens=2048,
            max_prompt_len=1024,
            length_bucket=128,
            engine_slots=256,
        ),
        loss=LossConfig(name="cispo", aggregation="prompt", adv_norm="batch", eps_max=5.0),
        data=DataConfig(
            mixture=mixture(DATA),
            prompts_per_batch=32,
            zero_variance_filter=True,
            no_positive_resampling=True,
        ),
        rewards=RewardConfig(timeout_s=4.0, workers=32, code_memory_mb=1024),
        train=TrainConfig(
            steps=500,
            # 4 optimizer steps a batch, each accumulated over 8 micro-batches of 16 rows
            # (rl-jax plan --search: the same steps from smaller programs).
            updates_per_batch=32,
            grad_accum=8,
            off_policy="pipeline",
            off_policy_k=4,
            lr=1e-6,
            warmup_steps=0.02,
            schedule="constant",
            adam_eps=1e-15,
        ),
        eval=EvalConfig(every=25, k=8, num_prompts=256),
        checkpoint=CheckpointConfig(every=25),
        logging=LoggingConfig(samples_every=25),
    )
