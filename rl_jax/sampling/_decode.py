"""One-token decode step over the model's parameters, laid out for a `while_loop`.

The math is the model's (`rl_jax.models.layers`: the same RMSNorm, RoPE,
grouped-query attention with float32 scores, SwiGLU, LM head via `lm_logits`);
what differs is the layout, chosen so a decode step on CPU does no copies:

* Per-layer weights are sliced out of the stacked [L, ...] parameters once per
  decode call, outside the loop, with q/k/v and gate/up concatenated into one
  matmul each. (Slicing inside the loop copies every weight every token: XLA
  does not hoist those slices out of the `while`.)
* The KV cache is per layer: keys [B, K, hd, S] (transposed, so the score
  matmul q @ k reads them in place) and values [B, K, S, hd]; a step writes one
  slot of each with a dynamic-update-slice.
  (The model's [L, B, S, K, hd] cache needs a transposed copy of every layer's
  keys and values per token.)

Prefill still runs the model's own forward; `from_model_cache` converts its cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.models.layers import (
    MASK_VALUE,
    apply_rope,
    einsum_f32,
    matmul,
    rms_norm,
    rope_angles,
)
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import LAYER_PARAMS, KVCache, lm_logits

# Per layer: (keys [B, K, hd, S], values [B, K, S, hd]).
DecodeCache = tuple[tuple[jax.Array, jax.Array], ...]
KEYS_LOGICAL_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
VALUES_LOGICAL_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


def from_model_cache(cache: KVCache) -> DecodeCache:
    """The model's prefill cache in the decode layout (see DecodeCache).

    Accepts per-layer [B, K, S, hd] arrays, their [L, B, K, S, hd] stack
    (scanned layers), or the earlier [L, B, S, K, hd] stack.
    """
    if isinstance(cache.k, tuple | list):
        pairs = list(zip(cache.k, cache.v, strict=True))
    elif hasattr(KVCache, "LAYER_AXES"):
        pairs = [(cache.k[i], cache.v[i]) for i in range(cache.k.shape[0])]
    else:
        pairs = [
            (jnp.swapaxes(cache.k[i], 1, 2), jnp.swapaxes(cache.v[i], 1, 2))
            for i in range(cache.k.shape[0])
        ]
    return tuple((jnp.swapaxes(k, 2, 3), v) for k, v in pairs)


def decode_weights(spec: ModelSpec, params: dict[str, jax.Array]) -> dict:
    """Per-layer weights in the decode layout (compute dtype); run outside the loop."""
    cdt = jnp.dtype(spec.compute_dtype)
    D, H, K, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    layers = []
    for i in range(spec.num_layers):
        p = {n: params[n][i] for n in LAYER_PARAMS if n in params}
        w = {
            "attn_norm": p["attn_norm"],
            "mlp_norm": p["mlp_norm"],
            "qkv": jnp.concatenate(
                [p["q"].reshape(D, H * hd), p["k"].reshape(D, K * hd), p["v"].reshape(D, K * hd)],
                axis=1,
            ).astype(cdt),
            "o": p["o"].reshape(H * hd, D).astype(cdt),
            "gate_up": jnp.concatenate([p["gate"], p["up"]], axis=1).astype(cdt),
            "down": p["down"].astype(cdt),
        }
        if spec.qkv_bias:
            w["qkv_bias"] = jnp.concatenate(
                [p["q_bias"].reshape(-1), p["k_bias"].reshape(-1), p["v_bias"].reshape(-1)]
            ).astype(cdt)
        if spec.o_bias:
            w["o_bias"] = p["o_bias"].astype(cdt)
        if spec.qk_norm:
            w["q_norm"], w["k_norm"] = p["q_norm"], p["k_norm"]
        layers.append(w)
    head = params["embed"] if spec.tie_embeddings else params["lm_head"]
    return {
        "embed": params["embed"],
        "final_norm": params["final_norm"],
        "head": head,
        "layers": layers,
    }


def decode_step(
    spec: ModelSpec,
    w: dict,
    cache: DecodeCache,
    tokens_b: jax.Array,
    positions_b: jax.Array,
    slot: jax.Array,
    kv_start_b: jax.Array,
    constrain=lambda x, logical: x,
) -> tuple[jax.Array, DecodeCache]:
    """Feed one token per row at cache slot `slot`; float32 logits [B, V] and the cache.

    Row b attends to slots kv_start_b[b] .. slot (its prompt's first real token on).
    """
    cdt = jnp.dtype(spec.compute_dtype)
    eps = spec.rms_norm_eps
    B = tokens_b.shape[0]
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    R = H // K
    S = cache[0][1].shape[2]
    # A row's position never exceeds its slot (< S).
    cos, sin = rope_angles(positions_b[:, None], spec, num_positions=S)  # [B, 1, hd / 2]
    k_slot = jnp.arange(S)
    visible_bs = (k_slot[None, :] >= kv_start_b[:, None]) & (k_slot[None, :] <= slot)
    x = jnp.take(w["embed"], tokens_b, axis=0).astype(cdt)  # [B, D]
    new_cache = []
    for lw, (ck, cv) in zip(w["layers"], cache, strict=True):
        h = rms_norm(x, lw["attn_norm"], eps)
        qkv = matmul(h, lw["qkv"])
        if "qkv_bias" in lw:
            qkv = qkv + lw["qkv_bias"]
        q = qkv[:, : H * hd].reshape(B, 1, H, hd)
        k = qkv[:, H * hd : (H + K) * hd].reshape(B, 1, K, hd)
        v = qkv[:, (H + K) * hd :].reshape(B, K, 1, hd)
        if "q_norm" in lw:
            q = rms_norm(q, lw["q_norm"], eps)
            k = rms_norm(k, lw["k_norm"], eps)
        q = apply_rope(q, cos, sin).reshape(B, K, R, hd)
        k = apply_rope(k, cos, sin).reshape(B, K, hd, 1)
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, slot))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, slot, 0))
        ck = constrain(ck, KEYS_LOGICAL_AXES)
        cv = constrain(cv, VALUES_LOGICAL_AXES)
        new_cache.append((ck, cv))
        scores = einsum_f32("bkrh,bkhs->bkrs", q, ck.astype(cdt))
        scores = jnp.where(visible_bs[:, None, None, :], scores * hd**-0.5, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(cdt)
        att = einsum_f32("bkrs,bksh->bkrh", probs, cv.astype(cdt))
        a = matmul(att.astype(cdt).reshape(B, H * hd), lw["o"])
        if "o_bias" in lw:
            a = a + lw["o_bias"]
        x = x + a
        h = rms_norm(x, lw["mlp_norm"], eps)
        g, u = jnp.split(matmul(h, lw["gate_up"]), 2, axis=1)
        x = x + matmul(jax.nn.silu(g) * u, lw["down"])
        x = constrain(x, ("batch", "embed"))
    logits = lm_logits(spec, w["final_norm"], w["head"], x[:, None, :])[:, 0]
    return logits, tuple(new_cache)
