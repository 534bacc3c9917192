"""ScaleRL (arXiv 2510.13786) at the paper's scale: Qwen3-8B, sized for a TPU v5p-128 slice.

The `scalerl` recipe's choices (CISPO, prompt-mean aggregation, batch-std advantage
normalization, FP32 LM head, zero-variance filtering, No-Positive-Resampling,
PipelineRL-8, forced interruptions, no KL) at the paper's sizes (`scalerl_loo`'s
PAPER_SIZES): 48 prompts x 16 samples, 1,024 prompt + 14,336 new tokens (interrupted
after 10,240 to 12,224 thinking tokens, then 2,048 to answer), lr 5e-7 after 100
warm-up steps, the paper's constant schedule, 7,400 steps (its 8B run), bfloat16 weights
with float32 masters. Math problems in the MATH layout, as `qwen3_math` (the paper's
Polaris-53K in that layout); paths are relative to the launch directory
(tpu_setup/README.md "Inputs"), or gs:// URLs.

How it fits a v5p-128 (64 chips, docs/results/tpu_plans.md "Qwen3-8B with the ScaleRL recipe"):
a 1x8x8 mesh (FSDP 8 x tensor 8), full remat, each batch's one optimizer step taken as
48 micro-batches of one prompt's 16 rows (train.updates_per_batch=48
train.grad_accum=48: 2 rows x 15,360 tokens per chip each), PipelineRL's 9 batches in
flight (train.pipeline_waves=9) on 864 engine slots (an eighth of their rows). None of
these change what the run learns.

    rl-jax plan scalerl_8b --topology v5p-128              # per-chip HBM, hours: any host
    rl-jax plan scalerl_8b --topology v5p-128 --search     # other meshes and knobs
    tpu_setup/launch.sh ... -- rl-jax train scalerl_8b mesh.distributed=true

A plan on a machine without models/Qwen3-8B plans the preset's shapes, which are the
released checkpoint's.
"""

import dataclasses

from scalerl import recipe as scalerl_recipe
from scalerl_loo import PAPER_SIZES

from rl_jax.config import CheckpointConfig, DataConfig, LoggingConfig, MeshConfig, RunConfig

TOPOLOGY = "v5p-128"  # the slice the shapes below are sized for (tests/test_plan_recipes.py)


def _paper(section: str) -> dict:
    """PAPER_SIZES' knobs of one config section (`sampling.n` -> {"n": 16})."""
    return {k.split(".", 1)[1]: v for k, v in PAPER_SIZES.items() if k.startswith(section + ".")}


def recipe() -> RunConfig:
    cfg = scalerl_recipe()
    return dataclasses.replace(
        cfg,
        name="scalerl_8b",
        model=dataclasses.replace(
            cfg.model,
            preset="qwen3-8b",
            path="models/Qwen3-8B",
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            remat="full",
            scan_layers=True,
        ),
        mesh=MeshConfig(data=1, fsdp=8, tensor=8),
        sampling=dataclasses.replace(cfg.sampling, **_paper("sampling"), engine_slots=864),
        data=DataConfig(
            source="file",
            path="data/math/train.jsonl",
            val_size=PAPER_SIZES["eval.num_prompts"],
            zero_variance_filter=cfg.data.zero_variance_filter,
            no_positive_resampling=cfg.data.no_positive_resampling,
            **_paper("data"),
        ),
        train=dataclasses.replace(
            cfg.train,
            **_paper("train"),
            steps=7400,
            schedule="constant",
            updates_per_batch=48,
            grad_accum=48,
            pipeline_waves=9,
        ),
        eval=dataclasses.replace(cfg.eval, **_paper("eval"), every=100),
        checkpoint=CheckpointConfig(every=100),
        logging=LoggingConfig(samples_every=100),
    )
