"""Zero-variance filtering and DAPO dynamic sampling in the trainer, on the tiny model.

One definition (rl_jax.losses.zero_variance_groups on the shaped rewards the
advantages read), a metric that agrees with the advantages, and every scored
group in the pass-rate history, dynamic-sampling discards included.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.config import load_recipe
from rl_jax.rewards._registry import _REGISTRY, _LocalRewardFn, register
from rl_jax.runs import read_jsonl
from rl_jax.train import phases
from rl_jax.train.loop import RLTrainer

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

# A verifier that fails every sample (raw rewards all equal) but calls a completion
# well formed when it starts with an even digit: with a format reward, the shaped
# rewards differ within groups while the raw ones never do.
if "test_flat_even_format" not in _REGISTRY:

    @register("test_flat_even_format")
    def _flat(scale, timeout_s, workers):
        return _LocalRewardFn(
            "test_flat_even_format",
            scale,
            score=lambda c, a: 0.0,
            well_formed=lambda c: c[:1] in "02468",
        )


BASE = [
    *train_even_first.TINY_RUN,
    "rewards.name=test_flat_even_format",
    "eval.every=0",
    "eval.at_start=false",
    "mesh.num_devices=1",
]
P, G = 4, 4  # TINY_RUN's data.prompts_per_batch and sampling.n


def _run(tmp_path, monkeypatch, *extra):
    """Train on the tiny model; returns (trainer, metric rows, advantages of each step)."""
    calls = []
    real = phases.advantages_from_config

    def spy(cfg, rewards_b, group_ids_b, **kw):
        adv, info = real(cfg, rewards_b, group_ids_b, **kw)
        calls.append((np.asarray(rewards_b), np.asarray(kw["valid_b"]), np.asarray(adv)))
        return adv, info

    monkeypatch.setattr(phases, "advantages_from_config", spy)
    cfg = load_recipe("scalerl", [*BASE, f"out_dir={tmp_path}", *extra])
    tr = RLTrainer(cfg, quiet=True)
    tr.run_loop()
    return tr, [r for r in read_jsonl(tr.run.metrics_path) if "train/reward" in r], calls


def test_zero_variance_metric_agrees_with_the_advantages(tmp_path, monkeypatch):
    _, rows, calls = _run(
        tmp_path,
        monkeypatch,
        "train.steps=2",
        "rewards.format_coef=0.5",
        "data.zero_variance_filter=false",
    )
    assert len(rows) == len(calls) == 2
    fracs = []
    for row, (shaped, valid, adv) in zip(rows, calls, strict=True):
        assert valid.all()  # filter off: every group enters the advantages
        # Zero-variance groups are those whose shaped rewards are all equal, which are
        # exactly those whose advantages are all zero.
        flat_g = np.ptp(shaped.reshape(P, G), axis=1) == 0
        zero_adv_g = (adv.reshape(P, G) == 0).all(axis=1)
        np.testing.assert_array_equal(flat_g, zero_adv_g)
        assert row["train/zero_variance_frac"] == zero_adv_g.mean()
        assert not any(k.startswith("adv/zero_var") for k in row)  # no second definition
        fracs.append(zero_adv_g.mean())
    assert 0 < max(fracs) and min(fracs) < 1  # both kinds of group occurred


def test_filter_decides_on_the_shaped_rewards(tmp_path, monkeypatch):
    # Raw rewards are flat in every group; the format reward makes some groups differ.
    # Those groups carry non-zero advantages and must be trained, not filtered.
    _, rows, calls = _run(tmp_path, monkeypatch, "train.steps=2", "rewards.format_coef=0.5")
    for row, (shaped, valid, adv) in zip(rows, calls, strict=True):
        varied_g = np.ptp(shaped.reshape(P, G), axis=1) > 0
        np.testing.assert_array_equal(valid.reshape(P, G).all(axis=1), varied_g)
        assert (adv.reshape(P, G)[varied_g] != 0).any(axis=1).all()
        assert row["train/rows_trained"] == G * varied_g.sum()
        assert row["train/zero_variance_frac"] == 1 - varied_g.mean()
    assert sum(r["train/rows_trained"] for r in rows) > 0


@pytest.mark.parametrize("format_coef", [0.0, 0.5])
def test_dynamic_sampling_records_every_scored_group(tmp_path, monkeypatch, format_coef):
    # format_coef 0: no group ever differs, so all 3 rounds run and 2 rounds' groups are
    # discarded; 0.5: groups with differing shaped rewards are kept (and trained).
    tr, rows, calls = _run(
        tmp_path,
        monkeypatch,
        "train.steps=1",
        f"rewards.format_coef={format_coef}",
        "data.dynamic_sampling=true",
        "data.max_resample_rounds=3",
    )
    scored_groups = tr.counters.as_dict()["rollouts"] / G
    seen = tr.curriculum.state_dict()["seen"]
    assert sum(seen.values()) == scored_groups  # each scored group recorded once
    if format_coef == 0:
        assert scored_groups == 3 * P and rows[0]["train/rows_trained"] == 0
    else:
        ((shaped, valid, _),) = calls
        varied_g = np.ptp(shaped.reshape(P, G), axis=1) > 0
        assert varied_g.any() and rows[0]["train/rows_trained"] == G * varied_g.sum()
