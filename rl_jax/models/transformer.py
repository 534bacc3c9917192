"""The decoder (Llama 3 / Qwen2 / Qwen3) as a Flax NNX module over stacked layers.

Parameters are laid out by `param_layout` with per-layer weights stacked,
[L, ...], under the logical axis `layers`: loaders, exporters and `init_params`
speak that layout, and the module stores them so. Every forward runs its layers
through `over_layers`: one rolled `lax.scan` under `spec.scan_layers` (compile time
independent of depth), otherwise unrolled in the program (a faster step).

The one forward, with its entry points (trainer and sampler call these; neither
re-implements a layer):
    hidden_btd, _ = model(tokens_bt, positions_bt, *, segment_ids_bt=None,
                          kv_valid_bs=None)                         # full sequence
    hidden_btd, cache = model(tokens_bt, positions_bt, kv_valid_bs=valid_bs,
                              cache=cache, cache_index=i)           # prefill (chunks)
    hp, hc = model.shared_prefix(prompt..., completion..., group_size=G)
                                  # each prompt once for its G completions (training)
    logits_bv, cache = decode_step(spec, w, cache, tokens_b, ...)   # one token a row
`hidden_btd` is the residual stream before the final norm; `model.logits(h)` and
`model.values(h)` apply the final norm and the heads. The decode step
(`rl_jax.models.decode`) runs on weights and a cache laid out for a token loop,
over the same layer math. The hot ops under a layer (attention, projections) are
`rl_jax.kernels` ops, picked by the mesh's platform.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from rl_jax import kernels as kernel_ops
from rl_jax.kernels import Kernels, loops
from rl_jax.kernels.xla import AttentionLayout, AttentionMask, matmul, normed_logits
from rl_jax.models.layers import (
    attention_mask,
    norm_rope_qk,
    rms_norm,
    rope_angles,
    rope_table,
    swiglu,
)
from rl_jax.models.moe import (
    ROUTED_EXPERTS,
    SHARED_EXPERT,
    RouterStats,
    moe_block,
    moe_mlp,
    sharded_moe_mlp,
)
from rl_jax.models.spec import ModelSpec
from rl_jax.runtime import xla_options
from rl_jax.sharding.rules import Rules, fit_spec, get_rules, logical_to_spec

INIT_STD = 0.02  # transformers' initializer_range default


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]
    init: str  # "normal" | "zeros" | "ones"


# Per-layer parameters (stacked over L); the rest are model-level.
LAYER_PARAMS = (
    "attn_norm",
    "q",
    "k",
    "v",
    "q_bias",
    "k_bias",
    "v_bias",
    "q_norm",
    "k_norm",
    "o",
    "o_bias",
    "mlp_norm",
    "gate",
    "up",
    "down",
    "router",
    "expert_gate",
    "expert_up",
    "expert_down",
    "shared_gate",
    "shared_up",
    "shared_down",
    "shared_expert_gate",
)


def param_layout(spec: ModelSpec) -> dict[str, ParamInfo]:
    """Name -> shape, logical axes and initializer of every parameter of `spec`."""
    L, D, F, V = spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    lay: dict[str, ParamInfo] = {
        "embed": ParamInfo((V, D), ("vocab", "embed"), "normal"),
        "attn_norm": ParamInfo((L, D), ("layers", None), "ones"),
        "q": ParamInfo((L, D, H, hd), ("layers", "embed", "heads", "head_dim"), "normal"),
        "k": ParamInfo((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "v": ParamInfo((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "o": ParamInfo((L, H, hd, D), ("layers", "heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ParamInfo((L, D), ("layers", None), "ones"),
        "final_norm": ParamInfo((D,), (None,), "ones"),
    }
    if spec.is_moe:  # the sparse layers' MLPs (rl_jax.models.moe), stacked [Ls, ...]
        E, Fe, Ls = spec.num_experts, spec.moe_intermediate_size, len(spec.sparse_layers)
        expert_in = ("layers", "expert", "embed", "mlp")
        lay["router"] = ParamInfo((Ls, D, E), ("layers", "embed", None), "normal")
        lay["expert_gate"] = ParamInfo((Ls, E, D, Fe), expert_in, "normal")
        lay["expert_up"] = ParamInfo((Ls, E, D, Fe), expert_in, "normal")
        lay["expert_down"] = ParamInfo(
            (Ls, E, Fe, D), ("layers", "expert", "mlp", "embed"), "normal"
        )
        if Fs := spec.shared_expert_intermediate_size:  # beside them: Qwen2-MoE's shared one
            lay["shared_gate"] = ParamInfo((Ls, D, Fs), ("layers", "embed", "mlp"), "normal")
            lay["shared_up"] = ParamInfo((Ls, D, Fs), ("layers", "embed", "mlp"), "normal")
            lay["shared_down"] = ParamInfo((Ls, Fs, D), ("layers", "mlp", "embed"), "normal")
            lay["shared_expert_gate"] = ParamInfo((Ls, D), ("layers", None), "normal")
    if Ld := L - len(spec.sparse_layers):  # the dense layers' MLPs, stacked [Ld, ...]
        lay["gate"] = ParamInfo((Ld, D, F), ("layers", "embed", "mlp"), "normal")
        lay["up"] = ParamInfo((Ld, D, F), ("layers", "embed", "mlp"), "normal")
        lay["down"] = ParamInfo((Ld, F, D), ("layers", "mlp", "embed"), "normal")
    if spec.qkv_bias:
        lay["q_bias"] = ParamInfo((L, H, hd), ("layers", "heads", "head_dim"), "zeros")
        lay["k_bias"] = ParamInfo((L, K, hd), ("layers", "kv_heads", "head_dim"), "zeros")
        lay["v_bias"] = ParamInfo((L, K, hd), ("layers", "kv_heads", "head_dim"), "zeros")
    if spec.o_bias:
        lay["o_bias"] = ParamInfo((L, D), ("layers", None), "zeros")
    if spec.qk_norm:
        lay["q_norm"] = ParamInfo((L, hd), ("layers", None), "ones")
        lay["k_norm"] = ParamInfo((L, hd), ("layers", None), "ones")
    if not spec.tie_embeddings:
        # Stored [V, D] like the embedding (and HF's lm_head.weight).
        lay["lm_head"] = ParamInfo((V, D), ("vocab", "embed"), "normal")
    if spec.value_head:
        lay["value_w"] = ParamInfo((D,), (None,), "zeros")
        lay["value_b"] = ParamInfo((), (), "zeros")
    return lay


def dtype_of(name: str):
    return jnp.dtype(name)


def init_params(spec: ModelSpec, key: jax.Array) -> dict[str, jax.Array]:
    """Random parameters (normal(0, 0.02) matrices, unit norms, zero biases).

    Pure; jit it with `out_shardings` and every device draws only its own shard
    (threefry is partitionable, so values do not depend on the mesh).
    """
    dtype = dtype_of(spec.param_dtype)
    out = {}
    for i, (name, info) in enumerate(sorted(param_layout(spec).items())):
        if info.init == "normal":
            x = INIT_STD * jax.random.normal(jax.random.fold_in(key, i), info.shape, jnp.float32)
            out[name] = x.astype(dtype)
        elif info.init == "ones":
            out[name] = jnp.ones(info.shape, dtype)
        else:
            out[name] = jnp.zeros(info.shape, dtype)
    return out


def param_shardings(
    spec: ModelSpec, mesh: Mesh | None, rules: Rules
) -> dict[str, jax.sharding.Sharding]:
    """Where each parameter lives; mesh axes that do not divide a dim are dropped."""
    lay = param_layout(spec)
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        return {n: dev for n in lay}
    return {
        n: NamedSharding(mesh, fit_spec(logical_to_spec(i.logical_axes, rules), i.shape, mesh))
        for n, i in lay.items()
    }


class KVCache(NamedTuple):
    """Keys and values of every layer, stacked: k, v [L, B, K, S, hd] (time on the
    second-to-last axis, the layout the attention matmuls read without a transpose).
    The forward carries it through its scan over layers and writes each layer's
    slots in place."""

    k: jax.Array
    v: jax.Array

    LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")

    def take(self, rows_b: jax.Array) -> KVCache:
        """Rows re-ordered or repeated, e.g. by `jnp.repeat(jnp.arange(P), G)`."""
        return KVCache(*(jnp.take(a, rows_b, axis=1) for a in self))

    def repeat(self, n: int) -> KVCache:
        """Each row repeated n times in place (row i -> rows i*n .. i*n + n - 1)."""
        return KVCache(*(jnp.repeat(a, n, axis=1) for a in self))

    @property
    def max_len(self) -> int:
        return int(self.k.shape[-2])

    @property
    def batch_size(self) -> int:
        return int(self.k.shape[1])


def init_cache(
    spec: ModelSpec,
    batch: int,
    max_len: int,
    dtype=None,
    *,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> KVCache:
    """Zeros in the compute dtype (or `dtype`); with a mesh, sharded over batch and kv_heads."""
    dtype = dtype_of(spec.compute_dtype) if dtype is None else jnp.dtype(dtype)
    shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
    if mesh is None:
        sh = SingleDeviceSharding(jax.devices()[0])
    else:
        rules = get_rules("fsdp_tp", purpose="sample") if rules is None else rules
        spec_ = logical_to_spec(KVCache.LOGICAL_AXES, rules)
        sh = NamedSharding(mesh, fit_spec(spec_, shape, mesh))
    k, v = jax.jit(lambda: [jnp.zeros(shape, dtype) for _ in range(2)], out_shardings=sh)()
    return KVCache(k=k, v=v)


def positions_from_valid(valid_bt: jax.Array) -> jax.Array:
    """Per-row positions of a left-padded batch: 0 at the first real token (pads get 0)."""
    return jnp.maximum(jnp.cumsum(valid_bt.astype(jnp.int32), axis=1) - 1, 0)


class _Layers(nnx.Module):
    """Stacked per-layer parameters, [L, ...] each."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, p in params.items():
            setattr(self, name, p)


class Transformer(nnx.Module):
    def __init__(
        self,
        spec: ModelSpec,
        params: dict[str, jax.Array],
        *,
        mesh: Mesh | None = None,
        rules: Rules = (),
    ):
        lay = param_layout(spec)
        missing = sorted(set(lay) - set(params))
        extra = sorted(set(params) - set(lay))
        if missing or extra:
            raise ValueError(f"parameters do not match the spec: missing {missing}, extra {extra}")
        for name, info in lay.items():
            if tuple(params[name].shape) != info.shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(params[name].shape)}, spec needs "
                    f"{info.shape}"
                )
        self.spec = spec
        self.mesh = mesh
        self.rules = tuple(rules)

        def wrap(name):
            return nnx.Param(params[name], logical_axes=lay[name].logical_axes)

        self.layers = _Layers({n: wrap(n) for n in LAYER_PARAMS if n in lay})
        for name in lay:
            if name not in LAYER_PARAMS:
                setattr(self, name, wrap(name))

    # ---- sharding of activations -------------------------------------------------------

    def constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
        """Pin an activation's layout by logical axes (a no-op without a mesh)."""
        if self.mesh is None:
            return x
        spec = fit_spec(logical_to_spec(logical, self.rules), x.shape, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        return init_cache(self.spec, batch, max_len, dtype, mesh=self.mesh, rules=self.rules)

    # ---- forward -------------------------------------------------------------------------

    def layer_params(self) -> dict[str, jax.Array]:
        """Per-layer weights stacked [L, ...] (an MLP's: over the layers of its kind)."""
        return {n: getattr(self.layers, n)[...] for n in LAYER_PARAMS if hasattr(self.layers, n)}

    @property
    def kernels(self) -> Kernels:
        """The hot ops for this model's mesh (its devices' platform; `rl_jax.kernels`)."""
        return kernel_ops.for_mesh(self.mesh)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        *,
        segment_ids_bt: jax.Array | None = None,
        kv_valid_bs: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        record_routes: bool = False,
    ) -> tuple[jax.Array, ...]:
        """Residual stream after the last layer, [B, T, D] (compute dtype), and the cache.

        positions_bt: RoPE positions per row (default 0..T-1); give per-row
          positions for left-padded rows and restart them per packed segment.
        segment_ids_bt: packed rows; a query sees only keys of its own segment.
        kv_valid_bs: False for key slots never to attend to (pads); [B, T]
          without a cache, [B, S] over the whole cache with one.
        cache, cache_index: write this call's keys/values into slots
          cache_index .. cache_index + T - 1 (dynamic scalar) and attend over
          the cache (prefill, decode); the returned cache holds the new entries.
        record_routes (a mixture of experts): a third result, each token's experts
          [B, T, L, k] int32 (what routing replay replays; `shared_prefix`).
        """
        spec = self.spec
        B, T = tokens_bt.shape
        if positions_bt is None:
            start = 0 if cache_index is None else cache_index
            positions_bt = jnp.broadcast_to(start + jnp.arange(T), (B, T))
        if (cache is None) != (cache_index is None):
            raise ValueError("pass cache and cache_index together")
        x = self.embed_tokens(tokens_bt)
        rope = rope_angles(positions_bt, spec)
        ctx = self._layer_context()
        if cache is None:
            attend = self._attention(T, T, segment_ids_bt=segment_ids_bt, kv_valid_bs=kv_valid_bs)

            def body(x, p):
                q, k, v = _block_qkv(p, x, rope, **ctx)
                x, moe = _block_out(p, x, attend(q, k, v), **ctx)
                return x, (moe[1] if record_routes else None)

            x, routes = over_layers(spec, body, x, _scanned(spec, self.layer_params()))
            out = (x, None)
        else:
            out = self._cached(x, rope, cache, cache_index, segment_ids_bt, kv_valid_bs)
            out, routes = out[:2], out[2]
        return (*out, _token_major(routes)) if record_routes else out

    def _cached(self, x, rope, cache, cache_index, segment_ids_bt, kv_valid_bs):
        """The layers over a cache: each writes its keys and values at cache_index and
        attends over the whole cache (`__call__` with a cache); also each layer's chosen
        experts [L, B, T, k] (None for a dense MLP)."""
        spec, ctx, T = self.spec, self._layer_context(), x.shape[1]
        mask = attention_mask(
            T,
            cache.max_len,
            cache_index=cache_index,
            segment_ids_bt=segment_ids_bt,
            kv_valid_bs=kv_valid_bs,
        )
        filled = cache_index + T

        def body_cached(carry, xs):
            x, ck, cv = carry
            p, i = xs
            q, k, v = _block_qkv(p, x, rope, **ctx)
            at = (i, 0, 0, cache_index, 0)
            ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
            k_all = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False).astype(x.dtype)
            v_all = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False).astype(x.dtype)
            a = self.kernels.attention_cached(
                q, k_all, v_all, mask, scale=spec.head_dim**-0.5, filled=filled
            )
            x, moe = _block_out(p, x, a, **ctx)
            return (x, ck, cv), (None if moe is None else moe[1])

        xs = (_scanned(spec, self.layer_params()), jnp.arange(spec.num_layers))
        (x, ck, cv), routes = over_layers(spec, body_cached, (x, *cache), xs)
        return x, KVCache(ck, cv), routes

    def shared_prefix(
        self,
        prompt_tokens_pt: jax.Array,
        prompt_positions_pt: jax.Array,
        prompt_valid_pt: jax.Array,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        valid_bt: jax.Array,
        *,
        group_size: int,
        with_router: bool = False,
        routes: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, ...]:
        """The forward over P prompts [P, Tp] and their B = P x G continuations [B, Tc]
        (rows [g * G, (g + 1) * G) continue prompt g): each prompt runs through the
        layers once, and its keys and values are shared by its group's rows.

        Returns the residual streams (prompts [P, Tp, D], continuations [B, Tc, D]),
        equal to one forward over each whole row [prompt | continuation] up to float32
        rounding. Continuation query j sits at slot Tp + j of the keys
        [prompt | continuation]; positions are the rows' own (RoPE).
        with_router (a mixture of experts): a third result, the router's RouterStats
        of each layer ([L, ...]) over the valid prompt and continuation tokens.
        routes (routing replay; a mixture of experts): the experts each token is routed
        to, (prompts [P, Tp, L, k], continuations [B, Tc, L, k]), e.g. the sampler's
        (`Rollouts.routes`), in place of the router's top k."""
        spec, G = self.spec, group_size
        tp, tc = prompt_tokens_pt.shape[1], tokens_bt.shape[1]
        xp, xc = self.embed_tokens(prompt_tokens_pt), self.embed_tokens(tokens_bt)
        # Positions count a row's real tokens, so none reaches its column (< Tp + Tc + 1).
        table = rope_table(spec, tp + tc + 1)
        rope_p = rope_angles(prompt_positions_pt, spec, table=table)
        rope_c = rope_angles(positions_bt, spec, table=table)
        attend_p = self._attention(tp, tp, kv_valid_bs=prompt_valid_pt)
        kv_valid = jnp.concatenate([jnp.repeat(prompt_valid_pt, G, axis=0), valid_bt], axis=1)
        attend_c = self._attention(tc, tp + tc, offset=tp, kv_valid_bs=kv_valid)
        ctx = self._layer_context()

        def body(carry, xs):
            xp, xc = carry
            p, ep, ec = xs if routes is not None else (xs, None, None)
            qp, kp, vp = _block_qkv(p, xp, rope_p, **ctx)
            qc, kc, vc = _block_qkv(p, xc, rope_c, **ctx)
            ap = attend_p(qp, kp, vp)
            k_all = jnp.concatenate([jnp.repeat(kp, G, axis=0), kc], axis=2)
            v_all = jnp.concatenate([jnp.repeat(vp, G, axis=0), vc], axis=2)
            ac = attend_c(qc, k_all, v_all)
            xp, mp = _block_out(p, xp, ap, valid=prompt_valid_pt, experts=ep, **ctx)
            xc, mc = _block_out(p, xc, ac, valid=valid_bt, experts=ec, **ctx)
            return (xp, xc), (None if mp is None else mp[0] + mc[0])

        xs = _scanned(spec, self.layer_params())
        if routes is not None:  # [N, T, L, k] -> layers first
            xs = (xs, *(jnp.moveaxis(r, 2, 0) for r in routes))
        (xp, xc), stats = over_layers(spec, body, (xp, xc), xs)
        if with_router:
            if stats is None:
                raise ValueError("with_router: this model has no router (a dense MLP)")
            return xp, xc, _sparse_rows(spec, stats)
        return xp, xc

    def _attention(
        self,
        T: int,
        S: int,
        *,
        offset: int = 0,
        segment_ids_bt: jax.Array | None = None,
        kv_valid_bs: jax.Array | None = None,
    ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
        """Attention of T queries over one forward's S keys (query t at key slot
        offset + t), as `spec.attention` picks it: `kernels.attention` with the
        [B, T, S] mask built once, or `kernels.flash_attention` with it described."""
        spec = self.spec
        scale = spec.head_dim**-0.5
        if uses_blockwise(spec, S):
            mask = AttentionMask(offset, kv_valid_bs, segment_ids_bt, segment_ids_bt)
            flash = functools.partial(
                self.kernels.flash_attention, scale=scale, block=spec.attention_block
            )
            return lambda q, k, v: flash(q, k, v, mask, layout=self._attention_layout(q, k))
        dense = attention_mask(
            T,
            S,
            cache_index=offset or None,
            segment_ids_bt=segment_ids_bt,
            kv_valid_bs=kv_valid_bs,
        )
        return lambda q, k, v: self.kernels.attention(q, k, v, dense, scale=scale)

    def _attention_layout(self, q_bthk: jax.Array, k_bksh: jax.Array) -> AttentionLayout | None:
        """Where attention's q and k / v live on the mesh (None without one)."""
        if self.mesh is None:
            return None

        def spec(logical, x):
            return fit_spec(logical_to_spec(logical, self.rules), x.shape, self.mesh)

        return AttentionLayout(
            self.mesh,
            spec(("batch", "seq", "heads", "head_dim"), q_bthk),
            spec(("batch", "kv_heads", "seq", "head_dim"), k_bksh),
        )

    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype."""
        x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(dtype_of(self.spec.compute_dtype))
        return self.constrain(x, ("batch", "seq", "embed"))

    def _layer_context(self) -> dict:
        mixed = self.spec.mixed  # its MLPs' stacks whole (`_scanned`)
        return dict(
            spec=self.spec,
            constrain=self.constrain,
            kernels=self.kernels,
            sparse_mlp=self._sparse_mlp,
            mlps={n: a for n, a in self.layer_params().items() if mixed and n in MLP_PARAMS},
        )

    def _sparse_mlp(self, h, p, valid, experts=None) -> tuple[jax.Array, RouterStats, jax.Array]:
        """A layer's mixture of experts on h [N, T, D] (normed; p: the layer's weights,
        valid [N, T] or None), per batch shard on a mesh (`sharded_moe_mlp`), its shared
        expert added, with its router's statistics and chosen (or replayed: `experts`)
        experts [N, T, k]."""

        def routed(h, weights, **kw):
            if self.mesh is None or self.mesh.size == 1:
                return moe_mlp(h, *weights, valid=valid, experts=experts, **kw)
            return sharded_moe_mlp(self.mesh, self.rules, h, weights, valid, experts, **kw)

        return moe_block(
            self.spec, h, p.__getitem__, routed, grouped_matmul=self.kernels.grouped_matmul
        )

    # ---- heads ---------------------------------------------------------------------------

    def head_weight(self) -> jax.Array:
        """LM head as [V, D] (the embedding when tied)."""
        return (self.embed if self.spec.tie_embeddings else self.lm_head)[...]

    def final_hidden(self, hidden_btd: jax.Array) -> jax.Array:
        return final_norm(self.spec, self.final_norm[...], hidden_btd)

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """Float32 logits [B, T, V] of the residual stream `hidden_btd` (norm applied here).

        With `fp32_lm_head` the final norm and the head matmul run in float32;
        otherwise in the compute dtype, the result cast to float32.
        """
        out = lm_logits(
            self.spec, self.final_norm[...], self.head_weight(), hidden_btd, kernels=self.kernels
        )
        return self.constrain(out, ("batch", "seq", "vocab"))

    def values(self, hidden_btd: jax.Array) -> jax.Array:
        """Value head (PPO critic) on the final-normed hidden state: [B, T] float32."""
        if not self.spec.value_head:
            raise ValueError("this model has no value head (set model.value_head=true)")
        h = self.final_hidden(hidden_btd).astype(jnp.float32)
        f32 = jnp.float32
        return matmul(h, self.value_w[...].astype(f32)) + self.value_b[...].astype(f32)


def final_norm_dtype(spec: ModelSpec):
    """The final norm's and the LM head's dtype: float32 with `fp32_lm_head`."""
    return jnp.float32 if spec.fp32_lm_head else dtype_of(spec.compute_dtype)


def final_norm(spec: ModelSpec, norm_w: jax.Array, hidden_btd: jax.Array) -> jax.Array:
    return rms_norm(hidden_btd, norm_w, spec.rms_norm_eps, dtype=final_norm_dtype(spec))


def lm_logits(
    spec: ModelSpec,
    norm_w: jax.Array,
    head_vd: jax.Array,
    hidden_btd: jax.Array,
    *,
    kernels: Kernels,
) -> jax.Array:
    """Pure LM head: final RMSNorm then [B, T, D] x [V, D] -> float32 [B, T, V]."""
    return normed_logits(
        hidden_btd,
        norm_w,
        head_vd,
        eps=spec.rms_norm_eps,
        dtype=final_norm_dtype(spec),
        einsum=kernels.einsum_f32,
    )


# Keys above which `model.attention=auto` picks blockwise attention: below it the
# [B, H, T, S] scores are small, and the dense form's one pass is the faster one.
BLOCKWISE_MIN_KEYS = 1024


def uses_blockwise(spec: ModelSpec, S: int) -> bool:
    """Whether a forward over S keys uses blockwise attention (`model.attention`)."""
    return spec.attention == "blockwise" or (spec.attention == "auto" and S > BLOCKWISE_MIN_KEYS)


# What `model.remat` keeps of a layer for the backward pass (the rest is recomputed).
REMAT_POLICIES = {
    "full": None,  # only the layer's input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _maybe_remat(spec: ModelSpec, body: Callable) -> Callable:
    """A layer's body under `model.remat`; loops traced in it count once per layer in a
    plan (`loops.layer_body`)."""
    body = loops.layer_body(body)
    if spec.remat == "none":
        return body
    return jax.checkpoint(body, policy=REMAT_POLICIES[spec.remat])


def over_layers(spec: ModelSpec, body: Callable, carry: Any, xs: Any) -> tuple[Any, Any]:
    """`body(carry, x) -> (carry, y)` over the leading (layer) axis of `xs`, as
    `jax.lax.scan` returns it, each layer under `model.remat`.

    `spec.scan_layers`: one rolled loop (`jax.lax.scan`): the program, hence its compile
    time, does not grow with depth, but the backward keeps each layer's residuals in
    stacked [L, ...] buffers, which the loop zero-fills, writes and reads back. Otherwise
    the layers are unrolled in the program, each on a static slice of the stacked weights
    (`benchmarks/layer_loop.py` measures both).
    """
    body = _maybe_remat(spec, body)
    if spec.scan_layers:
        return jax.lax.scan(body, carry, xs)
    ys = []
    for i in range(spec.num_layers):
        carry, y = body(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _token_major(routes_lntk: jax.Array | None) -> jax.Array | None:
    """Experts stacked over layers [L, N, T, k] as each token's [N, T, L, k]."""
    return None if routes_lntk is None else jnp.moveaxis(routes_lntk, 0, 2)


def _block_qkv(
    p: dict[str, jax.Array],
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    *,
    spec: ModelSpec,
    constrain: Callable,
    kernels: Kernels,
    sparse_mlp: Callable | None = None,  # the second half's (_block_out)
    mlps: dict | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first half of a pre-norm block up to attention, for x [N, T, D]:
    queries [N, T, H, hd] and keys/values [N, K, T, hd], RoPE (cos, sin) applied.

    Keys/values come batch dims first, the layout the attention matmuls want, so
    reading a cache needs no transpose."""
    eps = spec.rms_norm_eps
    h = rms_norm(x, p["attn_norm"], eps)
    dense = kernels.dense
    q, k, v = dense(h, p["q"]), dense(h, p["k"]), dense(h, p["v"])
    if spec.qkv_bias:
        q = q + p["q_bias"].astype(q.dtype)
        k = k + p["k_bias"].astype(k.dtype)
        v = v + p["v_bias"].astype(v.dtype)
    q, k = norm_rope_qk(q, k, rope, (p["q_norm"], p["k_norm"]) if spec.qk_norm else None, eps)
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k.swapaxes(1, 2), v.swapaxes(1, 2)


def _block_out(
    p: dict[str, jax.Array],
    x: jax.Array,
    a: jax.Array,
    *,
    spec: ModelSpec,
    constrain: Callable,
    kernels: Kernels,
    sparse_mlp: Callable | None = None,
    mlps: dict | None = None,
    valid: jax.Array | None = None,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, tuple[RouterStats, jax.Array] | None]:
    """The second half of a pre-norm block: x + o(a), then + the MLP of norm(.): SwiGLU,
    or the sparse mixture of experts (`rl_jax.models.moe`), with its router's statistics
    over the `valid` tokens [N, T] and each token's experts [N, T, k] (None for a dense
    model); `experts` replays given ones; a mixed model's layer picks its kind
    (`mixed_mlp`; `mlps`: the MLPs' stacks). a: attention output [N, T, H, hd]."""
    N, T = a.shape[:2]
    o = kernels.dense(a.reshape(N, T, -1), p["o"].reshape(-1, p["o"].shape[-1]))
    if spec.o_bias:
        o = o + p["o_bias"].astype(o.dtype)
    x = constrain(x + o, ("batch", "seq", "embed"))
    h = rms_norm(x, p["mlp_norm"], spec.rms_norm_eps)
    if spec.mixed:
        m, moe = mixed_mlp(
            p,
            h,
            sparse=lambda h, j: sparse_mlp(h, stacked_at(mlps, SPARSE_MLP, j), valid, experts),
            dense=lambda h, j: _swiglu(h, stacked_at(mlps, DENSE_MLP, j)),
        )
        return constrain(x + m, ("batch", "seq", "embed")), moe
    if spec.is_moe:
        m, stats, chosen = sparse_mlp(h, p, valid, experts)  # its shared expert added
        return constrain(x + m, ("batch", "seq", "embed")), (stats, chosen)
    return constrain(x + _swiglu(h, p), ("batch", "seq", "embed")), None


# A layer's MLP weights, stacked over the layers of its kind (`param_layout`).
DENSE_MLP = ("gate", "up", "down")
SPARSE_MLP = (*ROUTED_EXPERTS, *SHARED_EXPERT)
MLP_PARAMS = (*DENSE_MLP, *SPARSE_MLP)


def _scanned(spec: ModelSpec, p: dict[str, jax.Array]) -> dict:
    """What the layer loop steps through of the stacked weights `p`: all; of a mixed model
    all but the MLPs' stacks (`Transformer._layer_context` holds them whole), with each
    layer's kind and index in its kind's stack (`mlp_index`)."""
    if not spec.mixed:
        return p
    return {n: a for n, a in p.items() if n not in MLP_PARAMS} | mlp_index(spec)


def _sparse_rows(spec: ModelSpec, stats: RouterStats) -> RouterStats:
    """Router statistics stacked over the layers [L, ...] as the sparse layers' (a mixed
    model's dense layers have zeros)."""
    return jax.tree.map(lambda a: a[np.asarray(spec.sparse_layers)], stats) if spec.mixed else stats


def mlp_index(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Per layer [L]: whether its MLP is sparse ("sparse"), and its index in the stack of
    its kind's MLPs ("mlp_index")."""
    sparse = np.isin(np.arange(spec.num_layers), spec.sparse_layers)
    index = np.where(sparse, np.cumsum(sparse) - 1, np.cumsum(~sparse) - 1)
    return {"sparse": sparse, "mlp_index": index.astype(np.int32)}


def mixed_mlp(p: dict, x: jax.Array, *, sparse: Callable, dense: Callable) -> tuple:
    """A mixed model's layer's MLP of x, as p["sparse"] says: `sparse(x, j)` -> (out,
    *more), or `dense(x, j)` -> out (`more` zeros), with j = p["mlp_index"], the layer's
    index in its kind's stacks. (out, tuple(more)). An unrolled layer's kind is known
    while tracing; a scanned one's is a `lax.cond`."""
    j = p["mlp_index"]

    def moe(x):
        out, *more = sparse(x, j)
        return out, tuple(more)

    def mlp(x):
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(moe, x)[1])
        return dense(x, j), zeros

    if isinstance(p["sparse"], np.ndarray | np.bool_):
        return (moe if p["sparse"] else mlp)(x)
    return jax.lax.cond(p["sparse"], moe, mlp, x)


def _swiglu(h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    return swiglu(h, *(w[n].astype(h.dtype) for n in DENSE_MLP))


def stacked_at(stacks: dict, names: tuple[str, ...], j) -> dict[str, jax.Array]:
    """Entry j of each of `names` in `stacks` (those it has)."""
    return {n: jax.lax.dynamic_index_in_dim(stacks[n], j, 0, False) for n in names if n in stacks}


def init_sharded_params(
    spec: ModelSpec, *, mesh: Mesh | None, rules: Rules, seed: int = 0
) -> dict[str, jax.Array]:
    """Random parameters in the stacked layout (`param_layout`), created directly in
    their shards. The trainer takes these as they are; `build_model` wraps them in a
    Transformer."""
    init = jax.jit(
        functools.partial(init_params, spec),
        out_shardings=param_shardings(spec, mesh, rules),
        # Threefry's unrolled rounds make this a slow compile (see xla_options).
        compiler_options=xla_options(mesh),
    )
    return init(jax.random.key(seed))


def build_model(
    spec: ModelSpec,
    *,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
    seed: int = 0,
    params: dict[str, jax.Array] | None = None,
) -> Transformer:
    """A model whose parameters are created directly in their shards.

    `params` (already placed, e.g. by a checkpoint loader) skips the random
    init. `purpose` picks the train or sample rule table (`rl_jax.sharding`).
    Without a mesh everything lives on the default device.
    """
    rules = get_rules(rules_preset, purpose=purpose)
    if params is None:
        params = init_sharded_params(spec, mesh=mesh, rules=rules, seed=seed)
    return Transformer(spec, params, mesh=mesh, rules=rules)


def model_params(model: Transformer) -> dict[str, jax.Array]:
    """Flat name -> array view of a model's parameters (names of `param_layout`)."""
    out = model.layer_params()
    for name in param_layout(model.spec):
        if name not in LAYER_PARAMS:
            out[name] = getattr(model, name)[...]
    return out


def host_params(model: Transformer) -> dict[str, np.ndarray]:
    """Parameters in the stacked layout, gathered to host memory one array at a time."""
    return {name: np.asarray(jax.device_get(a)) for name, a in model_params(model).items()}
