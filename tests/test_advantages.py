"""Advantage estimators, normalizations, zero-variance reporting, GAE and the
clipped value loss, on small hand-computed cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config import LossConfig
from rl_jax.losses import (
    advantages_from_config,
    clipped_value_loss,
    compute_advantages,
    gae_advantages,
    gae_from_config,
    terminal_rewards,
    zero_variance_groups,
)

TOL = dict(rtol=1e-6, atol=1e-6)
R = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
G = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)


def _adv(r=R, g=G, **kw):
    kw.setdefault("num_groups", 2)
    kw.setdefault("eps", 0.0)
    adv, info = compute_advantages(jnp.asarray(r), jnp.asarray(g), **kw)
    return np.asarray(adv), {k: float(v) for k, v in info.items()}


def test_grpo_group_mean_and_prompt_std():
    a, _ = _adv(estimator="grpo", norm="none")
    np.testing.assert_allclose(a, [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75], **TOL)
    # ddof=1 stds: group 0 sqrt(1/3), group 1 sqrt(.75/3) = .5
    a, _ = _adv(estimator="grpo", norm="prompt")
    s0 = np.sqrt(1 / 3)
    np.testing.assert_allclose(
        a, [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0.5, 0.5, 0.5, -1.5], **TOL
    )
    a, _ = _adv(estimator="grpo", norm="prompt", ddof=0)  # population std .5 and sqrt(3)/4
    s1 = np.sqrt(3) / 4
    np.testing.assert_allclose(a[4:], np.array([0.25, 0.25, 0.25, -0.75]) / s1, **TOL)


def test_rloo_leave_one_out():
    a, _ = _adv(estimator="rloo", norm="none")
    # r_i - mean of the other three
    np.testing.assert_allclose(
        a, [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 1 - 2 / 3, 1 - 2 / 3, 1 - 2 / 3, -1], **TOL
    )
    a, _ = _adv(
        r=np.array([3.0, 1.0, 2.0], np.float32),
        g=np.array([0, 0, 1]),
        estimator="rloo",
        norm="none",
    )
    np.testing.assert_allclose(a, [2.0, -2.0, 0.0], **TOL)  # singleton group: no baseline


def test_batch_std_and_reinforce_pp():
    c = np.array([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    a, _ = _adv(estimator="grpo", norm="batch")
    np.testing.assert_allclose(a, c / c.std(ddof=1), **TOL)
    # REINFORCE++ with group baseline: the centered c has batch mean 0 already.
    a, _ = _adv(estimator="reinforce_pp", norm="batch")
    np.testing.assert_allclose(a, (c - c.mean()) / c.std(ddof=1), **TOL)
    # Without the group baseline: a global z-score of the rewards.
    a, info = _adv(estimator="reinforce_pp", norm="batch", group_baseline=False)
    np.testing.assert_allclose(a, (R - R.mean()) / R.std(ddof=1), **TOL)
    np.testing.assert_allclose([info["adv_mean"], info["adv_std"]], [0.0, 1.0], **TOL)
    np.testing.assert_allclose(
        [info["reward_mean"], info["reward_std"]], [R.mean(), R.std(ddof=1)], **TOL
    )


def test_zero_variance_groups_reported_and_get_zero_advantage():
    r = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0, 7.0], np.float32)
    g = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)  # group 3 has one valid row
    zv, present = zero_variance_groups(r, g, num_groups=5, valid_b=valid)
    np.testing.assert_array_equal(zv, [True, False, True, True, False])
    np.testing.assert_array_equal(present, [True, True, True, True, False])
    for est in ("grpo", "rloo"):
        a, info = _adv(r, g, num_groups=5, estimator=est, norm="prompt", valid_b=valid, eps=1e-6)
        assert info["groups"] == 4  # group 4 is absent
        # zero-variance groups are exactly those whose advantages are all zero
        assert not a[[0, 1, 4, 5, 6, 7]].any() and (np.abs(a[2:4]) > 0.5).all()
        assert "zero_var_frac" not in info  # one definition: zero_variance_groups


def test_invalid_rows_change_nothing_and_group_order_is_free():
    perm = np.array([5, 0, 7, 2, 4, 1, 6, 3])
    # Each estimator and each norm once (valid rows enter every mean and std).
    for est, norm in (("grpo", "prompt"), ("rloo", "batch"), ("reinforce_pp", "none")):
        base, _ = _adv(estimator=est, norm=norm, eps=1e-6)
        # a padding row with a wild reward and an out-of-range group id
        r = np.r_[R, 1e6].astype(np.float32)
        g = np.r_[G, 99]
        a, _ = _adv(r, g, estimator=est, norm=norm, eps=1e-6, valid_b=np.r_[np.ones(8), 0])
        np.testing.assert_allclose(a[:8], base, **TOL)
        assert a[8] == 0
        a, _ = _adv(R[perm], G[perm], estimator=est, norm=norm, eps=1e-6)
        np.testing.assert_allclose(a, base[perm], **TOL)


def test_errors_and_jit():
    with pytest.raises(ValueError, match="gae_advantages"):
        _adv(estimator="gae")
    with pytest.raises(ValueError, match=r"not one of \['batch', 'prompt', 'none'\]"):
        _adv(norm="std")
    with pytest.raises(ValueError, match=r"num_groups=1"):
        _adv(num_groups=1)
    fn = jax.jit(
        lambda r, g: compute_advantages(r, g, estimator="rloo", norm="batch", num_groups=2)
    )
    a, info = fn(jnp.asarray(R), jnp.asarray(G))
    np.testing.assert_allclose(a, _adv(estimator="rloo", norm="batch", eps=1e-6)[0], **TOL)
    assert all(v.shape == () for v in info.values())


def test_advantages_from_config_with_kl_in_reward():
    logp = np.full((8, 2), -1.0, np.float32)
    ref = logp - np.arange(8, dtype=np.float32)[:, None] / 10  # k1 per token = b / 10
    mask = np.ones((8, 2), np.float32)
    cfg = LossConfig(
        advantage="grpo", adv_norm="none", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1"
    )
    a, _ = advantages_from_config(
        cfg, R, G, num_groups=2, behaviour_logp_bt=logp, ref_logp_bt=ref, mask_bt=mask
    )
    shaped = R - 0.5 * 2 * np.arange(8) / 10
    expect = shaped - np.repeat([shaped[:4].mean(), shaped[4:].mean()], 4)
    np.testing.assert_allclose(a, expect, **TOL)
    with pytest.raises(ValueError, match="behaviour_logp_bt"):
        advantages_from_config(cfg, R, G, num_groups=2)


# ---------------------------------------------------------------- GAE and critic


def test_terminal_rewards_on_last_trained_token():
    mask = np.array([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    out = terminal_rewards(jnp.array([2.0, 3.0, 4.0]), mask)
    expect = np.zeros((3, 6))
    expect[0, 4], expect[1, 1] = 2.0, 3.0  # the empty row gets nothing
    np.testing.assert_allclose(out, expect, **TOL)
    # packed: sequences 0 and 1 in row 0, sequence 2 in row 1
    seq = np.array([[0, 0, 1, 1, 1, -1], [2, 2, 2, -1, -1, -1], [-1] * 6])
    pm = np.array([[1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0] * 6], np.float32)
    out = terminal_rewards(jnp.array([2.0, 3.0, 4.0]), pm, seq_ids=seq, num_seqs=3)
    expect = np.zeros((3, 6))
    expect[0, 1], expect[0, 3], expect[1, 1] = 2.0, 3.0, 4.0
    np.testing.assert_allclose(out, expect, **TOL)


def test_gae_hand_case():
    r = np.array([[0.0, 0.0, 1.0]], np.float32)
    v = np.array([[0.5, 0.6, 0.7]], np.float32)
    m = np.ones((1, 3), np.float32)
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam)
    np.testing.assert_allclose(adv, [[a0, a1, a2]], **TOL)
    np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]], **TOL)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t (Monte Carlo return)
    adv, ret = gae_advantages(r, v, m)
    np.testing.assert_allclose(adv, [[0.5, 0.4, 0.3]], **TOL)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], **TOL)


def test_gae_skips_masked_tokens_and_packing_agrees():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(2, 6)).astype(np.float32)
    v = rng.normal(size=(2, 6)).astype(np.float32)
    m = np.array([[0, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0]], np.float32)  # hole at t=3
    adv, ret = gae_advantages(r, v, m, gamma=0.9, lam=0.7)
    keep = [1, 2, 4, 5]  # the same row without its masked tokens
    adv_c, _ = gae_advantages(r[:1, keep], v[:1, keep], np.ones((1, 4)), gamma=0.9, lam=0.7)
    np.testing.assert_allclose(adv[0, keep], adv_c[0], **TOL)
    assert not adv[0, [0, 3]].any() and not ret[0, [0, 3]].any()
    # Packing both rows into one: the recursion restarts at the sequence boundary.
    pr = np.concatenate([r[0], r[1, :3]])[None]
    pv = np.concatenate([v[0], v[1, :3]])[None]
    pm = np.concatenate([m[0], m[1, :3]])[None]
    seq = np.array([[0] * 6 + [1] * 3])
    padv, pret = gae_advantages(pr, pv, pm, gamma=0.9, lam=0.7, seq_ids=seq)
    np.testing.assert_allclose(padv[0], np.concatenate([adv[0], adv[1, :3]]), **TOL)
    np.testing.assert_allclose(pret[0], np.concatenate([ret[0], ret[1, :3]]), **TOL)


def test_gae_from_config_whitens():
    rng = np.random.default_rng(1)
    v = rng.normal(size=(2, 4)).astype(np.float32)
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    cfg = LossConfig(advantage="gae", adv_norm="batch", adv_eps=0.0, gamma=0.9, lam=0.95)
    adv, ret = gae_from_config(cfg, np.array([1.0, 0.0]), v, m)
    raw, ret0 = gae_advantages(
        terminal_rewards(jnp.array([1.0, 0.0]), m), v, m, gamma=0.9, lam=0.95
    )
    raw = np.asarray(raw)[m > 0]
    np.testing.assert_allclose(np.asarray(adv)[m > 0], (raw - raw.mean()) / raw.std(ddof=1), **TOL)
    np.testing.assert_allclose(ret, ret0, **TOL)


def test_clipped_value_loss_hand_case():
    v = jnp.array([1.0, 1.0, 0.5])
    old = jnp.array([0.5, 0.5, 0.5])
    ret = jnp.array([2.0, 0.0, 0.6])
    loss, clipped = clipped_value_loss(v, ret, old, clip=0.2)
    # 1: v_clip .7 -> max(1, 1.69)/2 ; 2: v_clip .7 -> max(1, .49)/2 ; 3: inside -> .01/2
    np.testing.assert_allclose(loss, [1.69 / 2, 0.5, 0.005], **TOL)
    np.testing.assert_array_equal(clipped, [1.0, 0.0, 0.0])
    g = jax.grad(lambda x: clipped_value_loss(x, ret, old, clip=0.2)[0].sum())(v)
    np.testing.assert_allclose(g, [0.0, 1.0, -0.1], **TOL)  # clipped branch: no gradient
    loss, _ = clipped_value_loss(v, ret, None, clip=0.2)
    np.testing.assert_allclose(loss, 0.5 * (v - ret) ** 2, **TOL)
