"""RL on Qwen3-1.7B with competition math, sized for one TPU v5p-8 slice (4 chips).

ScaleRL's choices (CISPO, prompt-mean aggregation, batch-std advantages, FP32 LM head,
zero-variance filtering, No-Positive-Resampling, no KL) on MATH-layout problems
({"problem", "solution" with \\boxed{}}); rewards.name=auto picks the math verifier from the
file. The paths are relative to the launch directory (the home directory of every TPU host,
tpu_setup/README.md "Inputs"): the HF checkpoint in models/Qwen3-1.7B, the problems in
data/math/train.jsonl; or read from a bucket with model.path=gs://BUCKET/models/Qwen3-1.7B
data.path=gs://BUCKET/data/math/train.jsonl (what a `rl-jax grid --backend tpu` run needs).

    rl-jax plan qwen3_math --topology v5p-8      # HBM per chip and hours, from any host
    tpu_setup/launch.sh ... -- rl-jax train qwen3_math mesh.distributed=true

(A plan on a machine without models/Qwen3-1.7B plans the preset's shapes, which equal the
released config.json's, and says so.) How it fits the v5p-8's 4 chips: FSDP over them;
bfloat16 weights and activations, the FP32 LM head, float32 master weights, Adam moments
and accumulated gradients (27.5 GB, 6.9 GB a chip); full remat; each batch's 4 optimizer
steps taken from 16 micro-batches of 2 prompts' 32 rows (8 rows x 2,560 tokens per chip
each); PipelineRL-4 with 4 steps a batch keeps one batch in flight, a slot for each of its
512 rows (a bfloat16 KV cache of 37.6 GB a chip, beside the update). Compiled, its largest
program needs 54.6 GB a chip of the 91.8 GB that fit (docs/results/tpu_plans.md,
"The shipped TPU recipes").
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

TOPOLOGY = "v5p-8"  # the slice the shapes below are sized for (tests/test_plan_recipes.py)


def recipe() -> RunConfig:
    return RunConfig(
        name="qwen3_math",
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
            # 4 optimizer steps a batch (PipelineRL's k counts these), each from 4
            # micro-batches: the same updates from programs a quarter the size.
            updates_per_batch=16,
            grad_accum=4,
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
