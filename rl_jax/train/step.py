"""The jitted pieces of an RL step: pure functions of (params, opt_state, batch).

A `TrainBatch` is what the host assembles from rollouts: every row is a
left-padded prompt followed by its completion, with per-row positions.
Completion-aligned arrays are [B, Tg]; the log-prob of completion token j sits
at column Tp - 1 + j of the model's next-token log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_jax.config import LossConfig
from rl_jax.losses import LossInputs, loss_from_config
from rl_jax.models import ModelSpec, Transformer, logprobs_from_hidden
from rl_jax.models.moe import RouterStats, aux_losses
from rl_jax.runtime import xla_options
from rl_jax.sampling._decoder import round_up
from rl_jax.sharding import batch_sharding
from rl_jax.train.params import ParamFormat

Params = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    tokens: jax.Array  # [B, Tp + Tg] int32: prompt (left-padded) + completion (right-padded)
    valid: jax.Array  # [B, Tp + Tg] bool: real tokens (the model attends to these)
    positions: jax.Array  # [B, Tp + Tg] int32
    mask: jax.Array  # [B, Tg] float32: 1 on trained completion tokens
    sampler_logp: jax.Array  # [B, Tg] float32
    advantages: jax.Array  # [B] float32, or [B, Tg] per token (GAE)
    group_ids: jax.Array  # [B] int32 in [0, P)
    old_logp: jax.Array | None = None  # [B, Tg]
    ref_logp: jax.Array | None = None  # [B, Tg]
    old_values: jax.Array | None = None  # [B, Tg] critic before this batch's updates (PPO)
    returns: jax.Array | None = None  # [B, Tg] GAE returns (PPO)
    # [B, Tp + Tg, L, k] each token's experts as the sampler routed it (routing replay,
    # `model.routing_replay`; Rollouts.routes): the forward routes every token so.
    routes: jax.Array | None = None
    # Static: rows [g * G, (g + 1) * G) share one prompt (put_batch finds G), so the
    # forward runs each prompt once per G rows; 1 = every row whole.
    group_size: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def prompt_len(self) -> int:
        return int(self.tokens.shape[1] - self.mask.shape[1])

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


def assemble_batch(
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    completion_tokens: np.ndarray,
    lengths: np.ndarray,
    loss_mask: np.ndarray,
    sampler_logp: np.ndarray,
    advantages: np.ndarray,
    group_ids: np.ndarray,
) -> dict[str, np.ndarray]:
    """Host-side arrays of a TrainBatch (numpy), before device placement."""
    Tg = completion_tokens.shape[1]
    gen_valid = np.arange(Tg)[None, :] < lengths[:, None]
    valid = np.concatenate([prompt_mask.astype(bool), gen_valid], axis=1)
    return {
        "tokens": np.concatenate([prompt_tokens, completion_tokens], axis=1).astype(np.int32),
        "valid": valid,
        # As rl_jax.models.positions_from_valid, on the host (no device round trip).
        "positions": np.maximum(np.cumsum(valid, axis=1, dtype=np.int32) - 1, 0),
        "mask": loss_mask.astype(np.float32),
        "sampler_logp": sampler_logp.astype(np.float32),
        "advantages": advantages.astype(np.float32),
        "group_ids": group_ids.astype(np.int32),
    }


def rollout_arrays(rollouts, loss_mask: np.ndarray, advantages: np.ndarray) -> dict:
    """`assemble_batch`'s arrays of a `Rollouts` (its completions' `loss_mask` [B, Tg] and
    `advantages`), with the experts its sampler recorded (routing replay) where it did."""
    host = assemble_batch(
        rollouts.prompt_tokens,
        rollouts.prompt_mask,
        rollouts.completion_tokens,
        rollouts.lengths,
        loss_mask,
        rollouts.logprobs,
        advantages,
        rollouts.group_ids,
    )
    if rollouts.routes is not None:  # every forward of the batch routes tokens so
        host["routes"] = rollouts.routes
    return host


def shared_prompt_rows(arrays: dict[str, np.ndarray]) -> int:
    """G such that rows [g * G, (g + 1) * G) of a host batch share one prompt, else 1.

    The candidate blocks are the runs of equal `group_ids` (the loop keeps a
    group's rows together); the prompts (tokens and validity) must match exactly.
    """
    g = np.asarray(arrays["group_ids"])
    B = g.shape[0]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if B else np.zeros(0, int)
    if len(starts) == 0 or B % len(starts) or len(starts) == B:
        return 1
    G = B // len(starts)
    if not np.array_equal(starts, np.arange(0, B, G)):
        return 1
    tp = arrays["tokens"].shape[1] - arrays["mask"].shape[1]
    first = np.repeat(starts, G)
    for k in ("tokens", "valid", "positions"):
        p = np.asarray(arrays[k])[:, :tp]
        if not np.array_equal(p, p[first]):
            return 1
    return G


def put_batch(arrays: dict[str, np.ndarray], mesh: Mesh | None) -> TrainBatch:
    """Rows over the mesh's batch axes (every process holds the full batch); the
    batch's `group_size` is found on the host (see shared_prompt_rows)."""
    _check_positions(arrays)
    return _on_device(arrays, mesh, shared_prompt_rows(arrays))


def _on_device(arrays: dict[str, np.ndarray], mesh: Mesh | None, G: int, *, stacked=False):
    """The TrainBatch of host `arrays` (`stacked`: minibatches on a leading axis)."""
    if mesh is None:
        return TrainBatch(**{k: jnp.asarray(v) for k, v in arrays.items()}, group_size=G)
    out = {k: _place(v, _row_sharding(mesh, v.ndim, stacked)) for k, v in arrays.items()}
    return TrainBatch(**out, group_size=G)


def _row_sharding(mesh: Mesh, ndim: int, stacked: bool) -> NamedSharding:
    """Rows over the mesh's batch axes; `stacked`: rows are the second axis, after the
    minibatches' (not sharded)."""
    if not stacked:
        return batch_sharding(mesh, ndim)
    return NamedSharding(mesh, PartitionSpec(None, *batch_sharding(mesh, ndim - 1).spec))


def _check_positions(arrays: dict[str, np.ndarray]) -> None:
    pos, T = np.asarray(arrays["positions"]), arrays["tokens"].shape[1]
    if pos.size and not 0 <= pos.min() <= pos.max() < T:
        # The step's rotary table covers positions 0 .. T - 1 (completion_forward).
        raise ValueError(f"batch positions must lie in [0, {T}); got {pos.min()}..{pos.max()}")


def _place(v: np.ndarray, sharding: NamedSharding) -> jax.Array:
    if jax.process_count() > 1:
        return jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])
    return jax.device_put(v, sharding)


def completion_forward(
    spec: ModelSpec,
    rules,
    mesh: Mesh | None,
    params: Params,
    batch: TrainBatch,
    temperature: float,
    *,
    values: bool = False,
    group_size: int | None = None,
    router: bool = False,
) -> tuple[jax.Array, ...]:
    """(log p, entropy, values or None) of each completion token, [B, Tg]; with `router`
    (a mixture of experts) a fourth result, the router's statistics of each layer over
    the batch's valid tokens (`rl_jax.models.moe.RouterStats`, [L, ...]).

    Column j is the state before completion token j is generated: the last
    prompt token predicts token 0, completion token j - 1 predicts token j. The
    LM head runs only on these Tg columns, at the sampling temperature; values
    are the critic's estimate at the same columns.

    `group_size` G (default `batch.group_size`) > 1: rows [g * G, (g + 1) * G)
    share one prompt, which then runs through the model once per group instead
    of once per row; its keys and values are shared by the group's completions.
    The last completion token is never fed (nothing reads its output), so the
    forward sees P x Tp + B x (Tg - 1) tokens instead of B x (Tp + Tg), Tg - 1 rounded
    up to the platform's sequence tile (`Kernels.seq_tile`: 16 on TPU). Equal
    to one forward over each whole row up to float32 rounding.
    """
    model = Transformer(spec, params, mesh=mesh, rules=rules)
    tp, tg = batch.prompt_len, batch.mask.shape[1]
    B = batch.num_rows
    G = batch.group_size if group_size is None else group_size
    G = G if G > 1 and B % G == 0 else 1
    h, stats = _completion_hidden(model, batch, tp, tg, G, router=router)
    targets = batch.tokens[:, tp : tp + tg]
    logp, ent = logprobs_from_hidden(model, h, targets, temperature=temperature)
    out = (logp, ent, (model.values(h) if values else None))
    return (*out, stats) if router else out


def _completion_hidden(
    model: Transformer, batch: TrainBatch, tp: int, tg: int, G: int, *, router: bool = False
):
    """Residual stream [B, Tg, D] at the columns that predict the completion tokens, and
    the router's statistics (`router`; else None)."""
    # Prompt stream: one row per group, [P, Tp]; completion stream: [B, Tc], Tc = Tg - 1
    # (at least 1: zero-length arrays do not reshape). Both are rounded up to the
    # platform's sequence tile (`Kernels.seq_tile`): the prompts with invalid columns
    # in front (more left pads), the completions with columns past Tg - 1 that nothing
    # reads (the row's last token where it exists, else invalid pads; causality hides
    # both from the real columns).
    tile = model.kernels.seq_tile
    tc = round_up(max(tg - 1, 1), tile)
    arrays = (batch.tokens, batch.positions, batch.valid)
    routes = () if batch.routes is None else (batch.routes,)

    def pad(a, before, after):  # columns, the second axis
        return jnp.pad(a, ((0, 0), (before, after), *((0, 0),) * (a.ndim - 2)))

    prompt = [pad(a[::G, :tp], -tp % tile, 0) for a in (*arrays, *routes)]
    completion = [pad(a[:, tp : tp + tc], 0, max(tc - tg, 0)) for a in (*arrays, *routes)]
    xp, xc, *stats = model.shared_prefix(
        *prompt[:3],
        *completion[:3],
        group_size=G,
        with_router=router,
        routes=(prompt[3], completion[3]) if routes else None,
    )
    last = jnp.repeat(xp[:, -1:], G, axis=0)  # the last prompt token predicts token 0
    return jnp.concatenate([last, xc[:, : tg - 1]], axis=1), (stats[0] if router else None)


def completion_logprobs(spec, rules, mesh, params, batch, temperature):
    """(log p, entropy) of each completion token, [B, Tg] (see completion_forward)."""
    logp, ent, _ = completion_forward(spec, rules, mesh, params, batch, temperature)
    return logp, ent


def compiler_options(mesh: Mesh | None, spec: ModelSpec) -> dict[str, Any]:
    """XLA options of the trainer's jitted functions (see rl_jax.runtime.xla_options)."""
    return xla_options(mesh, eigen_matmuls=True, exact_rounding=spec.exact_rounding)


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


# The LossInputs fields a TrainBatch holds as they are: all but the forward's (log-probs,
# entropy, values) and packing's seq_ids.
_BATCH_LOSS_INPUTS = {f.name for f in dataclasses.fields(TrainBatch)} & {
    f.name for f in dataclasses.fields(LossInputs)
}


def _loss_fn(
    spec: ModelSpec,
    rules,
    mesh: Mesh | None,
    loss_cfg: LossConfig,
    *,
    num_groups: int,
    max_tokens: int,
    temperature: float,
) -> Callable[[Params, TrainBatch], tuple[jax.Array, dict[str, jax.Array]]]:
    """loss_fn(weights, batch) -> (loss, metrics) of the model's weights on one minibatch."""
    loss_cfg = loss_cfg.resolved()
    critic = loss_cfg.advantage == "gae"

    def loss_fn(params: Params, batch: TrainBatch):
        logp, ent, values, *router = completion_forward(
            spec, rules, mesh, params, batch, temperature, values=critic, router=spec.is_moe
        )
        given = {k: getattr(batch, k) for k in _BATCH_LOSS_INPUTS}
        inputs = LossInputs(logp=logp, entropy=ent, values=values, **given)
        loss, metrics = loss_from_config(
            loss_cfg, inputs, num_groups=num_groups, max_tokens=max_tokens
        )
        if router:
            loss, metrics = _with_router_terms(spec, loss_cfg, loss, metrics, router[0])
        return loss, metrics

    return loss_fn


def _with_router_terms(
    spec: ModelSpec, loss_cfg: LossConfig, loss: jax.Array, metrics: dict, stats: RouterStats
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A mixture of experts' loss with the router's terms (`loss.router_aux_coef`,
    `loss.router_z_coef`; zero by default, as in the families' RL recipes), and its
    router metrics: both terms, the router's entropy, each expert's share of the
    assignments (`router_load/j`) and the largest share times E (1 = balanced)."""
    E = spec.num_experts
    r = aux_losses(stats, num_experts=E, top_k=spec.num_experts_per_tok)
    if loss_cfg.router_aux_coef:
        loss = loss + loss_cfg.router_aux_coef * r["load_balance"]
    if loss_cfg.router_z_coef:
        loss = loss + loss_cfg.router_z_coef * r["z"]
    metrics = dict(metrics, loss=loss)  # the total the gradient is of
    metrics["router_aux_loss"] = r["load_balance"]
    metrics["router_z_loss"] = r["z"]
    metrics["router_entropy"] = r["entropy"]
    metrics["router_load_max"] = E * jnp.max(r["load"])
    metrics.update({f"router_load/{j}": r["load"][j] for j in range(E)})
    return loss, metrics


def _step_fn(
    loss_fn: Callable, tx: optax.GradientTransformation, plan: ParamFormat
) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """step(params, opt_state, batch) -> (params, opt_state, metrics): one optimizer
    update of `loss_fn` (`_loss_fn`) on one minibatch, not jitted (make_update compiles
    it, M of them in a scan).

    `params` is the trainer's state of `plan` (rl_jax.train.params): the loss sees
    `plan.train_view(params)` (`plan.view`'s values, gradients added in float32), the
    optimizer updates the trained part (`opt_state` is `plan.init_optimizer`'s).

    A NaN/Inf in the loss or any gradient skips the update (params and optimizer
    state pass through unchanged) and reports `nonfinite = 1`.
    """

    def step(params: Params, opt_state, batch: TrainBatch):
        trained, frozen = plan.split(params)

        def trained_loss(t):
            return loss_fn(plan.train_view(plan.join(t, frozen)), batch)

        (loss, metrics), grads = jax.value_and_grad(trained_loss, has_aux=True)(trained)
        finite = jnp.isfinite(loss) & _all_finite(grads)
        grad_norm = optax.global_norm(grads)

        # A conditional rather than a select of new against old per leaf: the update's
        # new params and moments are then never alive beside the old ones (bench
        # workload: peak RSS 874-895 -> 857-860 MB).
        def update(state):
            return plan.apply(tx, grads, state[1], state[0])

        trained, opt_state = jax.lax.cond(finite, update, lambda state: state, (trained, opt_state))
        params = plan.join(trained, frozen)
        metrics = dict(metrics)
        metrics["grad_norm"] = jnp.where(finite, grad_norm, jnp.nan)
        metrics["nonfinite"] = (~finite).astype(jnp.float32)
        return params, opt_state, metrics

    return step


def make_update(
    spec: ModelSpec,
    rules,
    mesh: Mesh | None,
    tx: optax.GradientTransformation,
    loss_cfg: LossConfig,
    *,
    num_groups: int,
    max_tokens: int,
    temperature: float,
    state_shardings: tuple[Any, Any] | None = None,
    plan: ParamFormat | None = None,
) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """jit(update)(params, opt_state, batches) -> (params, opt_state, metrics [M]).

    `batches` holds M minibatches stacked on a leading axis (`put_minibatches`); the
    M updates of one RL step run one after another under `lax.scan` in one program,
    each as `_step_fn` (num_groups: prompts per minibatch; params and opt_state those of
    `plan`: the trainer's state, `rl_jax.train.params`; default: the model's weights, all
    trained, as they are). State donated; `state_shardings` pins the outputs to the
    inputs' layout, so the next call sees the same shardings and does not recompile.
    """
    loss_fn = _loss_fn(
        spec,
        rules,
        mesh,
        loss_cfg,
        num_groups=num_groups,
        max_tokens=max_tokens,
        temperature=temperature,
    )
    plan = ParamFormat(param_dtype=spec.param_dtype, precision="pure") if plan is None else plan
    step = _step_fn(loss_fn, tx, plan)

    def update(params: Params, opt_state, batches: TrainBatch):
        def body(state, batch):
            params, opt_state, metrics = step(*state, batch)
            return (params, opt_state), metrics

        (params, opt_state), metrics = jax.lax.scan(body, (params, opt_state), batches)
        return params, opt_state, metrics

    pinned = {} if state_shardings is None else {"out_shardings": (*state_shardings, None)}
    opts = compiler_options(mesh, spec)
    return jax.jit(update, donate_argnums=(0, 1), compiler_options=opts, **pinned)


def put_minibatches(
    arrays: dict[str, np.ndarray], mesh: Mesh | None, *, num_minibatches: int, groups: int
) -> TrainBatch:
    """A host batch of `groups` prompt groups as M = num_minibatches minibatches stacked
    on a leading axis [M, B / M, ...]: minibatch j holds prompts [j P / M, (j + 1) P / M),
    its group ids renumbered from 0, and its rows lie over the mesh's batch axes as
    put_batch lays a batch out."""
    M, B = num_minibatches, len(arrays["group_ids"])
    parts = []
    for j in range(M):
        mb = {k: v[j * B // M : (j + 1) * B // M] for k, v in arrays.items()}
        mb["group_ids"] = mb["group_ids"] - j * (groups // M)
        _check_positions(mb)
        parts.append(mb)
    sizes = {shared_prompt_rows(mb) for mb in parts}
    G = sizes.pop() if len(sizes) == 1 else 1
    stacked = {k: np.stack([mb[k] for mb in parts]) for k in arrays}
    return _on_device(stacked, mesh, G, stacked=True)


def abstract_batch(
    mesh: Mesh,
    groups: int,
    G: int,
    tp: int,
    tg: int,
    *,
    old: bool,
    ref: bool,
    critic: bool,
    routes: tuple[int, int, np.dtype] | None = None,
    stack: int | None = None,
) -> TrainBatch:
    """The TrainBatch `put_batch` makes of `groups` prompt groups of G rows, `tp` prompt
    and `tg` completion columns, as abstract arrays on `mesh` (`rl-jax plan` compiles the
    trainer's programs on these); `stack`: that many such minibatches on a leading axis,
    laid out as `put_minibatches` lays them out. old/ref/critic: the optional fields the
    recipe's passes fill (`rl_jax.train.accounting.Passes`); routes: (layers, experts per
    token, dtype) of the sampler's recorded experts (routing replay), or None."""
    rows, T = groups * G, tp + tg

    def arr(shape, dtype):
        shape = shape if stack is None else (stack, *shape)
        sharding = _row_sharding(mesh, len(shape), stack is not None)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    f32 = jnp.float32
    return TrainBatch(
        tokens=arr((rows, T), jnp.int32),
        valid=arr((rows, T), jnp.bool_),
        positions=arr((rows, T), jnp.int32),
        mask=arr((rows, tg), f32),
        sampler_logp=arr((rows, tg), f32),
        advantages=arr((rows, tg) if critic else (rows,), f32),
        group_ids=arr((rows,), jnp.int32),
        old_logp=arr((rows, tg), f32) if old else None,
        ref_logp=arr((rows, tg), f32) if ref else None,
        old_values=arr((rows, tg), f32) if critic else None,
        returns=arr((rows, tg), f32) if critic else None,
        routes=None if routes is None else arr((rows, T, routes[0], routes[1]), routes[2]),
        group_size=G,
    )


def make_logprob_fn(
    spec: ModelSpec,
    rules,
    mesh: Mesh | None,
    *,
    temperature: float,
    plan: ParamFormat | None = None,
):
    """jit(fn)(params, batch) -> logp (old or reference policy; no gradient); params as
    make_update's.

    `batch` is one batch (`put_batch`: logp [B, Tg]) or M minibatches stacked on a
    leading axis as the update takes them (`put_minibatches`: logp [M, B / M, Tg]). The
    stacked pass runs the minibatches one after another under `lax.scan`, so that it
    holds one minibatch's activations, as an update does, not the whole batch's (at
    Qwen3-8B's ScaleRL shapes, 39.5 GB of temporaries per chip whole)."""
    view = plan.view if plan is not None else (lambda p: p)

    def fn(params: Params, batch: TrainBatch) -> jax.Array:
        p = view(params)

        def one(mb: TrainBatch) -> jax.Array:
            return completion_logprobs(spec, rules, mesh, p, mb, temperature)[0]

        if batch.mask.ndim == 2:
            return one(batch)
        return jax.lax.scan(lambda c, mb: (c, one(mb)), None, batch)[1]

    return jax.jit(fn, compiler_options=compiler_options(mesh, spec))


def make_value_fn(spec: ModelSpec, rules, mesh: Mesh | None, *, plan: ParamFormat | None = None):
    """jit(fn)(params, batch) -> critic values [B, Tg] before the updates (PPO's GAE)."""
    view = plan.view if plan is not None else (lambda p: p)

    def fn(params: Params, batch: TrainBatch):
        return completion_forward(spec, rules, mesh, view(params), batch, 1.0, values=True)[2]

    return jax.jit(fn, compiler_options=compiler_options(mesh, spec))
