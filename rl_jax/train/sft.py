"""Supervised warm-up: teach a fresh policy the answer format before RL.

RL needs a policy whose samples are sometimes right (a group with no correct
sample has no learning signal), so the CPU demo first fits the tiny model on
(prompt, answer) pairs for a few seconds and stops early, at a modest greedy
pass rate, leaving the rest of the learning to RL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_jax.models import ModelSpec, Transformer, positions_from_valid, token_logprobs


def target_text(p) -> str:
    """What a warm-up teaches a problem's completion to be: its reference completion when
    the answer is not one (a code problem's answer is its tests), else the answer."""
    return p.meta.get("reference", p.answer)


def sft_length(tokenizer, problems: Sequence, *, at_least: int = 16, bucket: int = 16) -> int:
    """Tokens of the longest `prompt target <eos>` row, in whole buckets."""
    longest = max(
        len(tokenizer.encode(p.prompt)) + len(tokenizer.encode(target_text(p))) + 1
        for p in problems
    )
    return max(at_least, -(-longest // bucket) * bucket)


def sft_arrays(tokenizer, problems: Sequence, length: int) -> dict[str, np.ndarray]:
    """Left-aligned rows `prompt target <eos>` padded to `length`; loss on target + eos."""
    B = len(problems)
    tokens = np.full((B, length), tokenizer.pad_id, np.int32)
    valid = np.zeros((B, length), bool)
    target_mask = np.zeros((B, length), np.float32)  # on the column that predicts the token
    for i, p in enumerate(problems):
        pr = tokenizer.encode(p.prompt)
        ans = tokenizer.encode(target_text(p)) + [tokenizer.eos_id]
        row = (pr + ans)[:length]
        tokens[i, : len(row)] = row
        valid[i, : len(row)] = True
        lo, hi = len(pr) - 1, min(len(row), length) - 1
        target_mask[i, lo:hi] = 1.0
    return {"tokens": tokens, "valid": valid, "mask": target_mask}


def make_sft_step(spec: ModelSpec, tx: optax.GradientTransformation):
    def loss_fn(params, tokens, valid, mask):
        model = Transformer(spec, params)
        logp, _ = token_logprobs(model, tokens, positions_from_valid(valid), kv_valid_bt=valid)
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @jax.jit
    def step(params, opt_state, tokens, valid, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, valid, mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def supervised_warmup(
    spec: ModelSpec,
    params: dict,
    tokenizer,
    problems: Sequence,
    *,
    evaluate: Callable[[dict], float],
    target: float = 0.3,
    batch_size: int = 128,
    lr: float = 1e-3,
    warmup: int = 50,
    max_steps: int = 2000,
    eval_every: int = 25,
    seed: int = 0,
    length: int | None = None,
    on_eval: Callable[[int, float, float], None] | None = None,
) -> tuple[dict, dict]:
    """Train until `evaluate(params)` (a greedy pass rate) reaches `target`, or max_steps.

    length: tokens a row is padded to (None: the longest row's, `sft_length`).
    Returns (params, info) with the steps taken and the last measured pass rate.
    """
    if length is None:
        length = sft_length(tokenizer, problems)
    sched = optax.join_schedules(
        [optax.linear_schedule(lr / warmup, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = tx.init(params)
    step_fn = make_sft_step(spec, tx)
    rng = np.random.default_rng(seed)
    rate, loss = evaluate(params), float("nan")
    steps = 0
    while rate < target and steps < max_steps:
        idx = rng.integers(0, len(problems), size=batch_size)
        arr = sft_arrays(tokenizer, [problems[i] for i in idx], length)
        params, opt_state, loss_a = step_fn(
            params, opt_state, arr["tokens"], arr["valid"], arr["mask"]
        )
        steps += 1
        if steps % eval_every == 0:
            loss = float(loss_a)
            rate = evaluate(params)
            if on_eval is not None:
                on_eval(steps, loss, rate)
    return params, {"sft_steps": steps, "sft_greedy_pass": rate, "sft_loss": loss}
