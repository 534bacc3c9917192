"""Row bookkeeping of the sampler without a model: stops, limits, forced interruption."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config import ConfigError, SamplingConfig
from rl_jax.sampling import FinishReason, pack_prompts
from rl_jax.sampling._dist import row_keys
from rl_jax.sampling._state import SamplerState, advance

PAD, STOP, VERSION = 0, 1, 7
BIG = np.iinfo(np.int32).max


def _state(B, Tg, *, limit, interrupt_at=None):
    z = jnp.zeros((B,), jnp.int32)
    at = jnp.full((B,), BIG, jnp.int32) if interrupt_at is None else jnp.asarray(interrupt_at)
    return SamplerState(
        cache=(),
        prompt_tokens=jnp.zeros((B, 1), jnp.int32),
        kv_start=z,
        tokens=jnp.full((B, Tg), PAD, jnp.int32),
        logprobs=jnp.zeros((B, Tg), jnp.float32),
        versions=jnp.full((B, Tg), -1, jnp.int32),
        injected=jnp.zeros((B, Tg), bool),
        last_token=z,
        step=jnp.int32(0),
        limit=jnp.int32(limit),
        done=jnp.zeros((B,), bool),
        finish=z,
        truncated=jnp.zeros((B,), bool),
        lengths=z,
        phase=z,
        phase_pos=z,
        interrupt_at=at.astype(jnp.int32),
        keys=row_keys(jax.random.key(0), jnp.arange(B)),
        group_ids=z,
        row_ids=jnp.arange(B, dtype=jnp.int32),
        real=jnp.ones((B,), bool),
    )


def _run(state, script_bt, **kw):
    """Feed scripted 'sampled' tokens column by column; log-prob of a draw = -(token)."""
    step = jax.jit(functools.partial(advance, version=jnp.int32(VERSION), pad_id=PAD, **kw))
    script = np.asarray(script_bt, np.int32)
    for t in range(script.shape[1]):
        tok = jnp.asarray(script[:, t])
        state = step(state, tok, -tok.astype(jnp.float32))
    return jax.device_get(state)


def test_stop_token_and_length_limit():
    script = [
        [5, STOP, 6, 6, 6, 6],  # stops at the 2nd token (kept, mask 1)
        [5, 6, 7, 8, 9, 9],  # runs into the limit of 4
        [STOP, 5, 5, 5, 5, 5],  # stops at once
    ]
    s = _run(
        _state(3, 6, limit=4),
        script,
        stop_ids=(STOP,),
        interrupt_ids=(),
        answer_budget=0,
        interrupt=False,
    )
    np.testing.assert_array_equal(s.lengths, [2, 4, 1])
    np.testing.assert_array_equal(
        s.tokens, [[5, STOP, PAD, PAD, PAD, PAD], [5, 6, 7, 8, PAD, PAD], [STOP] + [PAD] * 5]
    )
    np.testing.assert_array_equal(
        s.finish, [FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP]
    )
    np.testing.assert_array_equal(s.truncated, [False, True, False])
    assert s.done.all()
    np.testing.assert_array_equal(s.versions[0], [VERSION, VERSION, -1, -1, -1, -1])
    np.testing.assert_array_equal(s.logprobs[1], [-5, -6, -7, -8, 0, 0])
    assert not s.injected.any()


INTERRUPT = dict(stop_ids=(STOP,), interrupt_ids=(40, 41), answer_budget=2, interrupt=True)


def test_forced_interruption_placement_and_masks():
    script = [
        [10, 11, 12, 13, 14, 15, 16, 17, 18],  # interrupted after 3, answer budget runs out
        [10, STOP, 12, 13, 14, 15, 16, 17, 18],  # stops before its interruption point
        [10, 11, 12, 13, STOP, 15, 16, 17, 18],  # interrupted after 2, answers and stops
        [10, STOP, 12, 13, 14, 15, 16, 17, 18],  # a stop token at the interruption point wins
    ]
    s = _run(_state(4, 9, limit=9, interrupt_at=[3, 3, 2, 2]), script, **INTERRUPT)
    np.testing.assert_array_equal(
        s.tokens[0], [10, 11, 12, 40, 41, 15, 16, PAD, PAD]
    )  # injected text replaces the draws of steps 3, 4; then 2 answer tokens
    np.testing.assert_array_equal(s.tokens[2], [10, 11, 40, 41, STOP, PAD, PAD, PAD, PAD])
    np.testing.assert_array_equal(s.lengths, [7, 2, 5, 2])
    F = FinishReason
    np.testing.assert_array_equal(s.finish, [F.INTERRUPTED, F.STOP, F.INTERRUPTED, F.STOP])
    np.testing.assert_array_equal(s.truncated, [True, False, False, False])
    want_inj = np.zeros((4, 9), bool)
    want_inj[0, 3:5] = want_inj[2, 2:4] = True
    np.testing.assert_array_equal(s.injected, want_inj)
    assert (s.logprobs[want_inj] == 0).all() and (s.versions[want_inj] == -1).all()
    want_versions = [VERSION] * 3 + [-1, -1] + [VERSION] * 2 + [-1] * 2
    np.testing.assert_array_equal(s.versions[0], want_versions)


def test_limit_during_injection_truncates():
    s = _run(_state(1, 6, limit=4, interrupt_at=[3]), [[10, 11, 12, 13, 14, 15]], **INTERRUPT)
    np.testing.assert_array_equal(s.tokens[0], [10, 11, 12, 40, PAD, PAD])
    assert s.finish[0] == FinishReason.INTERRUPTED and s.truncated[0] and s.lengths[0] == 4


def test_pack_prompts_left_pads_to_bucket():
    tok, lens = pack_prompts([[3, 4, 5], [6]], rows=3, bucket=4, max_len=8, pad_id=PAD)
    np.testing.assert_array_equal(tok, [[0, 3, 4, 5], [0, 0, 0, 6], [0, 0, 0, 0]])
    np.testing.assert_array_equal(lens, [3, 1, 1])
    assert pack_prompts([[1] * 5], rows=1, bucket=4, max_len=8, pad_id=PAD)[0].shape == (1, 8)
    with pytest.raises(ConfigError, match="max_prompt_len"):
        pack_prompts([[1] * 9], rows=1, bucket=4, max_len=8, pad_id=PAD)
    with pytest.raises(ValueError, match="empty"):
        pack_prompts([[]], rows=1, bucket=4, max_len=8, pad_id=PAD)


def test_config_validation():
    with pytest.raises(ConfigError, match="interrupt_lo"):
        SamplingConfig(length_control="interrupt")
    with pytest.raises(ConfigError, match="answer_budget"):  # 0 is auto (a seventh)
        SamplingConfig(length_control="interrupt", interrupt_lo=2, interrupt_hi=3, answer_budget=-1)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingConfig(stop_token_ids=[-1])
