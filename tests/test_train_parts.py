"""Optimizer schedule, compute counters, eval metrics and checkpoint fallback."""

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config import TrainConfig
from rl_jax.train.accounting import ComputeCounters
from rl_jax.train.checkpoint import Checkpointer
from rl_jax.train.evaluation import pass_metrics
from rl_jax.train.optim import lr_schedule, make_optimizer, peak_lr


def test_lr_sqrt_batch_scaling_and_warmup():
    cfg = TrainConfig(lr=1e-6, lr_sqrt_batch_ref=1024, warmup_steps=10)
    # IsoCompute: lr ~ sqrt(B_p * n), 1e-6 at B = 1024
    assert peak_lr(cfg, prompts_per_batch=64, samples_per_prompt=64) == pytest.approx(2e-6)
    sched = lr_schedule(cfg, 1.0, 100)
    assert float(sched(0)) == pytest.approx(0.1)
    assert float(sched(9)) == pytest.approx(1.0)
    assert float(sched(50)) == pytest.approx(1.0)
    cos = lr_schedule(TrainConfig(schedule="cosine", steps=10), 2.0, 10)
    assert float(cos(0)) == pytest.approx(2.0) and float(cos(10)) == pytest.approx(0.0)


def test_the_schedule_counts_optimizer_steps_under_grad_accum():
    """With train.grad_accum, optax.MultiSteps steps the inner AdamW (and its schedule)
    once per grad_accum minibatch updates: the cosine spans the run's optimizer steps,
    3 batches x 4 minibatches / 2 = 6, and reaches its end at the run's last step."""
    knobs = dict(steps=3, updates_per_batch=4, grad_accum=2, warmup_steps=0)
    cfg = TrainConfig(lr=1.0, schedule="cosine", weight_decay=0.0, grad_clip=0.0, **knobs)
    assert cfg.optimizer_steps == 6
    tx, sched = make_optimizer(cfg, prompts_per_batch=1, samples_per_prompt=1)
    p = {"w": jnp.zeros(())}
    st = tx.init(p)
    moved = []
    for _ in range(cfg.steps * cfg.updates_per_batch):
        upd, st = tx.update({"w": jnp.ones(())}, st, p)
        moved.append(-float(upd["w"]))
    # A constant gradient: each of Adam's steps moves by the step's learning rate; the
    # accumulating minibatches between steps move nothing.
    expect = [(1 + math.cos(math.pi * s / 6)) / 2 for s in range(6)]
    np.testing.assert_allclose(moved[1::2], expect, atol=1e-5)
    np.testing.assert_allclose(moved[0::2], 0.0, atol=0)
    assert float(sched(6)) == pytest.approx(0.0, abs=1e-7)


def test_adamw_eps_and_clipping_applied():
    cfg = TrainConfig(lr=0.1, adam_eps=1e-15, weight_decay=0.0, grad_clip=1.0)
    tx, _ = make_optimizer(cfg, prompts_per_batch=1, samples_per_prompt=1)
    p = {"w": jnp.zeros(3)}
    st = tx.init(p)
    g = {"w": jnp.array([300.0, 400.0, 0.0])}  # norm 500 -> clipped to 1
    upd, _ = tx.update(g, st, p)
    # first Adam step moves each nonzero coordinate by lr * sign (eps negligible)
    np.testing.assert_allclose(upd["w"], [-0.1, -0.1, 0.0], atol=1e-6)


def test_compute_counters_roundtrip():
    c = ComputeCounters()
    c.add(rollouts=64, sampler_flops=1e9, trainer_flops=3e9)
    c.add(rollouts=64, sampler_flops=1e9, trainer_flops=3e9)
    d = c.as_dict()
    assert d["rollouts"] == 128 and d["flops"] == pytest.approx(8e9)
    assert ComputeCounters.from_dict(d).as_dict() == d
    with pytest.raises(KeyError, match="unknown compute counter"):
        c.add(gpu_hours=1)


def test_pass_metrics_hand_computed():
    c = np.array([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    m = pass_metrics(c, difficulty_p=["easy", "easy", "hard"])
    assert m["val/pass@1"] == pytest.approx(6 / 12)
    assert m["val/best@k"] == pytest.approx(2 / 3)
    assert m["val/worst@k"] == pytest.approx(1 / 3)
    assert m["val/pass@1/easy"] == pytest.approx(6 / 8)
    assert m["val/pass@1/hard"] == 0.0
    with pytest.raises(ValueError):
        pass_metrics(np.zeros((0, 4)))


def test_checkpoint_fallback_on_damaged_newest(tmp_path, capsys):
    ck = Checkpointer(tmp_path / "ck", keep=3, async_save=False)
    st = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.array(1)}
    ck.save(1, st, {"it": 1})
    ck.save(2, jax.tree.map(lambda x: x + 1, st), {"it": 2})
    ck.wait()
    step, restored, meta = ck.restore_latest(st)
    assert step == 2 and meta == {"it": 2}
    np.testing.assert_array_equal(restored["w"], st["w"] + 1)
    for f in Path(tmp_path / "ck" / "2").rglob("*"):
        if f.is_file() and "manifest" in f.name or f.is_file() and f.parent.name == "d":
            f.write_bytes(b"garbage")
    step, restored, meta = ck.restore_latest(st)
    assert step == 1 and meta == {"it": 1}
    assert "unusable" in capsys.readouterr().out
    ck.close()
    assert math.isfinite(float(restored["w"].sum()))
    assert os.path.isdir(tmp_path / "ck")


class _LinearFlops:
    """flops_per_token(c) = 10 + 2 c: 10 through the weights, 2 per attended key."""

    def flops_per_token(self, context_len):
        return 10.0 + 2.0 * context_len


def test_forward_flops_by_hand():
    from rl_jax.train.accounting import forward_flops

    # One prompt of 3 tokens (attending to 1, 2, 3 keys) shared by completions of 2 and
    # 1 tokens (attending to 4, 5 and to 4 keys).
    prompt = 3 * 10 + 2 * (1 + 2 + 3)
    rows = (2 * 10 + 2 * (4 + 5)) + (10 + 2 * 4)
    assert forward_flops(_LinearFlops(), [3], [2, 1], 2) == prompt + rows
    with pytest.raises(ValueError, match="3 completion lengths for 1 prompts x 2"):
        forward_flops(_LinearFlops(), [3], [2, 1, 1], 2)


@pytest.mark.parametrize(
    "overrides, extra",
    [
        ([], 0),
        (["train.updates_per_batch=2"], 1),
        (["loss.tis=true"], 1),
        (["loss.kl_coef=0.1"], 1),
        (["loss.kl_coef=0.1", "loss.kl_in_reward=true"], 2),
        (["loss.advantage=gae", "model.value_head=true"], 1),
    ],
)
def test_step_flops_counts_the_trainers_extra_forwards(overrides, extra):
    from rl_jax.config import load_recipe
    from rl_jax.train.accounting import forward_flops, step_flops

    cfg = load_recipe("scalerl", ["sampling.n=2", "data.prompts_per_batch=2", *overrides])
    fwd = forward_flops(_LinearFlops(), [3, 4], [2, 1, 5, 5], 2)
    got = step_flops(_LinearFlops(), cfg, [3, 4], [2, 1, 5, 5])
    assert got == {"sampler_flops": fwd, "trainer_flops": (3 + extra) * fwd}
