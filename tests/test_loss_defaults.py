"""Per-loss defaults: an unset loss knob is the loss's own (its paper's) value, in the
config (`LossConfig.resolved`), in the registry, in the run id and in the math."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.cli import config as config_cli
from rl_jax.config import (
    ConfigError,
    LossConfig,
    apply_overrides,
    load_recipe,
    resolved,
    run_id,
)
from rl_jax.config.loss import LOSS_DEFAULTS, PER_LOSS_KNOBS, SHARED_DEFAULTS, loss_names
from rl_jax.losses import LossInputs, advantages_from_config, get, loss_from_config

LOSSES = loss_names()  # the built-in ones

TOL = dict(rtol=1e-6, atol=1e-6)

# What `loss.name=X` alone must mean (the papers; CISPO as ScaleRL uses it).
PAPERS = {
    "ppo": dict(aggregation="token", advantage="gae", adv_norm="batch", eps_low=0.2, eps_high=0.2),
    "grpo": dict(aggregation="sample", advantage="grpo", adv_norm="prompt", eps_high=0.2),
    "dr_grpo": dict(aggregation="seq_sum", advantage="grpo", adv_norm="none", eps_high=0.2),
    "dapo": dict(aggregation="token", advantage="grpo", adv_norm="prompt", eps_high=0.28),
    "cispo": dict(aggregation="prompt", advantage="grpo", adv_norm="batch", eps_max=5.0),
    "gspo": dict(aggregation="sample", gspo_eps_low=3e-4, gspo_eps_high=4e-4),
    "reinforce": dict(aggregation="token", adv_norm="none"),
    "rloo": dict(aggregation="seq_sum", seq_sum_constant=1.0, advantage="rloo", adv_norm="none"),
    "reinforce_pp": dict(aggregation="token", advantage="reinforce_pp", adv_norm="batch"),
}

# The ScaleRL recipe's loss before defaults were per loss: it must resolve to exactly this.
SCALERL_LOSS = dict(
    name="cispo",
    aggregation="prompt",
    advantage="grpo",
    adv_norm="batch",
    eps_low=0.2,
    eps_high=0.28,
    dual_clip=0.0,
    eps_max=5.0,
    eps_min=0.0,
    gspo_eps_low=3e-4,
    gspo_eps_high=4e-4,
    seq_sum_constant=0.0,
)


@pytest.mark.parametrize("name", LOSSES)
def test_loss_name_alone_resolves_to_the_papers_values(name):
    cfg = LossConfig(name=name)
    assert all(getattr(cfg, k) is None for k in PER_LOSS_KNOBS)  # unset until resolved
    r = cfg.resolved()
    for k, v in PAPERS[name].items():
        assert getattr(r, k) == v, (name, k)
    assert r.resolved() == r  # idempotent
    # The loss registry reads the same table.
    spec = get(name)
    assert spec.aggregation == r.aggregation
    assert (spec.advantage, spec.adv_norm) == (r.advantage, r.adv_norm)
    assert spec.params == {k: getattr(r, k) for k in spec.params}


def test_table_covers_every_loss_and_knob():
    assert set(LOSS_DEFAULTS) == set(LOSSES)
    for name, d in LOSS_DEFAULTS.items():
        assert {"aggregation", "advantage", "adv_norm"} <= set(d), name
        assert set(d) <= set(PER_LOSS_KNOBS), name
        LossConfig(name=name, **{k: v for k, v in d.items()})  # every default is valid
    assert set(PER_LOSS_KNOBS) == {"aggregation", "advantage", "adv_norm", *SHARED_DEFAULTS}


def test_set_knobs_win_and_are_validated():
    r = LossConfig(name="grpo", aggregation="token", eps_high=0.3).resolved()
    assert (r.aggregation, r.eps_high, r.adv_norm) == ("token", 0.3, "prompt")
    with pytest.raises(ConfigError, match=r"loss.aggregation='mean' is not one of"):
        LossConfig(name="grpo", aggregation="mean")
    with pytest.raises(ConfigError, match=r"loss.eps_high=-0.1 must be in"):
        LossConfig(eps_high=-0.1)
    # Cross-knob checks use the values the loss will use, defaults included.
    with pytest.raises(ConfigError, match=r"loss.eps_min=6.0 must be below loss.eps_max=5.0"):
        LossConfig(name="cispo", eps_min=6.0)
    with pytest.raises(ConfigError, match=r"loss.advantage='gae' takes one of"):
        LossConfig(name="grpo", advantage="gae", adv_norm="prompt")
    # GAE's per-token advantages are whitened over the batch where the loss's own
    # normalization is by the prompt's std.
    assert LossConfig(name="grpo", advantage="gae").resolved().adv_norm == "batch"
    assert LossConfig(name="dr_grpo", advantage="gae").resolved().adv_norm == "none"


def test_scalerl_recipe_resolves_to_exactly_its_old_values():
    cfg = load_recipe("scalerl")
    r = cfg.loss.resolved()
    assert {k: getattr(r, k) for k in SCALERL_LOSS} == SCALERL_LOSS
    # The default LossConfig is ScaleRL's CISPO too.
    d = LossConfig().resolved()
    assert {k: getattr(d, k) for k in SCALERL_LOSS} == SCALERL_LOSS
    # Pinned ids: a change in what the recipes resolve to, or in how ids are hashed, shows
    # here (it would leave their run directories behind). With the end-only checkpoint the
    # recipes had (the interval is in the id: PipelineRL drains at each checkpoint).
    end_only = ["checkpoint.every=0"]
    assert run_id(load_recipe("scalerl", end_only)) == "v26ce9d608e9fa"
    # on_policy and ppo_off_policy sample as they did: their ids did not move.
    on_policy = load_recipe(
        "scalerl", ["train.off_policy=on_policy", "train.off_policy_k=1", *end_only]
    )
    assert run_id(on_policy) == "v2cb7b78ec9ada"
    assert run_id(load_recipe("minimax", end_only)) == "v2274517511342"  # ppo_off_policy


def test_run_id_hashes_the_resolved_config():
    base = load_recipe("minimax", ["loss.name=grpo"])
    assert base.loss.eps_high is None
    explicit = apply_overrides(base, ["loss.eps_low=0.2", "loss.eps_high=0.2"])
    assert run_id(base) == run_id(explicit)  # unset == set to what it resolves to
    assert run_id(apply_overrides(base, ["loss.eps_high=0.28"])) != run_id(base)
    # Changing loss.name alone changes what the unset knobs mean, and so the id.
    assert run_id(apply_overrides(base, ["loss.name=dapo"])) != run_id(base)
    # `null` puts a knob back to its loss's default.
    again = apply_overrides(explicit, ["loss.eps_high=null"])
    assert again.loss.eps_high is None and run_id(again) == run_id(base)


def test_rl_jax_config_prints_the_resolved_values(capsys):
    assert config_cli.main(["minimax", "loss.name=dr_grpo", "loss.aggregation=null"]) == 0
    out = capsys.readouterr().out
    assert "aggregation: seq_sum" in out and "eps_high: 0.2\n" in out and "null" not in out
    assert config_cli.main(["minimax", "loss.name=dr_grpo", "--format", "flat"]) == 0
    flat = capsys.readouterr().out
    assert "loss.eps_high=0.2\n" in flat and "loss.adv_norm=prompt\n" in flat  # minimax sets it


def _two_rows():
    """Two rows of one prompt, on-policy (every ratio 1): completion lengths 3 and 1 of
    T = 4, advantages +1 and -1."""
    logp = np.full((2, 4), -1.0, np.float32)
    return LossInputs(
        logp=jnp.asarray(logp),
        sampler_logp=jnp.asarray(logp),
        advantages=jnp.asarray([1.0, -1.0]),
        mask=jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32),
        group_ids=jnp.zeros(2, jnp.int32),
    )


def test_loss_name_alone_changes_the_loss_value():
    # At ratio 1 the clipped surrogate is -A per token, so by hand:
    #   grpo (sample mean):            -(1 + -1) / 2             =  0
    #   dr_grpo (sums / budget 4):     -(3 * 1 + 1 * -1) / 4 / 2 = -0.25
    #   dapo (token mean):             -(3 * 1 + 1 * -1) / 4     = -0.5
    # CISPO's per-token value is -sg(w) A logp = A here (logp = -1), so
    #   cispo (prompt mean, 1 prompt): (3 * 1 + 1 * -1) / 4      =  0.5
    expect = {"grpo": 0.0, "dr_grpo": -0.25, "dapo": -0.5, "cispo": 0.5}
    for name, value in expect.items():
        loss, _ = loss_from_config(LossConfig(name=name), _two_rows(), num_groups=1, max_tokens=4)
        np.testing.assert_allclose(loss, value, err_msg=name, **TOL)
    # RLOO: REINFORCE's -A logp = A per token, summed per completion (constant 1) and
    # averaged over the 2 completions: (3 * 1 + 1 * -1) / 2
    loss, _ = loss_from_config(LossConfig(name="rloo"), _two_rows(), num_groups=1, max_tokens=4)
    np.testing.assert_allclose(loss, 1.0, **TOL)


def test_loss_name_alone_changes_the_advantages():
    r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    g = np.zeros(4, np.int32)

    def adv(name):
        a, _ = advantages_from_config(LossConfig(name=name, adv_eps=0.0), r, g, num_groups=1)
        return np.asarray(a)

    # RLOO: r_i - mean of the other three; unnormalized.
    np.testing.assert_allclose(adv("rloo"), [1.0, -1 / 3, -1 / 3, -1 / 3], **TOL)
    # REINFORCE++(-baseline): group-centred [.75, -.25, -.25, -.25], minus its batch mean
    # (0), over its batch std sqrt((.5625 + 3 * .0625) / 3) = 0.5.
    np.testing.assert_allclose(adv("reinforce_pp"), [1.5, -0.5, -0.5, -0.5], **TOL)
    # Dr. GRPO: group-centred, not divided by any std.
    np.testing.assert_allclose(adv("dr_grpo"), [0.75, -0.25, -0.25, -0.25], **TOL)
    # GRPO: divided by the prompt's std, here the same 0.5.
    np.testing.assert_allclose(adv("grpo"), [1.5, -0.5, -0.5, -0.5], **TOL)


def test_run_config_resolves_once_for_every_reader():
    # The trainer reads cfg.loss.advantage directly (ppo's unset one is GAE, which trains
    # a critic): it resolves the whole RunConfig first.
    cfg = load_recipe("scalerl", ["loss.name=ppo"])
    assert cfg.loss.advantage is None and cfg.loss.aggregation == "prompt"  # set by scalerl
    r = resolved(cfg)
    assert (r.loss.advantage, r.loss.adv_norm, r.loss.eps_high) == ("gae", "batch", 0.2)
    # Only the knobs left to a default change: the loss's, the critic's head GAE needs,
    # and the generated task's verifier and validation count (resolved once, here, for
    # every reader).
    assert resolved(r) is r
    assert cfg.model.value_head is None and r.model.value_head is True
    unresolved = dict(loss=cfg.loss, data=cfg.data, rewards=cfg.rewards, model=cfg.model)
    assert dataclasses.replace(r, **unresolved) == cfg
    assert (r.rewards.name, r.data.val_size) == ("arith", cfg.data.generated_val_size)
    assert (cfg.rewards.name, cfg.data.val_size) == ("auto", 0)
