"""The phases of an RL step as functions: rollout -> score -> advantages -> update,
and evaluate.

Each takes the built, unchanging `Parts` of a run and a `TrainerState` and returns
a new state with what it computed; the schedules (`rl_jax.train.schedules`) order
them. Host work (decoding text, verifiers, advantages' bookkeeping) runs in numpy;
every update of a step runs in one jitted program (`make_update`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.losses import advantages_from_config, gae_from_config, zero_variance_groups
from rl_jax.rewards import score_batch, shape_rewards
from rl_jax.sampling import Rollouts, concat_groups
from rl_jax.train.accounting import forward_flops, step_flops
from rl_jax.train.evaluation import eval_key, evaluate_policy
from rl_jax.train.parts import Parts
from rl_jax.train.state import PromptSource, TrainerState
from rl_jax.train.step import put_batch, put_minibatches, rollout_arrays

# ---- rollout ------------------------------------------------------------------------------


def row_ids(parts: Parts, step: int, n_prompts: int) -> np.ndarray:
    # Distinct per (step, row) so every draw of the run is its own stream.
    return (step * 1_000_003 + np.arange(n_prompts * parts.samples_per_prompt)) % (2**31 - 1)


def sample_key(parts: Parts) -> jax.Array:
    return jax.random.fold_in(jax.random.key(parts.cfg.train.seed), 0x5A17)


def prompt_ids(parts: Parts, problems) -> list[list[int]]:
    return [parts.tokenizer.encode(p.prompt) for p in problems]


def generate(parts: Parts, params, version: int, step: int, problems) -> Rollouts:
    """All rows of `problems` sampled to the end with one policy (synchronous modes),
    on the run's engine."""
    rollouts, _ = parts.engine.run(
        params,
        prompt_ids(parts, problems),
        n=parts.samples_per_prompt,
        key=sample_key(parts),
        version=version,
        row_ids=row_ids(parts, step, len(problems)),
    )
    return rollouts


def account_sampling(parts: Parts, state: TrainerState, rollouts: Rollouts) -> TrainerState:
    G = parts.samples_per_prompt
    tp = rollouts.prompt_mask.sum(axis=1)[::G]  # [P] (a group's rows share the prompt)
    return state.count(
        prompt_tokens=int(tp.sum()),
        generated_tokens=int(rollouts.lengths.sum()),
        sampler_flops=forward_flops(parts.spec, tp, rollouts.lengths, G),
    )


def dynamic_rollout(
    parts: Parts, state: TrainerState, prompts: PromptSource, weights
) -> tuple[TrainerState, Rollouts, list]:
    """DAPO dynamic sampling: sample rounds of B_p prompts, keep groups whose rewards
    differ, until B_p are kept or data.max_resample_rounds; short batches are filled
    with zero-variance groups (which the zero-variance filter then drops).

    Zero variance is decided as in training (`score`, shaped rewards). Groups scored
    but not kept still enter the pass-rate history here (the kept ones do in
    `train_on`), so No-Positive-Resampling and the interference histogram see every
    scored group once. `weights`: the sampler's copy of `state`'s policy."""
    P, G = parts.prompts_per_batch, parts.samples_per_prompt
    kept: list[tuple[Rollouts, int, Any, np.ndarray]] = []  # (rollouts, group, problem, raw [G])
    spare: list[tuple[Rollouts, int, Any, np.ndarray]] = []
    for r in range(parts.cfg.data.max_resample_rounds):
        batch = prompts.draw()
        rollouts = generate(parts, weights, state.version, state.step * 64 + r, batch)
        state = account_sampling(parts, state, rollouts)
        sc = score(parts, rollouts, batch)
        for g, zv in enumerate(sc.zero_var):
            (spare if zv else kept).append((rollouts, g, batch[g], sc.raw[g * G : (g + 1) * G]))
        if len(kept) >= P:
            break
    fill = max(0, P - len(kept))
    chosen = (kept + spare[:fill])[:P]
    dropped = kept[P:] + spare[fill:]
    if dropped:
        prompts.record([d[2].id for d in dropped], np.stack([d[3] for d in dropped]))
    state = state.count(rollouts=(r + 1) * P * G - P * G)
    rollouts = concat_groups([(c[0], c[1]) for c in chosen], G)
    return state, rollouts, [c[2] for c in chosen]


# ---- score --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    texts: list[str]  # [B] decoded completions
    raw: np.ndarray  # [B] verifier rewards
    shaped: np.ndarray  # [B] rewards after shaping: what the advantages read
    zero_var: np.ndarray  # [P] bool: groups whose shaped rewards are all equal


def score(parts: Parts, rollouts: Rollouts, problems) -> Scores:
    texts = [parts.tokenizer.decode(rollouts.completion(b)) for b in range(rollouts.num_rows)]
    answers = [problems[g].answer for g in rollouts.group_ids]
    raw = score_batch(parts.reward_fn, texts, answers)
    shaped = shape_rewards(
        raw,
        cfg=parts.cfg.rewards,
        reward_fn=parts.reward_fn,
        completions=texts,
        lengths=rollouts.lengths,
    )
    # `zero_variance_groups` is the one definition: on the rewards the advantages read,
    # so exactly the groups whose advantages are all zero.
    zv, _ = zero_variance_groups(
        jnp.asarray(shaped, jnp.float32),
        jnp.asarray(rollouts.group_ids.astype(np.int32), jnp.int32),
        num_groups=len(problems),
    )
    return Scores(texts=texts, raw=raw, shaped=shaped, zero_var=np.asarray(zv))


# ---- advantages ---------------------------------------------------------------------------


def _policy_logprobs(parts: Parts, state: TrainerState, host, P: int, *, old: bool):
    """(the old policy's log-probs [B, Tg] where `old`, the reference's where the run has
    one; else None). The passes take the update's M minibatches one after another
    (holding one minibatch's activations, as an update does); minibatch j is rows
    [j B / M, (j + 1) B / M), so [M, B / M, Tg] flattens back to the batch's order."""
    if not old and state.ref_params is None:
        return None, None
    stacked = put_minibatches(host, parts.mesh, num_minibatches=parts.updates_per_batch, groups=P)

    def logprobs(params) -> np.ndarray | None:
        if params is None:
            return None
        out = np.asarray(parts.logprob_fn(params, stacked))
        return out.reshape(-1, out.shape[-1])

    return logprobs(state.params if old else None), logprobs(state.ref_params)


def advantages(
    parts: Parts, state: TrainerState, rollouts: Rollouts, scores: Scores, keep_p
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The old policy's and the reference's log-probs and the critic's values, all taken
    before this batch's first update, then the advantages (with the KL in the reward,
    they need the first two). Returns the batch ready for its updates (`rollout_arrays`'
    host arrays with the advantages, and the log-probs the loss reads: the old policy's
    [B, Tg] where the loss keeps it, the reference's [B, Tg] where the run has one) and
    the advantage function's scalar diagnostics."""
    cfg, P, G = parts.cfg, len(keep_p), parts.samples_per_prompt
    keep_b = np.repeat(keep_p, G)
    loss_mask = rollouts.completion_mask & keep_b[:, None]
    group_b = rollouts.group_ids.astype(np.int32)
    host = rollout_arrays(rollouts, loss_mask, np.zeros(P * G, np.float32))  # advantages below
    runs = parts.passes
    kl_reward = runs.ref and cfg.loss.kl_in_reward
    full = put_batch(host, parts.mesh) if runs.critic else None
    old, ref = _policy_logprobs(parts, state, host, P, old=runs.old)
    # KL in the reward: behaviour = the policy before this batch's updates, as the
    # trainer computes it (the same forward as the reference's).
    kl = dict(behaviour_logp_bt=old, ref_logp_bt=ref) if kl_reward else {}
    mask_f = loss_mask.astype(np.float32)
    info: dict = {}
    if runs.critic:
        # GAE from the critic's values before this batch's updates (PPO).
        values = np.asarray(parts.value_fn(state.params, full))
        adv_bt, ret_bt = gae_from_config(
            cfg.loss, jnp.asarray(scores.shaped), jnp.asarray(values), jnp.asarray(mask_f), **kl
        )
        host["advantages"] = np.asarray(adv_bt, np.float32) * loss_mask
        host["old_values"] = values.astype(np.float32)
        host["returns"] = np.asarray(ret_bt, np.float32)
    else:
        adv, info = advantages_from_config(
            cfg.loss,
            jnp.asarray(scores.shaped),
            jnp.asarray(group_b),
            num_groups=P,
            valid_b=jnp.asarray(keep_b),
            mask_bt=jnp.asarray(mask_f) if kl_reward else None,
            **kl,
        )
        host["advantages"] = np.asarray(adv, np.float32) * keep_b
    if runs.keep_old:
        host["old_logp"] = old.astype(np.float32)
    if ref is not None:
        host["ref_logp"] = ref.astype(np.float32)
    return host, info


# ---- update -------------------------------------------------------------------------------


class StalenessError(RuntimeError):
    """A token is more than PipelineRL's k versions older than an update that trains on it."""


def steps_behind(newer, older, grad_accum: int):
    """Optimizer steps between the weights after `older` and after `newer` minibatch
    updates (ints or arrays): optax.MultiSteps steps once per grad_accum of them."""
    return newer // grad_accum - older // grad_accum


def check_staleness(
    versions_bt, mask_bt, version: int, updates: int, k: int, grad_accum: int = 1
) -> int:
    """The largest staleness of any token of a batch, in optimizer steps: its updates run
    at versions `version` .. version + updates - 1 (minibatch updates, counted from 0)
    on tokens sampled at `versions_bt` [B, Tg] (`mask_bt`: the tokens sampled by the
    policy); the weights after v minibatch updates have taken v // grad_accum optimizer
    steps (optax.MultiSteps). StalenessError if any token is more than k steps behind
    the weights of the last update."""
    versions = np.asarray(versions_bt)
    mask = np.asarray(mask_bt, bool)
    if not mask.any():
        return 0
    last = version + updates - 1
    stale_bt = np.where(mask, steps_behind(last, versions, grad_accum), 0)
    worst = int(stale_bt.max())
    if worst > k:
        b, t = np.unravel_index(int(np.argmax(stale_bt)), stale_bt.shape)
        raise StalenessError(
            f"PipelineRL staleness {worst} exceeds k={k} optimizer steps: row {b} token {t} "
            f"was sampled at version {int(versions[b, t])}, trained by the update at version "
            f"{last} (train.grad_accum={grad_accum} minibatch updates per step)"
        )
    return worst


def update(
    parts: Parts, state: TrainerState, host: dict[str, np.ndarray], oldest: int
) -> tuple[TrainerState, dict[str, float]]:
    """The step's M optimizer updates, one per minibatch of P / M prompts, in one jitted
    program; `oldest` is the policy version of the batch's oldest token."""
    M = parts.updates_per_batch
    P = len(host["group_ids"]) // parts.samples_per_prompt
    stacked = put_minibatches(host, parts.mesh, num_minibatches=M, groups=P)
    hist = dict(state.staleness_hist)
    for j in range(M):  # in optimizer steps, as `check_staleness` counts them
        stale = steps_behind(state.version + j, oldest, parts.cfg.train.grad_accum)
        hist[stale] = hist.get(stale, 0) + 1
    params, opt_state, m = parts.update_fn(state.params, state.opt_state, stacked)
    m = jax.device_get(m)  # {name: [M]}
    metrics = {f"train/{k}": float(np.mean([float(x) for x in v])) for k, v in m.items()}
    state = state.replace(
        params=params, opt_state=opt_state, version=state.version + M, staleness_hist=hist
    )
    metrics["train/rows_trained"] = float(host["mask"].any(axis=1).sum())
    nonfinite = sum(float(x) for x in m["nonfinite"])
    return state.replace(nonfinite_streak=state.nonfinite_streak + 1 if nonfinite else 0), metrics


def train_on(
    parts: Parts,
    state: TrainerState,
    prompts: PromptSource,
    rollouts: Rollouts,
    problems,
    scores: Scores,
) -> tuple[TrainerState, dict[str, float]]:
    """Advantages and M updates on one scored batch of P prompts x G samples (its pass
    rates recorded in `prompts`' curriculum); returns the new state and the step's
    metrics."""
    t0 = time.perf_counter()
    P, G = len(problems), parts.samples_per_prompt
    prompts.record([p.id for p in problems], scores.raw.reshape(P, G))
    keep_p = ~scores.zero_var if parts.cfg.data.zero_variance_filter else np.ones(P, bool)
    versions = np.where(rollouts.completion_mask, rollouts.versions, np.iinfo(np.int32).max)
    oldest = int(versions.min()) if rollouts.completion_mask.any() else state.version
    ga = parts.cfg.train.grad_accum
    if keep_p.any():
        if parts.cfg.train.off_policy == "pipeline":
            k, M = parts.cfg.train.off_policy_k, parts.updates_per_batch
            check_staleness(rollouts.versions, rollouts.completion_mask, state.version, M, k, ga)
        host, info = advantages(parts, state, rollouts, scores, keep_p)
        state, metrics = update(parts, state, host, oldest)
        tp = rollouts.prompt_mask.sum(axis=1)[::G]
        state = state.count(
            trainer_flops=step_flops(parts.spec, parts.cfg, tp, rollouts.lengths)["trainer_flops"]
        )
    else:
        state, info = state.replace(nonfinite_streak=0), {}
        metrics = {"train/skipped_all_zero_variance": 1.0, "train/rows_trained": 0.0}
    state = state.count(rollouts=P * G, prompts=P)
    staleness = float(steps_behind(state.version - 1, oldest, ga)) if keep_p.any() else 0.0
    metrics.update(_batch_metrics(parts, state, prompts.curriculum, rollouts, scores, staleness))
    metrics["time/train_s"] = time.perf_counter() - t0
    metrics.update({f"adv/{k}": float(np.asarray(v)) for k, v in info.items() if np.ndim(v) == 0})
    return state, metrics


def _batch_metrics(
    parts, state, curriculum, rollouts: Rollouts, scores: Scores, staleness: float
) -> dict:
    return {
        "train/reward": float(scores.shaped.mean()),
        "train/pass@1": float((scores.raw > 0).mean()),
        # Zero-variance groups (dropped from the loss with data.zero_variance_filter).
        "train/zero_variance_frac": float(scores.zero_var.mean()),
        "train/response_len": float(rollouts.lengths.mean()),
        "train/truncation_rate": float(rollouts.truncated.mean()),
        "train/interrupted_frac": float((rollouts.injected_mask.any(axis=1)).mean()),
        "train/staleness_max": staleness,
        "train/lr": float(parts.lr_at(max(state.version - 1, 0) // parts.cfg.train.grad_accum)),
        "train/retired_prompts": float(getattr(curriculum, "num_retired", 0)),
    }


# ---- evaluate -----------------------------------------------------------------------------


def evaluate(parts: Parts, state: TrainerState, params) -> tuple[TrainerState, dict[str, float]]:
    """pass@k on the validation prompts with `params` (the sampler's copy of the policy)."""
    t0 = time.perf_counter()
    k = parts.cfg.eval.k
    m, rollouts = evaluate_policy(
        parts.eval_sampler,
        params,
        parts.val_problems,
        tokenizer=parts.tokenizer,
        correct_fn=parts.correct_fn,
        k=k,
        key=eval_key(parts.cfg.train.seed),
        version=state.version,
    )
    state = state.count(
        eval_flops=forward_flops(
            parts.spec, rollouts.prompt_mask.sum(axis=1)[::k], rollouts.lengths, k
        ),
        eval_device_seconds=(time.perf_counter() - t0) * jax.device_count(),
    )
    m["time/eval_s"] = time.perf_counter() - t0
    return state, m


# ---- batches of rows ----------------------------------------------------------------------


def rows_of(rollouts: Rollouts, lo: int, hi: int, group_offset: int) -> Rollouts:
    """Rows [lo, hi) of a Rollouts, group ids renumbered from 0."""
    if lo == 0 and hi == rollouts.num_rows:
        return rollouts
    fields = {}
    for f in dataclasses.fields(rollouts):
        v = getattr(rollouts, f.name)
        fields[f.name] = v[lo:hi] if isinstance(v, np.ndarray) and v.ndim >= 1 else v
    fields["group_ids"] = fields["group_ids"] - group_offset
    return dataclasses.replace(rollouts, **fields)
