"""The sparse mixture-of-experts MLP (Qwen3-MoE): a softmax router picks each token's top
k of E SwiGLU experts; their outputs are summed, weighted by the router's probabilities.

Dispatch is dropless: the N x k (token, expert) assignments are sorted by expert and
every expert multiplies exactly its rows in one grouped matmul
(`Kernels.grouped_matmul`, `jax.lax.ragged_dot`); no token is dropped and no capacity
is reserved, in training and in sampling alike, so the trainer and the sampler route the
same tokens to the same experts (up to the rounding of the router's logits). Nothing of
size [N, E, D] is built: the dispatch is a gather of N x k rows, the combine a gather
back and a weighted sum over k.

Dimension letters: N tokens, D width, E experts, k experts per token, Fe an expert's
MLP width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from rl_jax.kernels.xla import grouped_matmul as xla_grouped_matmul
from rl_jax.kernels.xla import matmul
from rl_jax.models.layers import swiglu
from rl_jax.sharding.rules import Rules, fit_spec, logical_to_spec

if TYPE_CHECKING:
    from rl_jax.models.spec import ModelSpec


class RouterStats(NamedTuple):
    """Sums over one forward's valid tokens of one layer (or [L] / [L, E] stacked by the
    scan over layers); sums, so that streams (prompts and completions) add up.

    tokens: valid tokens routed. load: [E] assignments per expert (sums to k x tokens).
    prob: [E] router probabilities per expert. z: squared log-sum-exp of the router's
    logits. entropy: the router distribution's entropy (nats)."""

    tokens: jax.Array
    load: jax.Array
    prob: jax.Array
    z: jax.Array
    entropy: jax.Array

    def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
        return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))


def _one_hot(ids: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """ids [...] as [..., n] one-hots (an id outside 0 .. n - 1: all zeros). Summed, they
    count ids per value, or pick each id's value of an [..., n] array, without the
    scatter-add or gather (and its backward, a scatter) that libtpu counts at many times
    the compare-and-sum's HBM bytes (docs/results/moe.md)."""
    return (ids[..., None] == jnp.arange(n, dtype=ids.dtype)).astype(dtype)


def route(
    x_nd: jax.Array,
    router_de: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits [N, E] float32, chosen experts [N, k] int32, their weights [N, k] float32).

    The router runs in float32 whatever the compute dtype (a bf16 router flips near-tied
    choices between two forwards that round differently: the trainer's and the
    sampler's). Weights are the chosen softmax probabilities, renormalized to sum to 1
    with `norm_topk_prob` (transformers' Qwen3MoeTopKRouter).

    `experts` [N, k] (routing replay): these experts instead of the top k, weighted by
    this router's probabilities of them (the router still learns through the weights)."""
    logits = matmul(x_nd.astype(jnp.float32), router_de.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:  # one-hots over the E probabilities, not a gather (`_one_hot`)
        experts = experts.astype(jnp.int32)
        weights = jnp.sum(_one_hot(experts, probs.shape[-1]) * probs[:, None, :], axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, experts.astype(jnp.int32), weights


def route_dtype(num_experts: int) -> np.dtype:
    """The narrowest integer dtype that holds expert ids 0 .. num_experts - 1: what the
    sampler records a token's experts in (routing replay; `Rollouts.routes`)."""
    for dt in (np.uint8, np.int16):
        if num_experts <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    return np.dtype(np.int32)


def router_stats(logits_ne: jax.Array, experts_nk: jax.Array, valid_n: jax.Array | None):
    """RouterStats of one layer's tokens (pads, valid_n False, left out)."""
    N, E = logits_ne.shape
    w = jnp.ones((N,), jnp.float32) if valid_n is None else valid_n.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits_ne, axis=-1)
    probs = jnp.exp(logp)
    lse = jax.nn.logsumexp(logits_ne, axis=-1)
    k = experts_nk.shape[1]
    load = jnp.sum(_one_hot(experts_nk.reshape(-1), E) * jnp.repeat(w, k)[:, None], axis=0)
    return RouterStats(
        tokens=jnp.sum(w),
        load=load,
        prob=jnp.sum(probs * w[:, None], axis=0),
        z=jnp.sum(w * lse * lse),
        entropy=jnp.sum(w * -jnp.sum(probs * logp, axis=-1)),
    )


def moe_mlp(
    h: jax.Array,
    router_de: jax.Array,
    gate_efd: jax.Array,
    up_efd: jax.Array,
    down_efd: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    valid: jax.Array | None = None,
    experts: jax.Array | None = None,
    first: jax.Array | int = 0,
    grouped_matmul: Callable = xla_grouped_matmul,
) -> tuple[jax.Array, RouterStats, jax.Array]:
    """The sparse MLP of h [..., D] (already normed) in h's dtype, its RouterStats and
    each token's experts [..., k] int32.

    router_de [D, E]; gate/up [El, D, Fe], down [El, Fe, D]: experts first .. first +
    El - 1 of the E (default all: El = E, first 0); a token's share from experts outside
    them is left out of its output (`expert_parallel_moe_mlp` sums the shares). valid
    [...] (h's leading shape): the tokens the stats count (every token is computed).
    experts [..., k]: route each token to these (routing replay; `route`)."""
    lead, D = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, D)
    N, El = x.shape[0], gate_efd.shape[0]
    given = None if experts is None else experts.reshape(N, top_k)
    logits, experts, weights = route(
        x, router_de, top_k=top_k, norm_topk_prob=norm_topk_prob, experts=given
    )
    flat = experts.reshape(-1)  # [N k], assignment a = token a // k
    if El < router_de.shape[-1]:  # a window of the experts: the others (El) sort last
        flat = jnp.where((flat >= first) & (flat < first + El), flat - first, El)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    sizes = jnp.sum(_one_hot(flat, El, jnp.int32), axis=0)
    xs = jnp.take(x, order // top_k, axis=0)  # [N k, D]
    dt = x.dtype
    g = grouped_matmul(xs, gate_efd.astype(dt), sizes)
    u = grouped_matmul(xs, up_efd.astype(dt), sizes)
    # [N k, D]; the rows of other experts' assignments, past the groups, come out 0.
    ys = grouped_matmul(jax.nn.silu(g) * u, down_efd.astype(dt), sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(N * top_k, dtype=order.dtype))
    y = jnp.take(ys, back, axis=0).reshape(N, top_k, D)
    out = jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(dt)
    valid_n = None if valid is None else valid.reshape(-1)
    stats = router_stats(logits, experts, valid_n)
    return out.reshape(*lead, D), stats, experts.reshape(*lead, top_k)


# A shared expert's parameters (`shared_expert`), per layer.
SHARED_EXPERT = ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")


def shared_expert(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """A layer's shared expert of h [..., D] (already normed) in h's dtype: a SwiGLU MLP
    every token goes through, scaled by sigmoid(h . shared_expert_gate) (transformers'
    Qwen2MoeSparseMoeBlock adds it to the routed experts' sum)."""
    dt, lead, D = h.dtype, h.shape[:-1], h.shape[-1]
    wg, wu, wd = (p[n].astype(dt) for n in ("shared_gate", "shared_up", "shared_down"))
    gate = matmul(h.reshape(-1, D), p["shared_expert_gate"].astype(dt)[:, None])
    return swiglu(h, wg, wu, wd) * jax.nn.sigmoid(gate).reshape(*lead, 1)


# A layer's routed experts' parameters, in `moe_mlp`'s order.
ROUTED_EXPERTS = ("router", "expert_gate", "expert_up", "expert_down")


def moe_block(spec: ModelSpec, h: jax.Array, weight: Callable, routed: Callable, **kw) -> tuple:
    """A layer's mixture of experts of h (already normed), its weights by name
    (`weight(name)`): `routed(h, weights, **kw)` runs the routed experts (weights in
    ROUTED_EXPERTS order; kw `moe_mlp`'s: the spec's top_k and norm_topk_prob, and e.g.
    grouped_matmul) and returns (out, *more); the shared expert, if the spec has one, is
    added to out. The forward (`moe_mlp`, `sharded_moe_mlp`) and the decode step
    (`moe_mlp`, `expert_parallel_moe_mlp`) differ only in `routed`."""
    kw.update(top_k=spec.num_experts_per_tok, norm_topk_prob=spec.norm_topk_prob)
    out, *more = routed(h, tuple(weight(n) for n in ROUTED_EXPERTS), **kw)
    if spec.shared_expert_intermediate_size:
        out = out + shared_expert(h, {n: weight(n) for n in SHARED_EXPERT})
    return out, *more


def aux_losses(stats: RouterStats, *, num_experts: int, top_k: int) -> dict[str, jax.Array]:
    """Router losses and metrics of RouterStats stacked over layers ([L], [L, E]).

    load_balance: Switch Transformer's E x sum_e f_e P_e per layer (f_e the fraction of
    assignments to expert e, P_e its mean router probability), averaged over layers: 1
    when routing is uniform, up to E when one expert takes everything. z: ST-MoE's mean
    squared log-sum-exp of the router logits. load: [E] fraction of assignments per
    expert over all layers; entropy: the router's mean entropy (nats)."""
    n = jnp.maximum(stats.tokens, 1.0)  # [L]
    f = stats.load / (n[:, None] * top_k)  # [L, E], rows sum to 1
    p = stats.prob / n[:, None]
    total = jnp.maximum(jnp.sum(stats.load), 1.0)
    return dict(
        load_balance=jnp.mean(num_experts * jnp.sum(f * p, axis=-1)),
        z=jnp.mean(stats.z / n),
        load=jnp.sum(stats.load, axis=0) / total,
        entropy=jnp.mean(stats.entropy / n),
    )


def _mesh_axes(mesh: Mesh, rules: Rules, logical: str, dim: int) -> tuple[str, ...]:
    """The mesh axes the rules map `logical` to that divide a dimension of size dim."""
    a = fit_spec(logical_to_spec((logical,), rules), (dim,), mesh)[0]
    return () if a is None else (a,) if isinstance(a, str) else tuple(a)


def _rows_and_width(mesh: Mesh, rules: Rules, N: int, Fe: int):
    """The mesh axes of a sparse MLP's N rows (`batch`) and of each expert's width Fe
    (`mlp`; none where they share an axis with the rows)."""
    b, m = _mesh_axes(mesh, rules, "batch", N), _mesh_axes(mesh, rules, "mlp", Fe)
    return b, (() if set(b) & set(m) else m)


def expert_parallel_moe_mlp(
    mesh: Mesh,
    rules: Rules,
    h_nd: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    **kw,
) -> tuple[jax.Array, jax.Array]:
    """`moe_mlp` of N tokens h [N, D] (the engine's decode step: one a row, rows over the
    batch axes) with the experts staying where they are stored: over the batch axes
    `expert` maps to (n devices, E / n experts each; each expert's width over the axes
    `mlp` maps to). Each device gathers the tokens of those n devices, multiplies the
    ones routed to its own experts, and the partial outputs are summed and scattered
    back to the tokens' devices: per layer, rows x D move twice, not the experts'
    weights. Returns the output [N, D] and each token's experts [N, k]."""
    N = h_nd.shape[0]
    E, Fe = weights[1].shape[0], weights[1].shape[-1]
    b, m = _rows_and_width(mesh, rules, N, Fe)
    e = tuple(a for a in _mesh_axes(mesh, rules, "expert", E) if a in b)

    def local(h, router, wg, wu, wd):
        rows, at = h.shape[0], 0
        if e:
            h = jax.lax.all_gather(h, e, axis=0, tiled=True)
            at = jax.lax.axis_index(e)
        out, _, chosen = moe_mlp(h, router, wg, wu, wd, first=at * wg.shape[0], **kw)
        if m:
            out = jax.lax.psum(out, m)
        if e:
            out = jax.lax.psum_scatter(out, e, scatter_dimension=0, tiled=True)
            chosen = jax.lax.dynamic_slice_in_dim(chosen, at * rows, rows)
        return out, chosen

    row, ex = P(b or None, None), (e or None)
    in_specs = (row, P(), P(ex, None, m or None), P(ex, None, m or None), P(ex, m or None, None))
    shard = jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=(row, row), check_vma=False
    )
    return shard(h_nd, *weights)


def sharded_moe_mlp(
    mesh: Mesh,
    rules: Rules,
    h: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    valid: jax.Array | None,
    experts: jax.Array | None = None,
    **kw,
) -> tuple[jax.Array, RouterStats, jax.Array]:
    """`moe_mlp` of h [N, T, D] (replaying `experts` [N, T, k] if given) on a mesh: each
    batch shard routes, sorts and multiplies its own tokens (its rows of N, over the axes
    `batch` maps to), each expert's MLP width split over the axes `mlp` maps to
    (Megatron-style: a partial down projection summed over them); the experts' weights
    are gathered whole along every other axis, as FSDP gathers a dense MLP's.

    (XLA's SPMD partitioner does not split a grouped matmul's ragged rows: left to it,
    every chip would multiply every token of the batch through its experts.)"""
    N, T, _ = h.shape
    Fe = weights[1].shape[-1]
    b_axes, m_axes = _rows_and_width(mesh, rules, N, Fe)
    b, m = b_axes or None, m_axes or None
    valid = jnp.ones((N, T), bool) if valid is None else valid
    replay = experts is not None

    def local(h, router, wg, wu, wd, valid, *given):
        out, stats, chosen = moe_mlp(
            h, router, wg, wu, wd, valid=valid, experts=given[0] if given else None, **kw
        )
        if m_axes:
            out = jax.lax.psum(out, m_axes)
        if b_axes:
            stats = jax.tree.map(lambda s: jax.lax.psum(s, b_axes), stats)
        return out, stats, chosen

    row = P(b, None, None)
    in_specs = (row, P(), P(None, None, m), P(None, None, m), P(None, m, None), P(b, None))
    in_specs += (row,) * replay
    # check_vma=False: a Pallas kernel (megablox on TPU) declares no varying axes for
    # its outputs. Autodiff then sums each replicated input's cotangent over the axes
    # its spec leaves out (the weights' over the batch shards, the rows' over a split
    # width), as the varying-axes check would (tests/test_kernels_tpu.py).
    shard = jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=(row, P(), row), check_vma=False
    )
    return shard(h, *weights, valid, *((experts,) if replay else ()))
