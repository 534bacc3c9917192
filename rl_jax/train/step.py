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
from jax.sharding import Mesh

from rl_jax.config import LossConfig
from rl_jax.losses import LossInputs, loss_from_config
from rl_jax.models import ModelSpec, Transformer, logprobs_from_hidden, positions_from_valid
from rl_jax.sharding import batch_sharding

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
        "positions": np.asarray(positions_from_valid(valid)).astype(np.int32),
        "mask": loss_mask.astype(np.float32),
        "sampler_logp": sampler_logp.astype(np.float32),
        "advantages": advantages.astype(np.float32),
        "group_ids": group_ids.astype(np.int32),
    }


def put_batch(arrays: dict[str, np.ndarray], mesh: Mesh | None) -> TrainBatch:
    """Rows over the mesh's batch axes (every process holds the full batch)."""
    if mesh is None:
        return TrainBatch(**{k: jnp.asarray(v) for k, v in arrays.items()})
    out = {}
    for k, v in arrays.items():
        sh = batch_sharding(mesh, v.ndim)
        if jax.process_count() > 1:
            out[k] = jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx])
        else:
            out[k] = jax.device_put(v, sh)
    return TrainBatch(**out)


def completion_forward(
    spec: ModelSpec,
    rules,
    mesh: Mesh | None,
    params: Params,
    batch: TrainBatch,
    temperature: float,
    *,
    values: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(log p, entropy, values or None) of each completion token, [B, Tg].

    One forward over prompt + completion; the LM head runs only on the Tg columns
    that predict completion tokens (column Tp - 1 + j predicts token j), at the
    sampling temperature. Values are the critic's estimate at the same columns
    (the state before token j is generated).
    """
    model = Transformer(spec, params, mesh=mesh, rules=rules)
    hidden, _ = model(batch.tokens, batch.positions, kv_valid_bs=batch.valid)
    tp, tg = batch.prompt_len, batch.mask.shape[1]
    h = hidden[:, tp - 1 : tp - 1 + tg]
    targets = batch.tokens[:, tp : tp + tg]
    logp, ent = logprobs_from_hidden(model, h, targets, temperature=temperature)
    return logp, ent, (model.values(h) if values else None)


def completion_logprobs(spec, rules, mesh, params, batch, temperature):
    """(log p, entropy) of each completion token, [B, Tg] (see completion_forward)."""
    logp, ent, _ = completion_forward(spec, rules, mesh, params, batch, temperature)
    return logp, ent


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_train_step(
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
) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """jit(step)(params, opt_state, batch) -> (params, opt_state, metrics); state donated.

    `state_shardings` pins the outputs to the inputs' layout, so the next call sees
    the same shardings and does not recompile.

    A NaN/Inf in the loss or any gradient skips the update (params and optimizer
    state pass through unchanged) and reports `nonfinite = 1`.
    """

    critic = loss_cfg.advantage == "gae"

    def loss_fn(params: Params, batch: TrainBatch):
        logp, ent, values = completion_forward(
            spec, rules, mesh, params, batch, temperature, values=critic
        )
        inputs = LossInputs(
            logp=logp,
            sampler_logp=batch.sampler_logp,
            advantages=batch.advantages,
            mask=batch.mask,
            group_ids=batch.group_ids,
            old_logp=batch.old_logp,
            ref_logp=batch.ref_logp,
            entropy=ent,
            values=values,
            old_values=batch.old_values,
            returns=batch.returns,
        )
        return loss_from_config(loss_cfg, inputs, num_groups=num_groups, max_tokens=max_tokens)

    def step(params: Params, opt_state, batch: TrainBatch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        finite = jnp.isfinite(loss) & _all_finite(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt, opt_state)
        metrics = dict(metrics)
        metrics["grad_norm"] = jnp.where(finite, optax.global_norm(grads), jnp.nan)
        metrics["nonfinite"] = (~finite).astype(jnp.float32)
        return params, opt_state, metrics

    if state_shardings is None:
        return jax.jit(step, donate_argnums=(0, 1))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*state_shardings, None))


def make_logprob_fn(spec: ModelSpec, rules, mesh: Mesh | None, *, temperature: float):
    """jit(fn)(params, batch) -> logp [B, Tg] (old or reference policy; no gradient)."""

    def fn(params: Params, batch: TrainBatch) -> jax.Array:
        return completion_logprobs(spec, rules, mesh, params, batch, temperature)[0]

    return jax.jit(fn)


def make_value_fn(spec: ModelSpec, rules, mesh: Mesh | None):
    """jit(fn)(params, batch) -> critic values [B, Tg] before the updates (PPO's GAE)."""

    def fn(params: Params, batch: TrainBatch):
        return completion_forward(spec, rules, mesh, params, batch, 1.0, values=True)[2]

    return jax.jit(fn)
