"""Pass rates, No-Positive-Resampling, interference histogram, and exact resume of
pipeline + curriculum together. (Zero-variance filtering and dynamic sampling: the
trainer's, tests/test_train_filters.py.)"""

import dataclasses
import json

import numpy as np
import pytest

from rl_jax.config import DataConfig
from rl_jax.data import (
    Curriculum,
    DataExhausted,
    PromptPipeline,
    build_task,
    pass_rates,
)

CFG = DataConfig(train_size=40, val_size=4, prompts_per_batch=4)


def _pipe(problems, cur, seed=0):
    return PromptPipeline(
        problems, batch_size=4, seed=seed, process_index=0, process_count=1, curriculum=cur
    )


def test_pass_rates():
    r = np.array([[1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, -1, -1], [0, 0, 0, 1]], np.float32)
    np.testing.assert_allclose(pass_rates(r), [1.0, 0.0, 0.25, 0.25])
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        pass_rates(np.ones(4))


def test_no_positive_resampling_retires_at_the_next_epoch():
    train = build_task(CFG).train
    cur = Curriculum(CFG)
    pipe = _pipe(train, cur)
    first = next(pipe)
    # first problem solved 15/16 (>= 0.9): retired; second 14/16 (< 0.9): kept
    r = -np.ones((4, 16))
    r[0, :15] = 1
    r[1, :14] = 1
    cur.update([p.id for p in first], r)
    assert cur.is_retired(first[0].id) and not cur.is_retired(first[1].id)
    rest = [p.id for _ in range(pipe.batches_per_epoch - 1) for p in next(pipe)]
    assert len(rest) == 36  # the current epoch is not changed
    nxt = [p.id for _ in range(27) for p in next(pipe)]  # 3 epochs of 39 active // 4 = 9
    assert pipe.batches_per_epoch == 9 and first[0].id not in nxt and first[1].id in nxt
    # retirement is permanent: a later low pass rate does not bring it back
    cur.update([first[0].id], -np.ones((1, 16)))
    assert cur.is_retired(first[0].id)
    # NPR disabled: never retired
    off = Curriculum(dataclasses.replace(CFG, no_positive_resampling=False))
    off.update([first[0].id], np.ones((1, 16)))
    assert not off.retired_ids()


def test_all_retired_is_a_clear_error_and_few_left_still_fill_a_batch():
    train = build_task(CFG).train
    cur = Curriculum(CFG)
    pipe = _pipe(train, cur)
    cur.update([p.id for p in train[2:]], np.ones((len(train) - 2, 4)))
    for _ in range(pipe.batches_per_epoch):
        next(pipe)
    batch = next(pipe)  # 2 problems left, batch of 4: the active set repeats within the epoch
    assert sorted({p.id for p in batch}) == sorted(p.id for p in train[:2])
    cur.update([p.id for p in train[:2]], np.ones((2, 4)))
    with pytest.raises(DataExhausted, match="npr_threshold"):
        for _ in range(pipe.batches_per_epoch + 1):
            next(pipe)


def test_interference_histogram():
    cur = Curriculum(CFG)
    cur.update([1, 2, 3, 4], np.array([[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]))
    counts, edges = cur.pass_rate_histogram(bins=4)
    assert counts.tolist() == [2, 1, 0, 1] and edges.tolist() == [0, 0.25, 0.5, 0.75, 1.0]
    m = cur.interference_metrics(bins=4)
    assert m["interference/seen"] == 4 and m["interference/frac_zero"] == 0.5
    assert m["interference/frac_one"] == 0.25 and m["interference/retired"] == 1
    json.dumps(m)  # goes to the metrics log as is
    cur.update([2], np.array([[1, 1, 0, 0]]))  # the latest pass rate replaces the old one
    assert cur.pass_rate_histogram(bins=4)[0].tolist() == [1, 1, 1, 1]
    assert cur.pass_rate(2) == 0.5 and cur.pass_rate(99) is None


def _fake_rewards(ids, step, g=8):
    """Deterministic rewards: a problem's pass rate climbs with the step (some retire)."""
    rng = np.random.default_rng([step, *[i % 2**31 for i in ids]])
    p = np.array([min(1.0, (i % 7) / 8 + step / 200) for i in ids])
    return np.where(rng.random((len(ids), g)) < p[:, None], 1.0, -1.0)


def _run(pipe, cur, steps, start=0):
    out = []
    for step in range(start, start + steps):
        batch = next(pipe)
        ids = [p.id for p in batch]
        r = _fake_rewards(ids, step)
        cur.update(ids, r)
        out.append((ids, pass_rates(r).tolist()))
    return out


@pytest.mark.parametrize("stop", [4, 10, 23])
def test_resume_of_pipeline_and_curriculum_is_exact(stop):
    train = build_task(CFG).train
    cur = Curriculum(CFG)
    ref = _run(_pipe(train, cur), cur, 40)
    assert cur.retired_ids()  # the run does retire problems, so resume has something to carry
    ref_state = cur.state_dict()

    cur1 = Curriculum(CFG)
    pipe1 = _pipe(train, cur1)
    head = _run(pipe1, cur1, stop)
    blob = json.dumps({"pipe": pipe1.get_state(), "cur": cur1.state_dict()})

    saved = json.loads(blob)
    cur2 = Curriculum(CFG)
    cur2.load_state_dict(saved["cur"])
    pipe2 = _pipe(train, cur2)
    pipe2.set_state(saved["pipe"])
    tail = _run(pipe2, cur2, 40 - stop, start=stop)
    assert head + tail == ref
    assert cur2.state_dict() == ref_state
