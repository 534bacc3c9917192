"""RL on Qwen3-1.7B with competition math, sized for one TPU v5p-8 slice (4 chips).

ScaleRL's choices (CISPO, prompt-mean aggregation, batch-std advantages, FP32 LM head,
zero-variance filtering, No-Positive-Resampling, no KL) on MATH-layout problems
({"problem", "solution" with \\boxed{}}); rewards.name=auto picks the math verifier from the
file. The paths are relative to the launch directory (the home directory of every TPU host,
tpu_setup/README.md "Inputs"): the HF checkpoint in models/Qwen3-1.7B, the problems in
data/math/train.jsonl; or read from a bucket with model.path=gs://BUCKET/models/Qwen3-1.7B
data.path=gs://BUCKET/data/math/train.jsonl (what a `rl-jax grid --backend tpu` run needs).

    rl-jax plan qwen3_math model.path="''" --topology v5p:2x2x1   # HBM per chip, any host
    tpu_setup/launch.sh ... -- rl-jax train qwen3_math mesh.distributed=true

(`model.path=''` plans with the preset's shapes, which equal the released config.json's, when
the checkpoint is not on the planning machine.) The mesh is FSDP over the 4 chips; params,
Adam moments and gradients of 1.7B parameters in float32 are 27 GB, sharded to 7 GB a chip.
"""

from rl_jax.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LossConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)


def recipe() -> RunConfig:
    return RunConfig(
        name="qwen3_math",
        model=ModelConfig(
            preset="qwen3-1.7b",
            path="models/Qwen3-1.7B",
            fp32_lm_head=True,
            remat="full",
            scan_layers=True,
            logprob_chunk=512,
        ),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        sampling=SamplingConfig(
            n=16, temperature=1.0, max_new_tokens=2048, max_prompt_len=512, length_bucket=128
        ),
        loss=LossConfig(name="cispo", aggregation="prompt", adv_norm="batch", eps_max=5.0),
        data=DataConfig(
            source="file",
            path="data/math/train.jsonl",
            val_size=256,
            prompts_per_batch=32,
            zero_variance_filter=True,
            no_positive_resampling=True,
        ),
        train=TrainConfig(
            steps=500,
            updates_per_batch=4,
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
