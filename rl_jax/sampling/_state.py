"""The sampler's loop state (a pytree) and the per-token row update, model-free.

A row moves through three phases:
  THINK   sample freely; a stop token ends it (STOP); reaching its
          interruption length switches to INJECT (interrupt mode only).
  INJECT  emit the interruption text one token per step (no sampling, flagged
          `injected`, never trained on), then switch to ANSWER.
  ANSWER  sample up to `answer_budget` tokens; a stop token or the budget ends
          it (INTERRUPTED; `truncated` when the budget ran out).
Any row reaching `limit` completion tokens (injected ones included) ends there
(LENGTH, or INTERRUPTED if it had been interrupted) with `truncated` set.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl_jax.sampling._rollouts import FinishReason

THINK, INJECT, ANSWER = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Everything a decode chunk reads and writes; donated to each chunk.

    Cache slot layout: prompts are left-padded into slots [0, Tp); completion
    token t is fed to the model at slot Tp + t (the last prompt token is fed at
    slot Tp - 1 by the first decode step, which samples completion token 0).
    A row attends to slots >= kv_start (its first real prompt token): slot s of a
    row is its position s - kv_start in its pages (`pages`).
    """

    cache: object  # the paged KV cache (`rl_jax.kernels.xla.PagedKV`)
    prompt_tokens: jax.Array  # [B, Tp] int32, left-padded
    kv_start: jax.Array  # [B] int32 = Tp - prompt length
    tokens: jax.Array  # [B, Tg] int32 completion, pad_id after the end
    logprobs: jax.Array  # [B, Tg] float32, 0 where not sampled
    versions: jax.Array  # [B, Tg] int32, -1 where not sampled
    injected: jax.Array  # [B, Tg] bool
    last_token: jax.Array  # [B] int32, the token the next step feeds
    step: jax.Array  # [] int32 completion columns written so far; [B] each row's own (engine)
    limit: jax.Array  # [] or [B] int32, max new tokens of the batch or of each row (<= Tg)
    done: jax.Array  # [B] bool (padding rows start done)
    finish: jax.Array  # [B] int32 FinishReason
    truncated: jax.Array  # [B] bool
    lengths: jax.Array  # [B] int32 completion tokens so far
    phase: jax.Array  # [B] int32 THINK / INJECT / ANSWER
    phase_pos: jax.Array  # [B] int32 tokens emitted in the current phase
    interrupt_at: jax.Array  # [B] int32 THINK length that triggers the interruption
    keys: jax.Array  # [B] typed PRNG keys fold_in(seed, row_id)
    group_ids: jax.Array  # [B] int32 prompt index
    row_ids: jax.Array  # [B] int32
    real: jax.Array  # [B] bool, False for rows padding B to the device count
    # [B, R] int32 the engine's page tables (`rl_jax.kernels.xla.Pages`); None: no cache
    # (tests of the row update alone).
    pages: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


def advance(
    state: SamplerState,
    sampled_b: jax.Array,
    logprobs_b: jax.Array,
    *,
    version: jax.Array,
    stop_ids: tuple[int, ...],
    interrupt_ids: tuple[int, ...],
    answer_budget: int,
    interrupt: bool,
    pad_id: int,
) -> SamplerState:
    """Write completion column `state.step` from this step's draws and move every row on.

    sampled_b, logprobs_b: [B] the policy's draw per row (ignored for rows that
    are injecting). Rows already done write padding and do not change. With a
    step per row ([B]), each active row writes its own column and moves its own
    step on; a done row's step stays where it ended.
    """
    t = state.step
    per_row = t.ndim == 1
    active = ~state.done
    injecting = active & (state.phase == INJECT)
    token = _token(state, sampled_b, active, injecting, interrupt_ids, pad_id)
    sampled = active & ~injecting

    def put(buf, value):
        if per_row:  # a row at the end of its buffer (done) writes nothing
            rows = jnp.arange(buf.shape[0])
            return buf.at[rows, t].set(value.astype(buf.dtype), mode="drop")
        return jax.lax.dynamic_update_slice_in_dim(buf, value[:, None].astype(buf.dtype), t, 1)

    tokens = put(state.tokens, token)
    logprobs = put(state.logprobs, jnp.where(sampled, logprobs_b, 0.0))
    versions = put(state.versions, jnp.where(sampled, version, -1))
    injected = put(state.injected, injecting)
    lengths = state.lengths + active.astype(jnp.int32)

    is_stop = sampled & jnp.isin(token, jnp.asarray(stop_ids, jnp.int32))
    now_done, reason, cut, new_phase, new_pos = _transitions(
        state, active, injecting, is_stop, lengths, answer_budget, interrupt, len(interrupt_ids)
    )
    return dataclasses.replace(
        state,
        tokens=tokens,
        logprobs=logprobs,
        versions=versions,
        injected=injected,
        last_token=jnp.where(active, token, state.last_token),
        step=t + active.astype(jnp.int32) if per_row else t + 1,
        done=state.done | now_done,
        finish=jnp.where(now_done, reason, state.finish).astype(jnp.int32),
        truncated=state.truncated | cut,
        lengths=lengths,
        phase=new_phase.astype(jnp.int32),
        phase_pos=new_pos.astype(jnp.int32),
    )


def _token(state, sampled_b, active, injecting, interrupt_ids, pad_id):
    """Each row's token this step: the draw, the injected text's next token, or padding."""
    token = sampled_b
    if interrupt_ids:
        ids = jnp.asarray(interrupt_ids, jnp.int32)
        forced = ids[jnp.clip(state.phase_pos, 0, len(interrupt_ids) - 1)]
        token = jnp.where(injecting, forced, sampled_b)
    return jnp.where(active, token, pad_id).astype(jnp.int32)


def _transitions(state, active, injecting, is_stop, lengths, answer_budget, interrupt, n_inject):
    """A step's phase changes (think -> inject -> answer) and endings: (rows that end,
    their FinishReason, rows cut short, the new phase, the new position in it)."""
    phase, pos = state.phase, state.phase_pos + active.astype(jnp.int32)
    think, answer = active & (phase == THINK), active & (phase == ANSWER)
    stop_think = think & is_stop
    stop_answer = answer & is_stop
    budget_out = answer & ~is_stop & (pos >= answer_budget)
    if interrupt:
        start_inject = think & ~is_stop & (lengths >= state.interrupt_at)
        end_inject = injecting & (pos >= n_inject)
    else:
        start_inject = end_inject = jnp.zeros_like(active)
    ended = stop_think | stop_answer | budget_out
    out_of_room = active & ~ended & (lengths >= state.limit)
    new_phase = jnp.where(start_inject, INJECT, jnp.where(end_inject, ANSWER, phase))
    new_pos = jnp.where(start_inject | end_inject, 0, pos)
    reason = jnp.select(
        [stop_think, stop_answer | budget_out, out_of_room & (phase == THINK)],
        [int(FinishReason.STOP), int(FinishReason.INTERRUPTED), int(FinishReason.LENGTH)],
        int(FinishReason.INTERRUPTED),
    )
    return ended | out_of_room, reason, budget_out | out_of_room, new_phase, new_pos
