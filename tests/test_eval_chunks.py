"""Evaluation in batches of rows (eval.batch_rows): the same rollouts as all rows at
once, and no change of the run's id."""

import dataclasses

import jax
import numpy as np
import pytest
from test_sampler import SPEC, _params

from rl_jax.config import EvalConfig, RunConfig, SamplingConfig, run_id
from rl_jax.knobs import ConfigError
from rl_jax.sampling import Sampler
from rl_jax.train.evaluation import eval_prompts_per_batch, generate_in_batches, generate_rows

# Four prompts over two length buckets (8 and 16 tokens): the first two alone would be
# packed to 8 tokens, all of them together to 16.
PROMPTS = [[3, 9, 4], [12, 13], [7, 1, 8, 2, 6, 5, 11, 2, 9, 10], [5, 6, 7, 8, 9]]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=6, length_bucket=8, max_prompt_len=16)


def test_prompts_per_batch():
    assert eval_prompts_per_batch(64, 2, 0) == 64  # 0: all at once
    assert eval_prompts_per_batch(64, 2, 32) == 16
    assert eval_prompts_per_batch(64, 2, 33) == 16  # whole prompts
    assert eval_prompts_per_batch(64, 4, 2) == 1  # at least one prompt
    assert eval_prompts_per_batch(8, 2, 1000) == 8


def test_batches_sample_the_rows_of_one_batch():
    """Batches of 2 prompts give every row the tokens, lengths, ids and prompt padding
    of the one batch, and its log-probs to float32 rounding (matmuls over fewer rows
    may sum in another order: 1e-6 seen)."""
    params = _params(0, 3.0)
    sampler = Sampler(SPEC, CFG, pad_id=1)  # not the 0 that concatenation pads with
    key = jax.random.key(7)
    ref = generate_rows(sampler, params, PROMPTS, n=2, key=key, version=1)
    out = generate_in_batches(sampler, params, PROMPTS, n=2, key=key, version=1, prompts=2)
    for f in dataclasses.fields(ref):
        a, b = getattr(out, f.name), getattr(ref, f.name)
        if f.name == "logprobs":
            np.testing.assert_allclose(a, b, atol=1e-5)
        else:
            np.testing.assert_array_equal(a, b, err_msg=f.name)
    assert len({tuple(r) for r in ref.completion_tokens}) > len(PROMPTS)  # samples differ


def test_batch_rows_is_memory_only():
    cfg = RunConfig()
    chunked = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_rows=32))
    assert run_id(chunked) == run_id(cfg)
    with pytest.raises(ConfigError, match="eval.batch_rows"):
        EvalConfig(batch_rows=-1)
