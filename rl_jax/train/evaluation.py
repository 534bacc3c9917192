"""Validation metrics from per-sample rewards: mean@k, best@k, worst@k (IsoCompute)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import jax
import numpy as np

from rl_jax.data._mixture import task_of
from rl_jax.rewards import from_config as reward_from_config
from rl_jax.rewards import get as get_reward
from rl_jax.rewards import score_batch
from rl_jax.rewards._registry import config_options

# Folded into the run's seed for validation sampling: the same key at every
# evaluation (and in `rl-jax eval`), so checkpoints are compared on the same draws.
EVAL_KEY_SALT = 0xE7A1


def eval_key(seed: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), EVAL_KEY_SALT)


def eval_prompts_per_batch(num_prompts: int, k: int, batch_rows: int) -> int:
    """Prompts sampled at a time in an evaluation of `num_prompts` prompts x k samples:
    whole prompts, at most `batch_rows` rows (eval.batch_rows; at least one prompt;
    0: all at once)."""
    if batch_rows <= 0:
        return num_prompts
    return max(1, min(num_prompts, batch_rows // k))


def make_eval_sampler(spec, cfg, tokenizer, *, mesh, prompt_len: int = 0, problems=None):
    """The validation engine of run config `cfg`: its sampling settings with eval.k
    samples per prompt at eval.temperature, decoded in one piece, with a slot for every
    row of a batch (eval.batch_rows, whole prompts, else eval.num_prompts x eval.k; or
    sampling.engine_slots), its prompts up to `prompt_len` tokens (0:
    sampling.max_prompt_len). `problems`: how many validation problems there are, when
    fewer than eval.num_prompts (an evaluation samples no more)."""
    ev = cfg.eval
    n = ev.num_prompts if problems is None else max(1, min(problems, ev.num_prompts))
    sampling = dataclasses.replace(cfg.sampling, n=ev.k, temperature=ev.temperature, decode_chunk=0)
    rows = eval_prompts_per_batch(n, ev.k, ev.batch_rows) * ev.k
    return make_engine(spec, sampling, cfg, tokenizer, mesh=mesh, rows=rows, prompt_len=prompt_len)


def make_engine(spec, sampling, cfg, tokenizer, *, mesh, rows: int, prompt_len: int = 0, **shape):
    """The engine of `sampling` for batches of up to `rows` rows (slots:
    sampling.engine_slots, else `rows`; one chunk decodes to the end unless
    sampling.decode_chunk; `fixed_shapes`, so a run compiles one prefill_insert and one
    generate program); `shape` overrides `engine_shape`'s."""
    from rl_jax.sampling import Engine
    from rl_jax.sharding import num_batch_shards

    shards = 1 if mesh is None else num_batch_shards(mesh)
    return Engine(
        spec,
        sampling,
        prompt_len=prompt_len or sampling.max_prompt_len,
        fixed_shapes=True,
        **{**engine_shape(sampling, rows=rows, shards=shards), **shape},
        mesh=mesh,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        interrupt_ids=tokenizer.encode(cfg.sampling.interrupt_text),
        rules=cfg.mesh.rules,
    )


# Prompts a run's engine prefills together: a refill computes only the blocks its new
# prompts fill (PipelineRL's stream admits a few groups at a time into a prefill of
# W x B_p prompts), and a prompt's KV does not depend on the slot count.
PREFILL_BLOCK = 16


def engine_shape(sampling, *, rows: int, shards: int) -> dict[str, int]:
    """A run's engine for batches of `rows` rows (the trainer's, evaluation's; and the
    plan's of them): its slots (sampling.engine_slots, else `rows`, in whole batch
    shards), decode steps per generate call (sampling.decode_chunk, else to the end),
    prompts per prefill (a refill's new prompts in one call) and per prefill block
    (`PREFILL_BLOCK`) and rows per insert (every slot: a batch enters in one call, as
    the plan counts it), as `Engine` takes them."""
    slots = -(-(sampling.engine_slots or rows) // shards) * shards
    return {
        "slots": slots,
        "chunk": sampling.decode_chunk or sampling.max_new_tokens,
        "prefill_prompts": -(-slots // sampling.n),
        "prefill_block": PREFILL_BLOCK,
        "insert_rows": slots,
    }


def correctness_fn(rewards_cfg, task, reward_fn=None):
    """The 0/1 verifier of the run's reward (`reward_fn`, built from the config if not
    given): what pass@k counts as correct."""
    if reward_fn is None:
        reward_fn = reward_from_config(rewards_cfg, task_reward=task.reward_name)
    name = getattr(reward_fn, "name", task.reward_name)
    # The verifier's own options, but never partial credit: pass@k counts whole passes.
    opts = {k: v for k, v in config_options(rewards_cfg, name).items() if k != "partial"}
    return get_reward(
        name, scale="01", timeout_s=rewards_cfg.timeout_s, workers=rewards_cfg.workers, **opts
    )


def pass_metrics(
    correct_pk: np.ndarray,
    *,
    lengths_pk: np.ndarray | None = None,
    truncated_pk: np.ndarray | None = None,
    difficulty_p: list | None = None,
    task_p: list[str] | None = None,
    prefix: str = "val/",
) -> dict[str, float]:
    """correct_pk: [P, k] 0/1 per sample. mean@k is pass@1 averaged over k samples.

    best@k (coverage) = fraction of prompts with at least one correct sample;
    worst@k (sharpening) = fraction with all k correct. `task_p` (a task mixture's task
    of each prompt) adds every metric per task as `<prefix><task>/<metric>`
    (val/code/pass@1); the unprefixed ones stay the whole mixture's.
    """
    c = np.asarray(correct_pk, dtype=np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct_pk must be a non-empty [P, k] array, got shape {c.shape}")
    out = {
        f"{prefix}pass@1": float(c.mean()),
        f"{prefix}best@k": float((c.max(axis=1) > 0).mean()),
        f"{prefix}worst@k": float((c.min(axis=1) > 0).mean()),
        f"{prefix}k": float(c.shape[1]),
    }
    if lengths_pk is not None:
        out[f"{prefix}response_len"] = float(np.mean(lengths_pk))
    if truncated_pk is not None:
        out[f"{prefix}truncation_rate"] = float(np.mean(truncated_pk))
    if difficulty_p is not None:
        groups: dict = defaultdict(list)
        for i, d in enumerate(difficulty_p):
            groups[d].append(i)
        for d, idx in sorted(groups.items(), key=lambda kv: str(kv[0])):
            out[f"{prefix}pass@1/{d}"] = float(c[idx].mean())
    if task_p is not None:
        # A task mixture's tasks, each as a run of its own would report it.
        tasks: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(task_p):
            tasks[t].append(i)
        for t, idx in sorted(tasks.items()):
            out.update(
                pass_metrics(
                    c[idx],
                    lengths_pk=None if lengths_pk is None else np.asarray(lengths_pk)[idx],
                    truncated_pk=None if truncated_pk is None else np.asarray(truncated_pk)[idx],
                    prefix=f"{prefix}{t}/",
                )
            )
    return out


def evaluate_policy(
    engine,
    params,
    problems: Sequence,
    *,
    tokenizer,
    correct_fn,
    k: int,
    key: jax.Array,
    version: int = 0,
) -> tuple[dict[str, float], object]:
    """Sample k completions per validation problem on `engine` (`make_eval_sampler`: a
    slot for every row of eval.batch_rows rows; its slots bound its memory, not the
    results), score them with the 0/1 verifier `correct_fn`, and return
    (`pass_metrics`, the rollouts)."""
    prompt_ids = [tokenizer.encode(p.prompt) for p in problems]
    rollouts, _ = engine.run(params, prompt_ids, n=k, key=key, version=version)
    texts = [tokenizer.decode(rollouts.completion(b)) for b in range(rollouts.num_rows)]
    answers = [problems[g].answer for g in rollouts.group_ids]
    correct = score_batch(correct_fn, texts, answers).reshape(len(problems), -1)
    tasks = [task_of(p) for p in problems]
    metrics = pass_metrics(
        correct > 0.5,
        lengths_pk=rollouts.lengths.reshape(len(problems), k),
        truncated_pk=rollouts.truncated.reshape(len(problems), k),
        difficulty_p=[p.meta.get("difficulty", "all") for p in problems],
        task_p=tasks if any(tasks) else None,
    )
    return metrics, rollouts
