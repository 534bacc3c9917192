"""The one forward's decode entry point: one token per row through every layer, over the
engine's paged KV cache, laid out for a `while_loop` (`rl_jax.sampling.Engine`'s).

The math is the model's (`rl_jax.models.layers`: the same RMSNorm, RoPE,
grouped-query attention with float32 scores, SwiGLU, LM head); what differs is the
layout, chosen so a decode step does few copies. Like every forward, the step
scans over the layers (`lax.scan`): its program does not grow with depth.

    ops = kernels.for_mesh(mesh).decode_ops(compute_dtype=..., head_dim=..., ...)
    cache = ...  # zeros of ops.paged_shapes(...); prompts' keys and values written
                 # into their rows' pages by ops.write_prompt (the engine's prefill)
    w = decode_weights(spec, params, positions, ops=ops)  # once per call, outside the loop
    logits_bv, cache = decode_step(spec, w, cache, tokens_b, positions_b, pages, ops=ops)

* Weights are stacked [L, ...] with q/k/v and gate/up concatenated into one matmul
  each, in the compute dtype; `ops.prepare` lays them out for its kernels. A mixture
  of experts' MLP is the model's `moe_mlp` on the step's B tokens (dropless, as in
  training), its experts' weights as they are, its grouped matmuls `ops.grouped_matmul`.
* The cache's layout and the hot ops are the platform's (`rl_jax.kernels`):
  `xla.Decode`, the reference (a row's table read at once, or long ones in blocks of
  pages on CPU), or a platform's own (`cpu.Decode`: C++ kernels, keys in tiles, packed
  weights; `tpu.Decode`: the Pallas paged attention kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.kernels.xla import Decode, PagedKV, Pages
from rl_jax.models.layers import rms_norm, rope_angles, rope_table
from rl_jax.models.moe import moe_block, moe_mlp
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import (
    DENSE_MLP,
    LAYER_PARAMS,
    MLP_PARAMS,
    SPARSE_MLP,
    final_norm_dtype,
    mixed_mlp,
    mlp_index,
)


def decode_weights(
    spec: ModelSpec, params: dict[str, jax.Array], slots: int, *, ops: Decode
) -> dict:
    """Weights in the decode layout (compute dtype), stacked over layers [L, ...], laid
    out by `ops.prepare`, and the rotary table of positions 0 .. slots - 1; run outside
    the loop."""
    cdt = jnp.dtype(spec.compute_dtype)
    D, H, K, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def one_layer(p):
        w = {
            "attn_norm": p["attn_norm"],
            "qkv": jnp.concatenate(
                [p["q"].reshape(D, H * hd), p["k"].reshape(D, K * hd), p["v"].reshape(D, K * hd)],
                axis=1,
            ).astype(cdt),
            "o": p["o"].reshape(H * hd, D).astype(cdt),
        }
        if spec.qkv_bias:
            w["qkv_bias"] = jnp.concatenate(
                [p["q_bias"].reshape(-1), p["k_bias"].reshape(-1), p["v_bias"].reshape(-1)]
            ).astype(cdt)
        if spec.o_bias:
            w["o_bias"] = p["o_bias"].astype(cdt)
        if spec.qk_norm:
            w["q_norm"], w["k_norm"] = p["q_norm"], p["k_norm"]
        return w

    def one_mlp(p):  # a dense layer's or a sparse one's; the router stays float32 (`route`)
        if "router" in p:
            return {n: p[n] if n in ("mlp_norm", "router") else p[n].astype(cdt) for n in p}
        gate_up = jnp.concatenate([p["gate"], p["up"]], axis=1).astype(cdt)
        return {"mlp_norm": p["mlp_norm"], "gate_up": gate_up, "down": p["down"].astype(cdt)}

    layers = {n: params[n] for n in LAYER_PARAMS if n in params and n not in MLP_PARAMS}
    layers = jax.vmap(one_layer)(layers)
    # Each kind's MLPs stacked over its layers ("dense", "sparse"), their layers' norms beside.
    sparse, norms, mlps = mlp_index(spec)["sparse"], params["mlp_norm"], {}
    for kind, names, at in (("dense", DENSE_MLP, ~sparse), ("sparse", SPARSE_MLP, sparse)):
        if at.any():
            mlp = {n: params[n] for n in names if n in params}
            mlp["mlp_norm"] = norms if at.all() else norms[np.flatnonzero(at)]
            mlps[kind] = ops.prepare_mlp(jax.vmap(one_mlp)(mlp))
    head = params["embed"] if spec.tie_embeddings else params["lm_head"]  # [V, D]
    layers, head = ops.prepare(layers, params["final_norm"], head)
    return {
        "embed": params["embed"],
        "final_norm": params["final_norm"],
        "head": head,
        "layers": layers,
        **mlps,
        "rope": rope_table(spec, slots),
    }


def decode_step(
    spec: ModelSpec,
    w: dict,
    cache: PagedKV,
    tokens_b: jax.Array,
    positions_b: jax.Array,
    pages: Pages,
    *,
    ops: Decode,
    constrain=lambda x, logical: x,
    record_routes: bool = False,
    sparse_mlp=None,
) -> tuple[jax.Array, ...]:
    """Feed one token per row [B]; float32 logits [B, V], the cache and, `record_routes`
    (a mixture of experts), each row's experts [B, L, k] int32.

    Row b's token goes to its position positions_b[b] in the pages of its table
    (`pages`; where pages.live[b]), and it attends to its positions 0 ..
    positions_b[b]. ops: the platform's decode ops (`Kernels.decode_ops`), which laid
    out `w` (decode_weights) and `cache`. `constrain(x, logical axes)` pins the
    residual stream's layout. `sparse_mlp(h, weights, **kw)` runs a mixture of experts'
    routed experts on a mesh (`expert_parallel_moe_mlp`; default `moe_mlp`)."""
    cdt, eps, B = jnp.dtype(spec.compute_dtype), spec.rms_norm_eps, tokens_b.shape[0]
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    stack = w["layers"]  # the MLPs: w["dense"], w["sparse"] (`decode_weights`)
    qk_norm = (stack["q_norm"], stack["k_norm"]) if spec.qk_norm else None

    def at(name, i):  # layer i's bias
        return jax.lax.dynamic_index_in_dim(stack[name], i, 0, keepdims=False)

    # [B, 1, hd / 2]; a row's position is below the table's rows (`decode_weights`' slots).
    rope = rope_angles(positions_b[:, None], spec, table=w.get("rope"))
    x = ops.embed(w["embed"], tokens_b, cdt)  # [B, D]

    def layer(carry, xs):
        (x, cache), (i, kind) = carry, xs
        qkv = ops.normed_dense(
            x, stack["attn_norm"], stack["qkv"], i, eps=eps, cols=(H + 2 * K) * hd
        )
        if spec.qkv_bias:
            qkv = qkv + at("qkv_bias", i)
        att, cache = ops.paged_attention(
            qkv, rope, cache, pages, positions_b, layer=i, num_heads=H, qk_norm=qk_norm, eps=eps
        )
        o_bias = at("o_bias", i) if spec.o_bias else None
        x = ops.residual_dense(x, att.astype(cdt).reshape(B, H * hd), stack["o"], i, o_bias)
        x, experts = _mlp(spec, w, x, i, kind, ops=ops, sparse_mlp=sparse_mlp)
        return (constrain(x, ("batch", "embed")), cache), experts

    xs = (jnp.arange(spec.num_layers), mlp_index(spec) if spec.mixed else None)
    (x, cache), routes = jax.lax.scan(layer, (x, cache), xs)
    logits = ops.logits(
        x, w["final_norm"], w["head"], eps=eps, dtype=final_norm_dtype(spec), cols=spec.vocab_size
    )
    return (logits, cache, jnp.moveaxis(routes, 0, 1)) if record_routes else (logits, cache)


def _mlp(spec: ModelSpec, w: dict, x: jax.Array, i, kind, *, ops: Decode, sparse_mlp=None):
    """x [B, D] plus layer i's MLP of it (a mixed model's: of the kind `kind` says,
    `mixed_mlp`), and each row's experts [B, k] (None for a dense model)."""

    def sparse(x, j):  # x + the layer's mixture of experts; its experts
        m, experts = _moe(spec, w["sparse"], x, j, ops=ops, sparse_mlp=sparse_mlp)
        return x + m, experts

    def dense(x, j):  # x + the layer's SwiGLU
        mlp, eps, F = w["dense"], spec.rms_norm_eps, spec.intermediate_size
        act = ops.swiglu(x, mlp["mlp_norm"], mlp["gate_up"], j, eps=eps, cols=F)
        return ops.residual_dense(x, act, mlp["down"], j)

    if spec.mixed:
        x, (experts,) = mixed_mlp(kind, x, sparse=sparse, dense=dense)
        return x, experts
    return sparse(x, i) if spec.is_moe else (dense(x, i), None)


def _moe(spec: ModelSpec, stack: dict, x_bd: jax.Array, i, *, ops: Decode, sparse_mlp=None):
    """Layer i's sparse MLP of one token per row [B, D] (`moe_block`): the model's
    `moe_mlp` (or `sparse_mlp`), its grouped matmuls the platform's
    (`ops.grouped_matmul`); and each row's experts [B, k]."""

    def at(name):
        return jax.lax.dynamic_index_in_dim(stack[name], i, 0, keepdims=False)

    h = rms_norm(x_bd, at("mlp_norm"), spec.rms_norm_eps)
    return moe_block(spec, h, at, sparse_mlp or _moe_mlp, grouped_matmul=ops.grouped_matmul)


def _moe_mlp(h, weights, **kw):
    """`moe_mlp`'s output and experts (`decode_step`'s `sparse_mlp` by default)."""
    out, _, experts = moe_mlp(h, *weights, **kw)
    return out, experts
