"""Policy losses, aggregation and the registry, against hand-computed values and
closed-form gradients. Small eager cases; one jit test per loss name."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config import ConfigError, LossConfig
from rl_jax.config import loss as loss_cfg
from rl_jax.losses import (
    ADV_ESTIMATORS,
    ADV_NORMS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossInputs,
    aggregate,
    cispo_surrogate,
    clipped_surrogate,
    get,
    gspo_surrogate,
    loss_from_config,
    names,
    policy_loss,
)

TOL = dict(rtol=1e-6, atol=1e-6)
C = 7.0  # explicit seq_sum constant so that padding columns change nothing
NUM_GROUPS = 3
# One loss per distinct surrogate function (test_registry_matches_config_choices
# checks that every other name shares one of these): the expensive invariance
# tests run these against every aggregation.
REPRESENTATIVES = ("dapo", "cispo", "gspo", "reinforce")


# ---------------------------------------------------------------- fixtures


def _batch(seed=0, *, off_policy=0.3):
    """6 rows, 3 prompts of unequal size (interleaved ids), ragged masks with holes."""
    rng = np.random.default_rng(seed)
    b, t = 6, 5
    logp = rng.uniform(-3.0, -0.1, (b, t)).astype(np.float32)
    mask = np.array(
        [
            [0, 1, 1, 1, 0],  # prompt token, completion, padding
            [0, 1, 0, 1, 1],  # interruption hole
            [1, 1, 1, 1, 1],
            [0, 0, 1, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 1, 1],
        ],
        np.float32,
    )
    return dict(
        logp=logp,
        old_logp=(logp + rng.normal(0, off_policy, (b, t))).astype(np.float32),
        sampler_logp=(logp + rng.normal(0, off_policy, (b, t))).astype(np.float32),
        ref_logp=(logp + rng.normal(0, 0.5, (b, t))).astype(np.float32),
        entropy=rng.uniform(0.1, 2.0, (b, t)).astype(np.float32),
        advantages=np.array([1.0, -0.5, 0.7, -1.2, 0.3, 2.0], np.float32),
        mask=mask,
        group_ids=np.array([2, 0, 1, 0, 2, 0], np.int32),
    )


def _inputs(d, **over):
    d = {**d, **over}
    return LossInputs(**{k: (None if v is None else jnp.asarray(v)) for k, v in d.items()})


def ref_weights(mask, group_bt, seq_bt, mode, c=C):
    """W with aggregate(v) = sum(W * v), by explicit loops over sequences / prompts."""
    mask = np.asarray(mask) > 0
    w = np.zeros(mask.shape)
    if mode == "token":
        return mask / mask.sum()
    ids = group_bt if mode == "prompt" else seq_bt
    present = sorted({ids[i] for i in zip(*np.nonzero(mask), strict=True)})
    for s in present:
        sel = mask & (ids == s)
        if mode in ("sample", "prompt"):
            w[sel] = 1.0 / (sel.sum() * len(present))
        else:  # seq_sum
            w[sel] = 1.0 / (c * len(present))
    return w


def _rows(d):
    b, t = d["mask"].shape
    return np.repeat(np.arange(b)[:, None], t, 1), np.repeat(d["group_ids"][:, None], t, 1)


def _eval(name, d, **kw):
    """(loss, metrics, d loss / d logp) in one pass."""

    def f(logp):
        return policy_loss(name, _inputs(d, logp=logp), **kw)

    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"]))
    return loss, m, np.asarray(g)


def _grad_logp(name, d, **kw):
    def f(logp):
        return policy_loss(name, _inputs(d, logp=logp), **kw)[0]

    return np.asarray(jax.grad(f)(jnp.asarray(d["logp"])))


# ---------------------------------------------------------------- registry / config


def test_a_registered_loss_is_chosen_by_name_with_its_defaults():
    """One list of losses: what `register` adds, `loss.name` can pick (with the loss's own
    defaults for the knobs left unset), and the loss computes what its surrogate says."""
    from rl_jax.config import RunConfig, apply_overrides
    from rl_jax.losses import LossSpec, _registry, register

    def half_cispo(logp, old, adv, layout, **p):
        loss, stats = cispo_surrogate(logp, old, adv, **p)
        return 0.5 * loss, stats

    name = "test_half_cispo"
    with pytest.raises(ConfigError, match="loss.name"):
        LossConfig(name=name)
    register(
        LossSpec(
            name=name,
            fn=half_cispo,
            params={"eps_max": 3.0, "eps_min": 0.0},
            aggregation="token",
            paper="a test",
        )
    )
    try:
        cfg = apply_overrides(RunConfig(), [f"loss.name={name}"]).loss.resolved()
        assert (cfg.eps_max, cfg.aggregation, cfg.advantage) == (3.0, "token", "grpo")
        d = _batch()
        got, _ = loss_from_config(cfg, _inputs(d), num_groups=NUM_GROUPS, max_tokens=5)
        cispo = dataclasses.replace(cfg, name="cispo")
        want, _ = loss_from_config(cispo, _inputs(d), num_groups=NUM_GROUPS, max_tokens=5)
        np.testing.assert_allclose(got, 0.5 * want, **TOL)
        with pytest.raises(ValueError, match="not LossConfig knobs"):
            register(dataclasses.replace(_registry.get(name), name="x", params={"bogus": 1.0}))
    finally:
        _registry._REGISTRY.pop(name)
        loss_cfg.LOSS_DEFAULTS.pop(name)


def test_registry_matches_config_choices():
    assert set(names()) == set(loss_cfg.loss_names())
    assert tuple(AGGREGATIONS) == loss_cfg.AGGREGATIONS
    assert tuple(KL_ESTIMATORS) == loss_cfg.KL_ESTIMATORS
    assert set(ADV_ESTIMATORS) | {"gae"} == set(loss_cfg.ADV_ESTIMATORS)
    assert tuple(ADV_NORMS) == loss_cfg.ADV_NORMS
    for n in names():  # every loss's hyperparameters are LossConfig fields
        assert set(get(n).params) <= set(LossConfig.__dataclass_fields__)
        assert get(n).aggregation in AGGREGATIONS
        assert sum(get(n).fn is get(r).fn for r in REPRESENTATIVES) == 1, n


def test_errors_name_what_is_allowed():
    d = _inputs(_batch())
    with pytest.raises(ValueError, match="known losses.*cispo"):
        policy_loss("cispoo", d)
    with pytest.raises(ValueError, match=r"does not take \['eps_low'\].*eps_max"):
        policy_loss("cispo", d, eps_low=0.2)
    with pytest.raises(ValueError, match="not one of"):
        policy_loss("ppo", d, aggregation="mean")
    with pytest.raises(ValueError, match="num_groups"):
        policy_loss("ppo", d, aggregation="prompt")
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, num_groups=2\)"):
        policy_loss("ppo", d, aggregation="prompt", num_groups=2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss("ppo", _inputs(_batch(), ref_logp=None), kl_coef=0.1)
    with pytest.raises(ValueError, match="shape"):
        policy_loss("ppo", _inputs(_batch(), advantages=np.zeros(5, np.float32)))


def test_config_validation():
    with pytest.raises(ConfigError, match="loss.dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ConfigError, match="loss.eps_min"):
        LossConfig(eps_min=5.0, eps_max=5.0)
    with pytest.raises(ConfigError, match="loss.lam"):
        LossConfig(lam=1.5)
    LossConfig(dual_clip=3.0, eps_min=0.5)


# ---------------------------------------------------------------- hand-computed values


def _to_base_shape(d):
    """Pad a hand case with fully masked rows to the [6, 5] shape of `_batch`:
    padding is proven inert (test_padding_changes_nothing) and sharing one shape
    saves the eager per-shape compilations."""
    b = d["mask"].shape[0]
    out = {}
    for k, v in d.items():
        widths = ((0, 6 - b), (0, 0)) if v.ndim == 2 else ((0, 6 - b),)
        out[k] = np.pad(v, widths, constant_values=0).astype(v.dtype)
    return out


def _one_row(ratios, advs):
    """One trained row with the given token ratios (trailing tokens masked)."""
    n, pad = len(ratios), 5 - len(ratios)
    logp = np.log(np.array(ratios + [1.0] * pad, np.float32)) - 1.0
    return _to_base_shape(
        dict(
            logp=logp[None],
            old_logp=np.full((1, 5), -1.0, np.float32),
            sampler_logp=np.full((1, 5), -1.0, np.float32),
            advantages=np.array(advs + [0.0] * pad, np.float32)[None],
            mask=np.array([[1.0] * n + [0.0] * pad], np.float32),
            group_ids=np.zeros(1, np.int32),
        )
    )


def test_ppo_clip_hand_case():
    # r, A -> min(rA, clip(r, .8, 1.2) A): (1.5,1)->1.2  (.5,1)->.5  (1.1,-1)->-1.1
    # (1.5,-1)->-1.5  (.5,-1)->-.8 ; loss = -mean = 1.7 / 5
    d = _one_row([1.5, 0.5, 1.1, 1.5, 0.5], [1, 1, -1, -1, -1])
    loss, m = policy_loss("ppo", _inputs(d), aggregation="token")
    np.testing.assert_allclose(loss, 1.7 / 5, **TOL)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 5, **TOL)
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 5, **TOL)
    np.testing.assert_allclose(m["ratio_max"], 1.5, **TOL)
    np.testing.assert_allclose(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5, **TOL)
    # d loss / d logp = -r A / 5 where the unclipped branch is active, else 0.
    g = _grad_logp("ppo", d, aggregation="token")
    np.testing.assert_allclose(g[0], np.array([0, -0.5, 1.1, 1.5, 0]) / 5, **TOL)


def test_dapo_clip_higher_and_dual_clip_hand_case():
    d = _one_row([1.5, 4.0, 2.0], [1, -1, -1])
    # dapo: 1.5 -> clip at 1.28; dual clip c=3: r=4, A=-1 -> max(-4, -3) = -3;
    # r=2 -> max(-2, -3) = -2.
    loss, m = policy_loss("dapo", _inputs(d), aggregation="token", dual_clip=3.0)
    np.testing.assert_allclose(loss, -(1.28 - 3.0 - 2.0) / 3, **TOL)
    np.testing.assert_allclose(m["clip_frac_dual"], 1 / 3, **TOL)
    g = _grad_logp("dapo", d, aggregation="token", dual_clip=3.0)
    np.testing.assert_allclose(g[0], np.array([0.0, 0.0, 2.0, 0, 0]) / 3, **TOL)


def test_cispo_hand_case():
    # rho = .5, 2, 8 ; A = 1, 1, -1 ; eps_max 5 -> w = .5, 2, 5
    d = _one_row([0.5, 2.0, 8.0], [1, 1, -1])
    logp = d["logp"][0]
    loss, m = policy_loss("cispo", _inputs(d), aggregation="token", eps_max=5.0)
    np.testing.assert_allclose(loss, -(0.5 * logp[0] + 2 * logp[1] - 5 * logp[2]) / 3, **TOL)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 3, **TOL)
    g = _grad_logp("cispo", d, aggregation="token", eps_max=5.0)
    np.testing.assert_allclose(g[0], np.array([-0.5, -2.0, 5.0, 0, 0]) / 3, **TOL)
    # lower truncation
    g = _grad_logp("cispo", d, aggregation="token", eps_max=5.0, eps_min=1.0)
    np.testing.assert_allclose(g[0], np.array([-1.0, -2.0, 5.0, 0, 0]) / 3, **TOL)


def test_reinforce_hand_case():
    d = _one_row([0.5, 2.0], [1.0, -2.0])
    logp = d["logp"][0]
    loss, m = policy_loss("reinforce", _inputs(d))
    np.testing.assert_allclose(loss, -(logp[0] - 2 * logp[1]) / 2, **TOL)
    assert float(m["clip_frac_high"]) == 0.0


def test_gspo_sequence_ratio_hand_case():
    # Row 0: log-ratios .2, -.1 (then masked) -> s0 = exp(.05); row 1: -.3 -> s1 = exp(-.3)
    logp = np.array([[-1.0] * 5, [-2.0] * 5], np.float32)
    old = logp - np.array([[0.2, -0.1, 5.0, 5.0, 5.0], [-0.3, 9.0, 9.0, 9.0, 9.0]], np.float32)
    d = dict(
        logp=logp,
        old_logp=old,
        sampler_logp=old,
        advantages=np.array([1.0, -1.0], np.float32),
        mask=np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], np.float32),
        group_ids=np.zeros(2, np.int32),
    )
    d = _to_base_shape(d)
    logp, old = d["logp"], d["old_logp"]
    s0, s1 = np.exp(0.05), np.exp(-0.3)
    kw = dict(gspo_eps_low=0.2, gspo_eps_high=0.2)
    loss, m = policy_loss("gspo", _inputs(d), **kw)  # paper default: sample mean
    # s0 = 1.051 is inside [.8, 1.2]; s1 = .741 < .8 with A < 0: clipped to .8.
    expect = -0.5 * (s0 * 1.0 + min(-s1, -0.8))
    np.testing.assert_allclose(loss, expect, **TOL)
    np.testing.assert_allclose(m["ratio_mean"], (2 * s0 + s1) / 3, **TOL)
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 3, **TOL)
    # Token form: grad_t = -(1/S) s_i A_i / n_i where unclipped, 0 where clipped.
    g = _grad_logp("gspo", d, **kw)
    np.testing.assert_allclose(g[0, :2], [-0.5 * s0 / 2] * 2, **TOL)
    assert not g[0, 2:].any() and not g[1:].any()
    # The public per-token function agrees.
    _, st = gspo_surrogate(
        jnp.asarray(logp),
        jnp.asarray(old),
        jnp.asarray(np.repeat(d["advantages"][:, None], 5, 1)),
        jnp.asarray(d["mask"]),
        **kw,
    )
    np.testing.assert_allclose(st["ratio"][:2], [[s0] * 5, [s1] * 5], **TOL)


def test_gspo_gradient_is_that_of_the_sequence_ratio():
    d = _batch(1)
    kw = dict(gspo_eps_low=10.0, gspo_eps_high=10.0)  # no clipping: pure ratio gradient
    mask = d["mask"] > 0
    a = d["advantages"]

    def seq_form(logp):
        dlt = jnp.where(mask, logp - d["old_logp"], 0.0)
        n = mask.sum(1)
        s = jnp.exp(dlt.sum(1) / n)  # length-normalized sequence ratio, differentiated
        return -jnp.mean(s * a)

    lp = jnp.asarray(d["logp"])
    np.testing.assert_allclose(policy_loss("gspo", _inputs(d), **kw)[0], seq_form(lp), **TOL)
    np.testing.assert_allclose(_grad_logp("gspo", d, **kw), jax.grad(seq_form)(lp), **TOL)


# ---------------------------------------------------------------- aggregation


def test_aggregate_modes_hand_case():
    v = np.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [5.0, 7.0, 6.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], np.float32)
    g = np.array([0, 0, 1])
    agg = lambda mode, **kw: float(aggregate(v, m, g, mode, num_groups=2, **kw))
    np.testing.assert_allclose(agg("token"), (1 + 2 + 3 + 5 + 7 + 6) / 6, **TOL)
    np.testing.assert_allclose(agg("sample"), (1.5 + 3 + 6) / 3, **TOL)
    np.testing.assert_allclose(agg("prompt"), ((1 + 2 + 3) / 3 + 6) / 2, **TOL)
    np.testing.assert_allclose(agg("seq_sum", seq_sum_constant=4.0), 24 / 4 / 3, **TOL)
    np.testing.assert_allclose(agg("seq_sum"), 24 / 3 / 3, **TOL)  # default C = T
    assert float(aggregate(v, 0 * m, g, "prompt", num_groups=2)) == 0.0


def test_prompt_mean_weighs_prompts_equally():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(3, 4)).astype(np.float32)
    m = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], np.float32)
    g = np.array([0, 0, 1])
    base = float(aggregate(v, m, g, "prompt", num_groups=2))
    # Doubling prompt 0's group (more samples) or lengthening prompt 1's only
    # sequence with copies of its mean keeps each prompt's weight at 1/2.
    v2, m2, g2 = np.concatenate([v, v[:2]]), np.concatenate([m, m[:2]]), np.r_[g, 0, 0]
    np.testing.assert_allclose(aggregate(v2, m2, g2, "prompt", num_groups=2), base, **TOL)
    assert abs(float(aggregate(v2, m2, g2, "token")) - float(aggregate(v, m, g, "token"))) > 1e-3
    v3 = v.copy()
    v3[2, 2:] = v[2, :2].mean()
    m3 = m.copy()
    m3[2] = 1
    np.testing.assert_allclose(aggregate(v3, m3, g, "prompt", num_groups=2), base, **TOL)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_cispo_gradient_closed_form(agg):
    d = _batch(2, off_policy=1.5)  # wide spread: some rho above eps_max and below eps_min
    rows, groups = _rows(d)
    w = ref_weights(d["mask"], groups, rows, agg)
    rho = np.exp(d["logp"] - d["old_logp"])
    a = d["advantages"][:, None]
    kw = dict(aggregation=agg, num_groups=NUM_GROUPS, seq_sum_constant=C)
    for eps_min, eps_max in ((0.0, 2.0), (0.5, 1.5)):
        assert (rho > eps_max)[d["mask"] > 0].any() and (rho < eps_min)[d["mask"] > 0].any() | (
            eps_min == 0
        )
        g = _grad_logp("cispo", d, eps_max=eps_max, eps_min=eps_min, **kw)
        np.testing.assert_allclose(g, -w * np.clip(rho, eps_min, eps_max) * a, **TOL)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_on_policy_every_loss_is_the_plain_policy_gradient(agg):
    d = _batch(4)
    rows, groups = _rows(d)
    expect = -ref_weights(d["mask"], groups, rows, agg) * d["advantages"][:, None]
    kw = dict(aggregation=agg, num_groups=NUM_GROUPS, seq_sum_constant=C)
    for name in names():
        # rho = 1 against old_logp, and (old_logp absent) against the sampler.
        for over in (dict(old_logp=d["logp"]), dict(old_logp=None, sampler_logp=d["logp"])):
            g = _grad_logp(name, {**d, **over}, **kw)
            np.testing.assert_allclose(g, expect, **TOL, err_msg=f"{name} {over.keys()}")


def test_ppo_off_policy_gradient_closed_form():
    d = _batch(5, off_policy=0.4)
    rows, groups = _rows(d)
    w = ref_weights(d["mask"], groups, rows, "sample")
    r = np.exp(d["logp"] - d["old_logp"])
    a = np.broadcast_to(d["advantages"][:, None], r.shape)
    el, eh = 0.2, 0.28
    active = np.where(a > 0, r <= 1 + eh, r >= 1 - el)
    g = _grad_logp("dapo", d, aggregation="sample")
    np.testing.assert_allclose(g, -w * r * a * active, **TOL)


def test_tis_weight_and_regularizer_gradients():
    d = _batch(6, off_policy=0.8)
    rows, groups = _rows(d)
    w = ref_weights(d["mask"], groups, rows, "token")
    a = d["advantages"][:, None]
    tis_w = np.minimum(np.exp(d["old_logp"] - d["sampler_logp"]), 1.5)
    kw = dict(aggregation="token", tis=True, tis_cap=1.5, eps_max=100.0)
    rho = np.exp(d["logp"] - d["old_logp"])
    g = _grad_logp("cispo", d, **kw)
    np.testing.assert_allclose(g, -w * tis_w * rho * a, **TOL)
    # Without old_logp, TIS makes the ratio 1 and the weight exp(logp - sampler).
    g = _grad_logp("ppo", {**d, "old_logp": None}, aggregation="token", tis=True, tis_cap=1.5)
    tis_w0 = np.minimum(np.exp(d["logp"] - d["sampler_logp"]), 1.5)
    np.testing.assert_allclose(g, -w * tis_w0 * a, **TOL)
    # k3 in the loss: d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp)
    g_kl = _grad_logp("reinforce", d, aggregation="token", kl_coef=0.1) - _grad_logp(
        "reinforce", d, aggregation="token"
    )
    np.testing.assert_allclose(
        g_kl, 0.1 * w * (1 - np.exp(d["ref_logp"] - d["logp"])), rtol=1e-5, atol=1e-6
    )

    def f(ent):
        return policy_loss(
            "cispo", _inputs(d, entropy=ent), aggregation="token", entropy_coef=0.01
        )[0]

    np.testing.assert_allclose(jax.grad(f)(jnp.asarray(d["entropy"])), -0.01 * w, **TOL)


def test_value_loss_term():
    d = _batch(7)
    rng = np.random.default_rng(7)
    vals = rng.normal(size=d["mask"].shape).astype(np.float32)
    ret = rng.normal(size=d["mask"].shape).astype(np.float32)
    old_v = vals + rng.normal(0, 0.5, vals.shape).astype(np.float32)
    rows, groups = _rows(d)
    w = ref_weights(d["mask"], groups, rows, "token")
    v_clip = old_v + np.clip(vals - old_v, -0.2, 0.2)
    per_tok = 0.5 * np.maximum((vals - ret) ** 2, (v_clip - ret) ** 2)
    base, _ = policy_loss("ppo", _inputs(d))
    loss, m = policy_loss(
        "ppo", _inputs(d, values=vals, returns=ret, old_values=old_v), value_coef=0.5
    )
    np.testing.assert_allclose(m["value_loss"], (w * per_tok).sum(), **TOL)
    np.testing.assert_allclose(loss, base + 0.5 * (w * per_tok).sum(), **TOL)


# ---------------------------------------------------------------- invariances


def _pad(d):
    """Add a fully masked row (group id -1) and a masked column, all garbage."""
    out = {}
    for k, v in d.items():
        if v is None:
            out[k] = None
        elif v.ndim == 2:
            fill = 0.0 if k == "mask" else np.nan
            v = np.pad(v, ((0, 1), (0, 1)), constant_values=fill)
            if k == "logp":
                v[-1, :] = -np.inf
            out[k] = v.astype(d[k].dtype)
        else:
            fill = -1 if k == "group_ids" else np.nan
            out[k] = np.pad(v, (0, 1), constant_values=fill).astype(v.dtype)
    return out


def test_padding_changes_nothing():
    d = {k: (v[:5, :4] if v.ndim == 2 else v[:5]) for k, v in _batch(8).items()}
    p = _pad(d)
    assert p["mask"].shape == (6, 5)
    for name, agg in itertools.product(REPRESENTATIVES, AGGREGATIONS):
        kw = dict(aggregation=agg, num_groups=NUM_GROUPS, seq_sum_constant=C)
        kw |= dict(tis=True, kl_coef=0.05, entropy_coef=0.01)
        la, ma, ga = _eval(name, d, **kw)
        lb, mb, gb = _eval(name, p, **kw)
        np.testing.assert_allclose(lb, la, **TOL, err_msg=f"{name}/{agg}")
        for k in ma:
            if k != "masked_frac":
                np.testing.assert_allclose(mb[k], ma[k], **TOL, err_msg=f"{name}/{agg} {k}")
        np.testing.assert_allclose(gb[:-1, :-1], ga, **TOL, err_msg=f"{name}/{agg}")
        assert not gb[-1].any() and not gb[:, -1].any()


def _pack(d, width, rows_out):
    """Pack rows back to back into `rows_out` rows of `width` (dropping each row's
    trailing padding), with per-token advantages, group ids and sequence ids."""
    b, t = d["mask"].shape
    lens = [int(np.nonzero(d["mask"][i])[0].max()) + 1 for i in range(b)]
    rows, pos = [[]], []
    for i, n in enumerate(lens):
        if len(rows[-1]) + n > width:
            rows.append([])
        pos.append([(len(rows) - 1, len(rows[-1]) + j) for j in range(n)])
        rows[-1].extend([(i, j) for j in range(n)])
    nb = rows_out
    assert len(rows) <= nb
    out = {k: np.zeros((nb, width), np.float32) for k in d if k not in ("group_ids",)}
    out["group_ids"] = np.zeros((nb, width), np.int32)
    out["seq_ids"] = np.full((nb, width), -1, np.int32)  # padding: an out-of-range id
    for r, row in enumerate(rows):
        for c, (i, j) in enumerate(row):
            for k, v in d.items():
                if k == "advantages":
                    out[k][r, c] = v[i]
                elif k == "group_ids":
                    out[k][r, c] = v[i]
                else:
                    out[k][r, c] = v[i, j]
            out["seq_ids"][r, c] = i
    return out, pos, lens


def test_packed_and_unpacked_agree():
    d = _batch(9)
    p, pos, lens = _pack(d, width=5, rows_out=6)  # 5 packed rows + 1 empty
    assert not p["mask"][-1].any() and set(p["seq_ids"][3]) == {3, 4}  # two in one row
    for name, agg in itertools.product(REPRESENTATIVES, AGGREGATIONS):
        kw = dict(aggregation=agg, num_groups=NUM_GROUPS, seq_sum_constant=C)
        kw |= dict(tis=True, kl_coef=0.05, entropy_coef=0.01)
        if name == "gspo":
            kw |= dict(gspo_eps_low=0.05, gspo_eps_high=0.05)  # some sequences clipped
        la, ma, ga = _eval(name, d, **kw)
        lb, mb, gb = _eval(name, p, num_seqs=6, **kw)
        np.testing.assert_allclose(lb, la, **TOL, err_msg=f"{name}/{agg}")
        for k in ("ratio_mean", "clip_frac_low", "clip_frac_high", "kl", "entropy"):
            np.testing.assert_allclose(mb[k], ma[k], **TOL, err_msg=f"{name}/{agg} {k}")
        for i, n in enumerate(lens):
            got = np.array([gb[r, c] for r, c in pos[i]])
            np.testing.assert_allclose(got, ga[i, :n], **TOL, err_msg=f"{name}/{agg} row {i}")


# ---------------------------------------------------------------- robustness and jit


def test_no_nan_or_inf_at_extreme_log_ratios_and_empty_rows():
    d = _batch(10)
    sign = np.where(np.indices(d["mask"].shape).sum(0) % 2 == 0, 1.0, -1.0).astype(np.float32)
    d |= dict(
        old_logp=d["logp"] - 80 * sign,
        sampler_logp=d["logp"] + 80 * sign,
        ref_logp=d["logp"] + 80 * sign,
    )
    d["mask"][3] = 0  # a fully masked row
    rng = np.random.default_rng(10)
    vals = rng.normal(size=d["mask"].shape).astype(np.float32)
    d |= dict(values=vals, returns=vals + 1, old_values=vals - 1)
    est = itertools.cycle(KL_ESTIMATORS)
    for name, agg in itertools.product(REPRESENTATIVES, AGGREGATIONS):
        kw = dict(aggregation=agg, num_groups=NUM_GROUPS, tis=True, kl_coef=0.1)
        kw |= dict(kl_estimator=next(est), entropy_coef=0.01, dual_clip=3.0 * (name == "dapo"))
        if name != "dapo":
            kw.pop("dual_clip")

        def f(logp, ent, v, name=name, kw=kw):
            return policy_loss(name, _inputs(d, logp=logp, entropy=ent, values=v), **kw)

        (loss, m), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
            jnp.asarray(d["logp"]), jnp.asarray(d["entropy"]), jnp.asarray(vals)
        )
        assert np.isfinite(loss), (name, agg)
        assert all(np.isfinite(v) for v in m.values()), (name, agg, m)
        assert all(np.isfinite(g).all() for g in grads), (name, agg)
    # Everything masked: the loss is 0 and still differentiable.
    loss, m = policy_loss("cispo", _inputs(d, mask=0 * d["mask"]), num_groups=3)
    assert float(loss) == 0.0 and float(m["masked_frac"]) == 1.0


def test_jit_matches_eager_and_compiles_once():
    d = _batch(11)
    for name in names():
        traces = []

        def step(inp, name=name, traces=traces):
            traces.append(1)
            return policy_loss(name, inp, aggregation="prompt", num_groups=3)

        fn = jax.jit(step)
        loss, m = fn(_inputs(d))
        eager, me = policy_loss(name, _inputs(d), aggregation="prompt", num_groups=3)
        np.testing.assert_allclose(loss, eager, **TOL)
        assert set(m) == set(me) and all(v.shape == () for v in m.values())
        fn(_inputs(_batch(12)))  # new values, same shapes: no retrace
        assert len(traces) == 1, name


@pytest.mark.devices(2)
def test_sharded_batch_matches_single_device():
    from rl_jax.config import MeshConfig
    from rl_jax.sharding import batch_sharding, make_mesh

    mesh = make_mesh(MeshConfig(num_devices=2, data=2, fsdp=1))
    d = _batch(15)
    inp = _inputs(d)
    sharded = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.ndim)), inp)
    assert len(sharded.logp.sharding.device_set) == 2

    def f(logp, i):
        i = dataclasses.replace(i, logp=logp)
        return policy_loss("cispo", i, aggregation="prompt", num_groups=3, kl_coef=0.1)

    vg = jax.value_and_grad(f, has_aux=True)
    (l_s, _), g_s = jax.jit(vg)(sharded.logp, sharded)
    (l_1, _), g_1 = vg(inp.logp, inp)
    np.testing.assert_allclose(l_s, l_1, **TOL)
    np.testing.assert_allclose(g_s, g_1, **TOL)


def test_loss_from_config_passes_every_knob():
    d = _batch(13)
    cfg = LossConfig(name="dr_grpo", aggregation="seq_sum", seq_sum_constant=0.0, eps_high=0.3)
    loss, _ = loss_from_config(cfg, _inputs(d), num_groups=3, max_tokens=11)
    expect, _ = policy_loss(
        "dr_grpo",
        _inputs(d),
        aggregation="seq_sum",
        seq_sum_constant=11.0,
        eps_low=0.2,
        eps_high=0.3,
    )
    np.testing.assert_allclose(loss, expect, **TOL)
    cfg = LossConfig(name="cispo", eps_max=1.1, kl_coef=0.3, kl_in_reward=True, tis=True)
    loss, _ = loss_from_config(cfg, _inputs(d), num_groups=3, max_tokens=11)
    expect, _ = policy_loss(
        "cispo", _inputs(d), aggregation="prompt", num_groups=3, eps_max=1.1, tis=True
    )
    np.testing.assert_allclose(loss, expect, **TOL)  # KL left to the rewards
    cfg = LossConfig(name="cispo", kl_coef=0.3, kl_estimator="k2")
    loss, _ = loss_from_config(cfg, _inputs(d), num_groups=3, max_tokens=11)
    expect, _ = policy_loss(
        "cispo", _inputs(d), aggregation="prompt", num_groups=3, kl_coef=0.3, kl_estimator="k2"
    )
    np.testing.assert_allclose(loss, expect, **TOL)


def test_public_surrogates_match_the_registry():
    d = _batch(14)
    a = jnp.broadcast_to(jnp.asarray(d["advantages"])[:, None], d["mask"].shape)
    lp, old = jnp.asarray(d["logp"]), jnp.asarray(d["old_logp"])
    l1, _ = clipped_surrogate(lp, old, a, eps_low=0.2, eps_high=0.28)
    l2, _ = cispo_surrogate(lp, old, a, eps_max=5.0)
    rows, groups = _rows(d)
    w = ref_weights(d["mask"], groups, rows, "token")
    np.testing.assert_allclose(policy_loss("dapo", _inputs(d))[0], (w * l1).sum(), **TOL)
    l2_token = policy_loss("cispo", _inputs(d), aggregation="token")[0]
    np.testing.assert_allclose(l2_token, (w * l2).sum(), **TOL)
