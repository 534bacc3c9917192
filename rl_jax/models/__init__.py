"""Decoder-only policy model (Llama 3 / Qwen2 / Qwen3) in Flax NNX.

spec = resolve_spec(ModelConfig(preset="tiny"))
model = build_model(spec, mesh=mesh)                 # sharded random init
hidden, cache = model(tokens_bt, positions_bt, cache=cache, cache_index=i)
logits = model.logits(hidden)                        # float32 [B, T, V]
logp, ent = token_logprobs(model, tokens_bt, positions_bt, chunk=64)
"""

from rl_jax.models.hf import CheckpointError, export_hf, load_hf
from rl_jax.models.layers import attention_mask, logprobs_from_logits
from rl_jax.models.load import load_model, resolve_spec
from rl_jax.models.logprobs import logprobs_from_hidden, token_logprobs
from rl_jax.models.native import save_model
from rl_jax.models.spec import PRESETS, ModelSpec, RopeScaling
from rl_jax.models.tokenizer import HFTokenizer, load_tokenizer
from rl_jax.models.transformer import (
    KVCache,
    Transformer,
    build_model,
    host_params,
    init_cache,
    init_params,
    init_sharded_params,
    model_params,
    param_layout,
    param_shardings,
    positions_from_valid,
)

__all__ = [
    "CheckpointError",
    "HFTokenizer",
    "export_hf",
    "load_hf",
    "load_model",
    "load_tokenizer",
    "save_model",
    "PRESETS",
    "KVCache",
    "ModelSpec",
    "RopeScaling",
    "Transformer",
    "attention_mask",
    "build_model",
    "host_params",
    "init_cache",
    "init_params",
    "init_sharded_params",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "model_params",
    "param_layout",
    "param_shardings",
    "positions_from_valid",
    "resolve_spec",
    "token_logprobs",
]
