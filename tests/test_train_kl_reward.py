"""`loss.kl_in_reward=true` trains with every recipe in experiments/: the reference's
log-probs are taken before the advantages, which subtract the KL from the rewards.

Each recipe keeps its own algorithm (loss, advantages, off-policy mode, filters) at
the tiny sizes of the trainer tests, for two steps: the first update makes the
policy differ from the reference, so the second step's rewards carry a KL.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.config import load_recipe
from rl_jax.losses import compute_advantages
from rl_jax.runs import read_jsonl
from rl_jax.train import phases
from rl_jax.train.loop import RLTrainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

# scalerl_8b is scalerl at the paper's sizes and code_mix_tpu qwen3_math's algorithm on a
# mixture (their cases cover them; tests/test_plan_recipes.py plans both).
SAME_ALGORITHM = {"scalerl_8b": "scalerl", "code_mix_tpu": "qwen3_math"}
RECIPES = sorted(
    p.stem
    for p in (ROOT / "experiments").glob("*.py")
    if not p.stem.startswith("_")
    and "def recipe(" in p.read_text()
    and p.stem not in SAME_ALGORITHM
)
KL_COEF = 0.1
# The tiny sizes, without the off-policy mode: each recipe keeps its own.
TINY = [o for o in train_even_first.TINY_RUN if not o.startswith("train.off_policy")]
# A real-model recipe reads its model and data files: here it keeps its algorithm on the
# tiny model and the generated task (the real files are tested in test_real_data.py).
NO_FILES = [
    "model.path=''",
    "data.mixture=''",
    "data.source=arith",
    "data.path=''",
    "data.answer_instruction=auto",
    "sampling.max_prompt_len=0",
]


def _no_files(cfg) -> list[str]:
    """NO_FILES for a real-model recipe, and what places a TPU-sized one on its slice
    reset for one CPU device: its optimizer steps a batch without micro-batches, the
    default mesh, a slot for every row, every batch in flight PipelineRL allows."""
    if not cfg.model.path:
        return []
    steps = cfg.train.updates_per_batch // cfg.train.grad_accum
    mesh = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]
    train = [f"train.updates_per_batch={steps}", "train.grad_accum=1", "train.pipeline_waves=0"]
    return [*NO_FILES, *mesh, *train, "sampling.engine_slots=0"]


def test_recipes_left_out_share_their_stand_ins_algorithm():
    for name, stand_in in SAME_ALGORITHM.items():
        a, b = load_recipe(name), load_recipe(stand_in)
        assert a.loss.resolved() == b.loss.resolved(), name
        assert (a.train.off_policy, a.train.off_policy_k) == (
            b.train.off_policy,
            b.train.off_policy_k,
        )


def test_every_recipe_is_covered():
    assert {"scalerl", "grpo", "dapo", "ppo", "minimax", "magistral", "isocompute"} <= set(RECIPES)


def _k3_sum(behaviour_bt, ref_bt, mask_bt):
    """sum_t k3 by hand: exp(ref - logp) - 1 - (ref - logp) on trained tokens."""
    d = np.asarray(ref_bt, np.float64) - np.asarray(behaviour_bt, np.float64)
    return ((np.exp(d) - 1.0 - d) * (np.asarray(mask_bt) > 0)).sum(axis=-1)


def _group_adv(rewards_b, c, groups_b, valid_b, num_groups):
    a, _ = compute_advantages(
        np.asarray(rewards_b, np.float32),
        groups_b,
        estimator=c.advantage,
        norm=c.adv_norm,
        num_groups=num_groups,
        valid_b=valid_b,
        eps=c.adv_eps,
    )
    return np.asarray(a)


@pytest.mark.parametrize("recipe", RECIPES)
def test_kl_in_reward_trains_every_recipe(recipe, tmp_path, monkeypatch):
    calls = []
    real_adv, real_gae = phases.advantages_from_config, phases.gae_from_config

    def spy_adv(cfg, rewards_b, group_ids_b, **kw):
        out = real_adv(cfg, rewards_b, group_ids_b, **kw)
        calls.append(("adv", cfg, rewards_b, group_ids_b, kw, out[0]))
        return out

    def spy_gae(cfg, rewards_b, values_bt, mask_bt, **kw):
        out = real_gae(cfg, rewards_b, values_bt, mask_bt, **kw)
        calls.append(("gae", cfg, rewards_b, None, {**kw, "mask_bt": mask_bt}, out[0]))
        return out

    monkeypatch.setattr(phases, "advantages_from_config", spy_adv)
    monkeypatch.setattr(phases, "gae_from_config", spy_gae)
    files = _no_files(load_recipe(recipe))
    cfg = load_recipe(
        recipe,
        [
            *TINY,
            *files,
            f"out_dir={tmp_path}",
            "train.steps=2",
            "eval.every=0",
            "eval.at_start=false",
            "mesh.num_devices=1",
            "loss.kl_in_reward=true",
            f"loss.kl_coef={KL_COEF}",
            # One full-size first update (no warm-up), so that step 2's KL is large
            # enough to tell shaped advantages from plain ones.
            "train.warmup_steps=0",
            "train.lr=0.01",
        ],
    )
    trainer = RLTrainer(cfg, quiet=True)
    summary = trainer.run_loop()
    assert summary["steps"] == 2
    rows = [r for r in read_jsonl(trainer.run.metrics_path) if "train/reward" in r]
    assert len(rows) == 2 and calls
    kl_seen, moved = 0.0, 0.0
    for kind, c, rewards, groups, kw, adv in calls:
        assert kw["behaviour_logp_bt"] is not None and kw["ref_logp_bt"] is not None
        kl_b = _k3_sum(kw["behaviour_logp_bt"], kw["ref_logp_bt"], kw["mask_bt"])
        kl_seen = max(kl_seen, float(kl_b.max()))
        if kind == "adv":
            # The advantages are those of r - kl_coef * sum_t KL_t.
            args = (c, groups, kw["valid_b"], trainer.prompts_per_batch)
            expect = _group_adv(np.asarray(rewards, np.float64) - KL_COEF * kl_b, *args)
            np.testing.assert_allclose(adv, expect, rtol=1e-5, atol=1e-5)
            moved = max(moved, float(np.abs(expect - _group_adv(rewards, *args)).max()))
    assert kl_seen > 1e-3  # after the first update the policy left the reference
    if any(kind == "adv" for kind, *_ in calls):
        assert moved > 1e-3  # and the KL changed the advantages
    for r in rows:
        assert r["train/nonfinite"] == 0 and np.isfinite(r["train/loss"])
