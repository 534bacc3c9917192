"""Evaluation in batches of rows (eval.batch_rows: the engine's slots): the same
rollouts as all rows at once, and no change of the run's id."""

import dataclasses

import jax
import numpy as np
import pytest
from test_sampler import SPEC, _params

from rl_jax.config import EvalConfig, RunConfig, SamplingConfig, run_id
from rl_jax.knobs import ConfigError
from rl_jax.sampling import Engine
from rl_jax.train.evaluation import eval_prompts_per_batch

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
    """Slots for 2 prompts' rows give every row the numbers of slots for all of them,
    bit for bit (a row's numbers depend on its key, prompt and weights only)."""
    params = _params(0, 3.0)
    key = jax.random.key(7)

    def rows(slots):
        engine = Engine(SPEC, CFG, slots=slots, chunk=6, pad_id=1, fixed_shapes=True)
        return engine.run(params, PROMPTS, n=2, key=key, version=1)[0]

    ref, out = rows(8), rows(4)
    for f in dataclasses.fields(ref):
        np.testing.assert_array_equal(getattr(out, f.name), getattr(ref, f.name), err_msg=f.name)
    assert len({tuple(r) for r in ref.completion_tokens}) > len(PROMPTS)  # samples differ


def test_batch_rows_is_memory_only():
    cfg = RunConfig()
    chunked = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_rows=32))
    assert run_id(chunked) == run_id(cfg)
    with pytest.raises(ConfigError, match="eval.batch_rows"):
        EvalConfig(batch_rows=-1)


def test_eval_engine_has_slots_for_the_problems_there_are(monkeypatch):
    """eval.num_prompts above the validation problems (a small file, `rl-jax eval RUN
    eval.num_prompts=100000`): the engine got slots for eval.num_prompts x eval.k rows and
    ran out of device memory before sampling the 8 problems there are."""
    import rl_jax.train.evaluation as ev

    got = []
    monkeypatch.setattr(ev, "make_engine", lambda *a, rows, **k: got.append(rows))
    cfg = RunConfig(eval=EvalConfig(num_prompts=100000, k=2))
    ev.make_eval_sampler(SPEC, cfg, None, mesh=None, problems=8)
    ev.make_eval_sampler(SPEC, cfg, None, mesh=None)
    assert got == [16, 200000]
