"""A run's per-chip memory and roofline time from formulas alone: the cheap first pass of
`rl-jax plan --search`, which compiles only the candidates this ranks best.

Nothing here is traced or compiled; every number is a closed form of the model's
shape, the batch and the mesh. The compiled plan (`plan_run`) is the truth; this
only has to order candidates and throw out the ones that are far from fitting.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.logprobs import chunk_size
from rl_jax.models.transformer import uses_blockwise
from rl_jax.plan._flops import train_flops
from rl_jax.plan.chips import Chip
from rl_jax.sampling._decoder import round_up
from rl_jax.train.accounting import TRAIN_PASSES, extra_forwards, forward_flops, sampler_rows
from rl_jax.train.evaluation import engine_shape
from rl_jax.train.params import ParamFormat, tree_bytes


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize if dtype != "bfloat16" else 2


def _split(n: int, ways: int) -> float:
    """Per-chip share of a dimension of size n split `ways` ways (replicated when the
    split is uneven, as `fit_spec` lays it out)."""
    return n / ways if n % ways == 0 else n


def sampler_axes(mesh: dict[str, int], sampler: int) -> tuple[int, int]:
    """(batch shards, tensor) of split mode's sampler mesh on `sampler` chips beside the
    trainer's `mesh`, as `make_meshes` lays it out: data-parallel, keeping the trainer's
    tensor axis where it divides them."""
    tensor = mesh["tensor"] if sampler % mesh["tensor"] == 0 else 1
    return sampler // tensor, tensor


def estimate(
    spec: Any, cfg: Any, mesh: dict[str, int], chip: Chip, sampler: int = 0
) -> dict[str, float]:
    """{"hbm_bytes": the larger of "train_bytes" (the update, with what stays beside it)
    and "sampler_bytes" (decoding) per chip, "parts": their terms below in bytes,
    "sampler_kv_bytes": the sampler's KV caches per chip, "step_s": roofline seconds
    of an RL step, "rollouts_per_hour", "mfu_estimate": the step's model FLOPs
    (sampling and training, as the compiled plan counts them) over the chips' peak for
    step_s} for a resolved RunConfig on a data x fsdp x tensor mesh, beside `sampler`
    chips of split mode's sampler (0: colocated).

    Memory per chip: the trainer's state (FSDP x tensor; float32 masters, LoRA adapters:
    rl_jax.train.params), AdamW moments of its trained part (+ accumulated gradients
    under train.grad_accum), their gradients, the sampler's view of the state when it
    is not the state itself, the minibatch's activations (all layers, or one
    layer's input each with full remat, its input and weight matmuls' outputs with
    save_dots; plus, in one layer's backward, its activations' gradients and, with
    remat, the activations it recomputes), fp32 logits of the completion,
    and the engine's KV caches (its slots and prefilled prompts, by default a slot for
    each row in flight: PipelineRL's W x B_p groups). Split, the sampler's chips hold
    the pushed view, the weights it runs and the caches, and nothing else; the trainer's
    the rest. Time: train, log-prob and prefill FLOPs at peak; decode at the larger of
    FLOPs and the bytes of the sampler's weights and the whole cache per decode step;
    colocated the sum, split the slower side plus the weight push (`Chip.push_s`)."""
    chips = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
    P, G, sc = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.sampling
    tp, tg = (round_up(n, sc.length_bucket) for n in (sc.max_prompt_len, sc.max_new_tokens))
    parts, kv, steps = _parts(spec, cfg, mesh, sampler, tp, tg)
    decode_bytes = (parts["sampler_weights"] + kv) * steps
    s_chips = sampler or chips
    train_s, sample_s, useful = _roofline(spec, cfg, chip, (chips, s_chips), tp, tg, decode_bytes)
    train = sum(parts[k] for k in _TRAINER_PARTS)
    if sampler:  # the sampler's chips: the pushed view, the weights it runs, the caches
        decode = parts["sampler_view"] + parts["sampler_weights"] + parts["sampler_kv"]
        step_s = max(train_s, sample_s) + chip.push_s(parts["sampler_view"], sampler, chips)
    else:
        decode = sum(parts[k] for k in _DECODE_PARTS)
        step_s = train_s + sample_s
    return {
        "hbm_bytes": float(max(train, decode)),
        "train_bytes": float(train),
        "sampler_bytes": float(decode),
        "parts": {k: float(v) for k, v in parts.items()},
        "sampler_kv_bytes": float(parts["sampler_kv"]),
        "step_s": float(step_s),
        "rollouts_per_hour": per_hour(P * G, step_s),
        "mfu_estimate": chip.mfu(useful / (chips + sampler), step_s),
    }


def per_hour(rollouts: int, step_s: float) -> float:
    """Rollouts per hour of RL steps of `rollouts` taking `step_s` (NaN where no time is
    known)."""
    return rollouts * 3600 / step_s if step_s > 0 else float("nan")


# What each side holds at its peak (`estimate`): the update with what stays beside it
# (the view is made for sampling and dropped before the updates), and colocated decoding.
_TRAINER_PARTS = ("params", "optimizer", "gradients", "activations", "logits", "in_flight")
_TRAINER_PARTS += ("reference",)
_DECODE_PARTS = ("params", "sampler_view", "sampler_weights", "sampler_kv", "optimizer")
_DECODE_PARTS += ("reference",)


def _parts(spec: Any, cfg: Any, mesh: dict[str, int], sampler: int, tp: int, tg: int):
    """({term: bytes per chip} of `estimate`, the slots' caches per sampler chip, decode
    steps per RL step). Split (`sampler` chips), "sampler_view" is the pushed view and
    "in_flight" is 0: the stream's caches are on the sampler's chips."""
    data, fsdp, tensor = mesh["data"], mesh["fsdp"], mesh["tensor"]
    shards = data * fsdp
    s_shards, s_tensor = sampler_axes(mesh, sampler) if sampler else (shards, tensor)
    P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
    rows_mb = math.ceil(P // M * G / shards)
    params, opt, grads, view = _state_bytes(spec, cfg, fsdp * tensor)
    acts, logits = _activation_bytes(spec, rows_mb, tp + tg, tg, tensor)
    kv, sampler_kv, steps = _kv_bytes(spec, cfg, s_shards, tp, tg, s_tensor)
    if sampler:
        view = spec.num_params() * _itemsize(spec.param_dtype) / s_tensor
    parts = {
        "params": params,
        "optimizer": opt,
        "gradients": grads,
        "activations": acts,
        "logits": logits,
        "in_flight": sampler_kv if cfg.train.off_policy == "pipeline" and not sampler else 0.0,
        "reference": params if cfg.loss.kl_coef > 0 else 0.0,
        "sampler_view": view,
        "sampler_weights": _decode_weights(spec, 1 if sampler else fsdp, s_tensor),
        "sampler_kv": sampler_kv,
    }
    return parts, kv, steps


def _decode_weights(spec: Any, fsdp: int, tensor: int) -> float:
    """The decode step's weights per chip (compute dtype): over `tensor`, and a mixture
    of experts' experts over `fsdp` too (they stay where they are stored:
    `rl_jax.models.moe.expert_parallel_moe_mlp`)."""
    n = spec.num_params()
    experts = len(spec.sparse_layers) * spec.num_experts * 3 * spec.hidden_size
    experts *= spec.moe_intermediate_size
    ways = fsdp if spec.is_moe and spec.num_experts % fsdp == 0 else 1  # as fit_spec splits
    return ((n - experts) / tensor + experts / (tensor * ways)) * _itemsize(spec.compute_dtype)


def _state_bytes(spec: Any, cfg: Any, ways: int) -> tuple[float, float, float, float]:
    """Per chip (the state split `ways` = fsdp x tensor ways): the trainer's state, its
    optimizer moments, its gradients, and the sampler's view of it (0 when the view is
    the state itself)."""
    plan = ParamFormat.from_config(cfg, spec)
    state = plan.abstract_state(spec)  # shapes only
    trained = sum(x.size for x in jax.tree.leaves(plan.split(state)[0]))
    params = tree_bytes(state) / ways
    grads = trained * jnp.dtype(plan.trained_dtype).itemsize / ways
    moments = 2 + (cfg.train.grad_accum > 1)
    opt = moments * trained * jnp.dtype(plan.moment_dtype).itemsize / ways
    view = 0.0 if plan.identity else spec.num_params() * _itemsize(spec.param_dtype) / ways
    return params, opt, grads, view


def _activation_bytes(spec: Any, rows_mb: int, T: int, tg: int, tensor: int):
    """(activations, logits) of one minibatch of `rows_mb` rows of T tokens per chip."""
    # A mixture of experts' token goes through k experts' widths (k x Fe).
    D, F, V, L = spec.hidden_size, spec.active_mlp_width, spec.vocab_size, spec.num_layers
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    cdt = _itemsize(spec.compute_dtype)
    per_token_layer = cdt * (4 * D + 2 * _split(H + 2 * K, tensor) * hd + 3 * _split(F, tensor))
    # Attention's fp32 probabilities per row and head: [T, T] (dense), or one (query
    # block, key block) pair's [block, block] (blockwise: `kernels.flash_attention`).
    block = min(T, spec.attention_block)
    keys = block * block / T if uses_blockwise(spec, T) else T
    per_token_layer += 4 * _split(H, tensor) * keys
    if spec.is_moe:  # its k dispatched copies in and out, and the router's fp32 logits
        sparse = len(spec.sparse_layers) / L
        per_token_layer += sparse * (
            cdt * 2 * spec.num_experts_per_tok * D + 4 * 2 * spec.num_experts
        )
    # Kept for the backward, per token and layer: everything (none), the layer's input
    # (full), or its input and its weight matmuls' outputs (save_dots). Live besides,
    # in the backward of a layer: its activations' gradients, and with remat the
    # activations it recomputes (the compiled 8B step of docs/results/tpu_plans.md peaks
    # there).
    if spec.remat == "full":
        acts = rows_mb * T * (2 * per_token_layer + cdt * D * L)
    elif spec.remat == "save_dots":
        saved = cdt * (3 * D + _split(H + 2 * K, tensor) * hd + 2 * _split(F, tensor))
        acts = rows_mb * T * (2 * per_token_layer + saved * L)
    else:
        acts = rows_mb * T * per_token_layer * (L + 1)
    # Logits, softmax, their gradient: the completion's, or one chunk's (logprob_chunk).
    logits_t = chunk_size(spec.logprob_chunk, tg, V) or tg
    return acts, rows_mb * logits_t * _split(V, tensor) * 4 * 3


def _kv_bytes(spec: Any, cfg: Any, shards: int, tp: int, tg: int, tensor: int):
    """(the engine's slots' KV caches, those and its prefilled prompts' caches, per chip;
    decode steps per RL step)."""
    cdt = _itemsize(spec.compute_dtype)
    kv_row = 2 * spec.num_layers * _split(spec.num_kv_heads, tensor) * spec.head_dim * cdt
    # The engine's slots, each a row's cache, and its pool of prefilled prompts;
    # PipelineRL's stream keeps them beside the update. Every step's P x n rows decode S
    # at a time.
    shape = engine_shape(cfg.sampling, rows=sampler_rows(cfg), shards=shards)
    slots, prompts = shape["slots"], round_up(shape["prefill_prompts"], shards)
    kv = kv_row * slots / shards * (tp + tg)
    sampler_kv = kv + kv_row * prompts / shards * tp
    steps = cfg.data.prompts_per_batch * cfg.sampling.n * tg / slots
    return kv, sampler_kv, steps


def _roofline(spec: Any, cfg: Any, chip: Chip, chips: tuple[int, int], tp, tg, decode_bytes):
    """(the trainer's seconds of an RL step, the sampler's, its model FLOPs): train and
    log-prob FLOPs at peak on the trainer's chips, prefill FLOPs on the sampler's, decode
    at the larger of its FLOPs and `decode_bytes` read at HBM bandwidth. `chips`: (the
    trainer's, the sampler's), the same chips when colocated."""
    P, G = cfg.data.prompts_per_batch, cfg.sampling.n
    fwd = forward_flops(spec, [tp] * P, [tg] * (P * G), G)
    train_fl = train_flops(spec, P, G, tp, tg)["expected"] + extra_forwards(cfg) * fwd
    train_s = train_fl / chips[0] / chip.bf16_flops
    sample_s = max(fwd / chips[1] / chip.bf16_flops, decode_bytes / chip.hbm_bandwidth)
    useful = (TRAIN_PASSES + extra_forwards(cfg) + 1) * fwd
    return train_s, sample_s, useful
