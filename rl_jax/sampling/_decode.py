"""One-token decode step over the model's parameters, laid out for a `while_loop`.

The math is the model's (`rl_jax.models.layers`: the same RMSNorm, RoPE,
grouped-query attention with float32 scores, SwiGLU, LM head via `lm_logits`,
the ops of `rl_jax.kernels`); what differs is the layout, chosen so a decode
step on CPU does few copies. Like every forward, the step scans over the
layers (`lax.scan`): its program does not grow with depth.

* Weights are stacked [L, ...], prepared once per decode call outside the token
  loop, with q/k/v and gate/up concatenated into one matmul each. Where the
  XLA ops run, each layer's weights are indexed inside the scan (on CPU a copy
  per layer and token; accelerators read them in place).
* The KV cache is stacked too: keys [L, B, K, hd, S] (transposed, so the score
  matmul q @ k reads them in place) and values [L, B, K, S, hd], carried
  through the scan; a step writes one slot of each with a dynamic-update-slice.
* On CPU without the attention kernel (below), long caches (over
  DECODE_BLOCK_MIN_SLOTS slots) are split into N blocks of slots, keys
  [L, B, N, K, hd, S / N] and values [L, B, N, K, S / N, hd]
  (decode_cache_blocks), and a step reads only the blocks written so far, with
  an online softmax over them (flash-decoding). Decoding is bound by reading
  the cache; reading all of it at every step costs twice the attention of
  reading what is filled, and more when a batch ends before its cache fills.
  A block of one row is contiguous, so taking one out inside the loop is a
  cheap copy.
* With the CPU decode-attention kernel (`rl_jax.kernels.cpu`, chosen by the
  Sampler where it can be built), keys are kept in tiles of KEY_TILE slots,
  [L, B, K, S / KEY_TILE, hd, KEY_TILE], one contiguous block per tile, and one
  kernel call per layer writes the step's key and value and computes the
  attention in the layer's part of the stack, in place: it reads each row's
  filled slots once, front to back, so no blocks are needed at any length.
* With the CPU matmul kernels (chosen by the Sampler with the attention
  kernel), the weights are packed outside the loop
  (`decode_weights(..., packed=True)`): q/k/v, o and down projections and the
  transposed LM head into panels of columns, gate and up side by side into
  SwiGLU panels, whose activation the kernel computes from its sums. The
  kernels take the whole stack and the scan's layer index, and read that
  layer's panels in place (no copy per layer).

Prefill runs the model's own forward; `from_model_cache` converts its cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.kernels import Kernels
from rl_jax.kernels import cpu as _cpu_kernels
from rl_jax.kernels.xla import MASK_VALUE, matmul, online_softmax
from rl_jax.models.layers import apply_rope, rms_norm, rope_angles, rope_table
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import LAYER_PARAMS, KVCache, lm_logits

# (keys, values) stacked over layers: keys [L, B, K, hd, S], values [L, B, K, S, hd];
# or split into blocks of slots (keys [L, B, N, K, hd, S / N], values
# [L, B, N, K, S / N, hd]); or with keys in tiles for the CPU kernel (keys
# [L, B, K, S / KEY_TILE, hd, KEY_TILE], values as unsplit).
DecodeCache = tuple[jax.Array, jax.Array]
KEYS_LOGICAL_AXES = ("layers", "batch", "kv_heads", "head_dim", "cache_seq")
VALUES_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
BLOCKED_KEYS_LOGICAL_AXES = ("layers", "batch", None, "kv_heads", "head_dim", "cache_seq")
BLOCKED_VALUES_LOGICAL_AXES = ("layers", "batch", None, "kv_heads", "cache_seq", "head_dim")
TILED_KEYS_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim", None)

# Slots per key tile of the CPU kernel's layout: its vector width (kLanes in
# _cpu_attention.cc).
KEY_TILE = 16

# Caches of more slots than this are split into blocks (decode_cache_blocks)
# and a step reads only the blocks written so far. Up to here one pass over the
# whole cache beats the block loop.
DECODE_BLOCK_MIN_SLOTS = 128
# About this many blocks per cache: the loop costs a few small kernels per block
# and a step over-reads half a block on average. Blocks of 16 to 512 slots.
DECODE_BLOCKS = 8
DECODE_BLOCK_MAX_SLOTS = 512


# Where the decode step reads a long cache in blocks. On CPU a step is bound by
# reading the cache, and a loop iteration costs a few small kernels. On an
# accelerator every block of every layer adds kernel launches, against a whole
# cache read at HBM bandwidth; not measured there yet, so it keeps one pass.
DECODE_BLOCK_PLATFORMS = ("cpu",)


def decode_cache_blocks(slots: int, platform: str = "cpu") -> tuple[int, int]:
    """(slots to allocate, slots per block) for a decode cache that must hold `slots`.

    Up to DECODE_BLOCK_MIN_SLOTS, or on a platform not in DECODE_BLOCK_PLATFORMS:
    (slots, slots), one piece. Above: blocks of
    ~slots / DECODE_BLOCKS (a multiple of 16, at most DECODE_BLOCK_MAX_SLOTS),
    and the cache rounded up to whole blocks (the extra slots are never written
    or seen). Bench model, 64 rows, one CPU device, ms per decode step, whole
    cache against blocks: 10.1-10.3 against 7.1-7.4 at 264 slots (blocks of 48),
    25-27.5 against 15.9 at 1032 (blocks of 144); 6.5 at 72 (one piece). A
    function of the slot count alone, so a row's numbers do not depend on how
    many rows share its batch.
    """
    if slots <= DECODE_BLOCK_MIN_SLOTS or platform not in DECODE_BLOCK_PLATFORMS:
        return slots, slots
    per_block = -(-slots // DECODE_BLOCKS)  # ceil
    block = min(DECODE_BLOCK_MAX_SLOTS, -(-per_block // 16) * 16)
    return -(-slots // block) * block, block


def cache_slots(cache: DecodeCache) -> int:
    """Slots of a decode cache (all its blocks)."""
    values = cache[1]
    return values.shape[2] * values.shape[4] if values.ndim == 6 else values.shape[3]


def cache_layout(keys: jax.Array, values: jax.Array) -> str:
    """The layout ("whole", "blocked" or "tiled"; see DecodeCache), from the ranks."""
    if values.ndim == 6:
        return "blocked"
    return "tiled" if keys.ndim == 6 else "whole"


def cache_axes(keys: jax.Array, values: jax.Array) -> tuple[tuple, tuple]:
    """Logical axes of (keys, values) in the decode layout."""
    return {
        "whole": (KEYS_LOGICAL_AXES, VALUES_LOGICAL_AXES),
        "blocked": (BLOCKED_KEYS_LOGICAL_AXES, BLOCKED_VALUES_LOGICAL_AXES),
        "tiled": (TILED_KEYS_LOGICAL_AXES, VALUES_LOGICAL_AXES),
    }[cache_layout(keys, values)]


def from_model_cache(cache: KVCache, block: int | None = None, tiled: bool = False) -> DecodeCache:
    """The model's prefill cache [L, B, K, S, hd] in the decode layout (see
    DecodeCache), split into blocks of `block` slots when that is fewer than its
    slots (decode_cache_blocks), or with keys in tiles of KEY_TILE slots for the
    CPU kernel (`tiled`)."""
    k, v = cache.k, cache.v
    L, B, K, S, hd = k.shape
    if tiled:
        if S % KEY_TILE:
            raise ValueError(f"a cache of {S} slots does not split into tiles of {KEY_TILE}")
        # [L, B, K, S, hd] -> [L, B, K, S / KEY_TILE, hd, KEY_TILE]
        return k.reshape(L, B, K, S // KEY_TILE, KEY_TILE, hd).swapaxes(4, 5), v
    blk = S if block is None else block
    if blk == S:
        return jnp.swapaxes(k, 3, 4), v
    if S % blk:
        raise ValueError(f"a cache of {S} slots does not split into blocks of {blk}")
    # [L, B, K, S, hd] -> [L, B, N, K, hd, blk] and [L, B, N, K, blk, hd]
    k = k.reshape(L, B, K, S // blk, blk, hd)
    v = v.reshape(L, B, K, S // blk, blk, hd)
    return k.transpose(0, 1, 3, 2, 5, 4), v.transpose(0, 1, 3, 2, 4, 5)


def decode_weights(
    spec: ModelSpec, params: dict[str, jax.Array], slots: int, packed: bool = False
) -> dict:
    """Weights in the decode layout (compute dtype), stacked over layers [L, ...], and
    the rotary table of a `slots`-slot cache; run outside the loop. `packed`: the
    projections and the LM head in the CPU matmul kernels' panels
    (`rl_jax.kernels.cpu.pack_panels`, gate and up in `pack_swiglu_panels`), which
    decode_step then multiplies in the kernels (float32 compute only). Packing
    copies every weight once per decode call."""
    cdt = jnp.dtype(spec.compute_dtype)
    D, H, K, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def one_layer(p):
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
        if packed:  # the norms' weights folded in (the kernels apply 1 / rms)
            attn_w = p["attn_norm"].astype(cdt)[:, None]
            mlp_w = p["mlp_norm"].astype(cdt)[:, None]
            w["qkv"] = _cpu_kernels.pack_panels(attn_w * w["qkv"])
            w["o"] = _cpu_kernels.pack_panels(w["o"])
            w["down"] = _cpu_kernels.pack_panels(w["down"])
            w["gate_up"] = _cpu_kernels.pack_swiglu_panels(
                mlp_w * p["gate"].astype(cdt), mlp_w * p["up"].astype(cdt)
            )
        return w

    layers = jax.vmap(one_layer)({n: params[n] for n in LAYER_PARAMS if n in params})
    head = params["embed"] if spec.tie_embeddings else params["lm_head"]  # [V, D]
    if packed:  # the LM head too, transposed, the final norm's weight folded in
        norm_w = params["final_norm"].astype(jnp.float32)[:, None]
        head = _cpu_kernels.pack_panels(norm_w * head.T.astype(jnp.float32))
    return {
        "embed": params["embed"],
        "final_norm": params["final_norm"],
        "head": head,
        "layers": layers,
        "rope": rope_table(spec, slots),
    }


def decode_step(
    spec: ModelSpec,
    w: dict,
    cache: DecodeCache,
    tokens_b: jax.Array,
    positions_b: jax.Array,
    slot: jax.Array,
    kv_start_b: jax.Array,
    *,
    kernels: Kernels,
    constrain=lambda x, logical: x,
    kernel_threads: bool = True,
) -> tuple[jax.Array, DecodeCache]:
    """Feed one token per row at cache slot `slot`; float32 logits [B, V] and the cache.

    Row b attends to slots kv_start_b[b] .. slot (its prompt's first real token on).
    kernels: the platform's ops (`rl_jax.kernels.for_mesh`).
    kernel_threads: whether the CPU kernels (tiled caches, packed weights) may use
    XLA's intra-op threads.
    """
    cdt = jnp.dtype(spec.compute_dtype)
    eps = spec.rms_norm_eps
    B = tokens_b.shape[0]
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    R = H // K
    layout = cache_layout(*cache)
    keys_axes, values_axes = cache_axes(*cache)
    F = spec.intermediate_size
    packed = w["head"].ndim == 3  # decode_weights(..., packed=True): the CPU kernels
    stack = w["layers"]
    par = kernel_threads

    def at(name, i):  # layer i's weight (XLA ops; the kernels read the stack in place)
        return jax.lax.dynamic_index_in_dim(stack[name], i, 0, keepdims=False)

    def normed_dense(x, i, norm, name, cols):  # rms_norm(x) @ w; packed: all in the kernel
        if packed:
            return _cpu_kernels.matmul(x, stack[name], cols, par, norm_eps=eps, layer=i)
        return matmul(rms_norm(x, at(norm, i), eps), at(name, i))

    def mlp(x, i):  # x + SwiGLU MLP(rms_norm(x)); packed: norm and SwiGLU in the kernel
        if packed:
            act = _cpu_kernels.matmul_swiglu(x, stack["gate_up"], F, par, norm_eps=eps, layer=i)
        else:
            g, u = jnp.split(normed_dense(x, i, "mlp_norm", "gate_up", 2 * F), 2, axis=1)
            act = jax.nn.silu(g) * u
        return constrain(residual_dense(x, act, i, "down"), ("batch", "embed"))

    def residual_dense(r, x, i, name, bias=None):  # r + (x @ w + bias); packed: in place
        if packed:
            r = r if bias is None else r + bias
            return _cpu_kernels.matmul_add(x, stack[name], r, par, layer=i)
        a = matmul(x, at(name, i))
        return r + (a if bias is None else a + bias)

    def attend(qkv, ck, cv, i):  # split, (norm,) rotate, write the cache, attend
        q = qkv[:, : H * hd].reshape(B, 1, H, hd)
        k = qkv[:, H * hd : (H + K) * hd].reshape(B, 1, K, hd)
        v = qkv[:, (H + K) * hd :].reshape(B, K, 1, hd)
        if spec.qk_norm:
            q = rms_norm(q, at("q_norm", i), eps)
            k = rms_norm(k, at("k_norm", i), eps)
        q = apply_rope(q, cos, sin).reshape(B, K, R, hd)
        k = apply_rope(k, cos, sin)
        if layout == "tiled":  # the kernel writes k, v and attends in one call
            att, ck, cv = _cpu_kernels.decode_attention(
                q,
                k.reshape(B, K, hd),
                v.reshape(B, K, hd),
                ck,
                cv,
                kv_start_b,
                slot,
                hd**-0.5,
                parallel=par,
                layer=i,
            )
        elif layout == "blocked":
            blk = cv.shape[4]
            j = (i, 0, slot // blk, 0)
            k, v = k.reshape(1, B, 1, K, hd, 1), v.reshape(1, B, 1, K, 1, hd)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (*j, 0, slot % blk))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (*j, slot % blk, 0))
        else:
            k = k.reshape(1, B, K, hd, 1)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (i, 0, 0, 0, slot))
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (i, 0, 0, slot, 0))
        ck = constrain(ck, keys_axes)
        cv = constrain(cv, values_axes)
        if layout == "blocked":
            att = _filled_blocks_attention(q, ck, cv, i, kv_start_b, slot, cdt=cdt, kernels=kernels)
        elif layout == "whole":
            ck_i = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False).astype(cdt)
            cv_i = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False).astype(cdt)
            scores = kernels.einsum_f32("bkrh,bkhs->bkrs", q, ck_i)
            scores = jnp.where(visible_bs[:, None, None, :], scores * hd**-0.5, MASK_VALUE)
            probs = jax.nn.softmax(scores, axis=-1).astype(cdt)
            att = kernels.einsum_f32("bkrs,bksh->bkrh", probs, cv_i)
        return att, ck, cv

    # [B, 1, hd / 2]; a row's position never exceeds its slot (< S, the table's rows).
    cos, sin = rope_angles(positions_b[:, None], spec, table=w.get("rope"))
    if layout == "whole":
        k_slot = jnp.arange(cache_slots(cache))
        visible_bs = (k_slot[None, :] >= kv_start_b[:, None]) & (k_slot[None, :] <= slot)
    if packed:
        x = _cpu_kernels.take_rows(w["embed"], tokens_b)
    else:
        x = jnp.take(w["embed"], tokens_b, axis=0).astype(cdt)  # [B, D]

    def layer(carry, i):
        x, ck, cv = carry
        qkv = normed_dense(x, i, "attn_norm", "qkv", (H + 2 * K) * hd)
        if spec.qkv_bias:
            qkv = qkv + at("qkv_bias", i)
        if layout == "tiled" and not spec.qk_norm:  # split, rotate, write, attend
            att, ck, cv = _cpu_kernels.decode_attention_qkv(
                qkv, cos[:, 0], sin[:, 0], ck, cv, kv_start_b, slot, hd**-0.5, par, layer=i
            )
            ck, cv = constrain(ck, keys_axes), constrain(cv, values_axes)
        else:
            att, ck, cv = attend(qkv, ck, cv, i)
        o_bias = at("o_bias", i) if spec.o_bias else None
        x = residual_dense(x, att.astype(cdt).reshape(B, H * hd), i, "o", o_bias)
        return (mlp(x, i), ck, cv), None

    (x, ck, cv), _ = jax.lax.scan(layer, (x, *cache), jnp.arange(spec.num_layers))
    if packed:  # the final norm and the head in the kernel
        logits = _cpu_kernels.matmul(x, w["head"], spec.vocab_size, par, norm_eps=eps)
        return logits, (ck, cv)
    logits = lm_logits(spec, w["final_norm"], w["head"], x[:, None, :], kernels=kernels)[:, 0]
    return logits, (ck, cv)


def _filled_blocks_attention(q, ck, cv, layer, kv_start_b, slot, *, cdt, kernels) -> jax.Array:
    """q [B, K, R, hd] over `layer`'s slots of the blocked cache up to `slot`: an
    online softmax (kernels.xla.online_softmax) over blocks 0 .. slot // blk, the
    blocks written so far. [B, K, R, hd] float32. Fully padded blocks of a row (left
    padding) drop out: its own slot, in the last block, is always visible."""
    B, K, R, hd = q.shape
    blk = cv.shape[4]
    in_block = jnp.arange(blk)

    def take(cache, j):  # [L, B, N, ...] -> [B, ...] of layer `layer`, block j
        start = (layer, 0, j) + (0,) * (cache.ndim - 3)
        size = (1, B, 1, *cache.shape[3:])
        return jax.lax.dynamic_slice(cache, start, size).reshape(B, *cache.shape[3:])

    def block_fn(j):
        kb, vb = take(ck, j).astype(cdt), take(cv, j).astype(cdt)
        s_b = j * blk + in_block
        visible = (s_b[None, :] >= kv_start_b[:, None]) & (s_b[None, :] <= slot)
        s = kernels.einsum_f32("bkrh,bkhs->bkrs", q, kb)
        return jnp.where(visible[:, None, None, :], s * hd**-0.5, MASK_VALUE), vb

    shape = (B, K, R, hd)
    return online_softmax(
        slot // blk + 1, block_fn, "bkrs,bksh->bkrh", shape, einsum=kernels.einsum_f32
    )
