"""KL estimators k1, k2, k3 against exact KLs of known categorical distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.losses import K3_MAX_LOG_RATIO, entropy_from_logits, kl_penalty, kl_shaped_rewards

Q = np.array([0.5, 0.2, 0.15, 0.1, 0.05])  # policy (sampling distribution)
P = np.array([0.3, 0.3, 0.2, 0.1, 0.1])  # reference
EXACT = float(np.sum(Q * np.log(Q / P)))  # KL(q || p)


def _per_category(est, q=Q, p=P):
    return np.asarray(kl_penalty(jnp.log(jnp.asarray(q)), jnp.log(jnp.asarray(p)), est))


def test_k1_k3_are_unbiased_exactly_in_expectation():
    for est in ("k1", "k3"):
        np.testing.assert_allclose(np.sum(Q * _per_category(est)), EXACT, rtol=1e-5)


def test_k3_monte_carlo_mean_matches_exact_kl():
    rng = np.random.default_rng(0)
    n = 200_000
    y = rng.choice(len(Q), size=n, p=Q)
    k3 = _per_category("k3")[y]
    se = k3.std() / np.sqrt(n)
    assert abs(k3.mean() - EXACT) < 4 * se, (k3.mean(), EXACT, se)
    # and the sampling error is small enough for this to mean something
    assert se < 0.05 * EXACT


def test_signs_and_bias_as_documented():
    k1, k2, k3 = (_per_category(e) for e in ("k1", "k2", "k3"))
    assert (k1 < 0).any()  # k1: single samples can be negative
    assert (k2 >= 0).all() and (k3 >= 0).all()
    np.testing.assert_allclose(k2, 0.5 * np.log(P / Q) ** 2, rtol=1e-6)
    # k2 is biased: its expectation is not KL(q || p) here (far from q = p) ...
    assert abs(np.sum(Q * k2) - EXACT) > 1e-3
    # ... but exact to second order near q = p.
    q2 = P * np.exp(1e-2 * np.array([1.0, -1.0, 0.5, -0.5, 0.0]))
    q2 /= q2.sum()
    exact2 = np.sum(q2 * np.log(q2 / P))
    np.testing.assert_allclose(np.sum(q2 * _per_category("k2", q2)), exact2, rtol=2e-2)
    # all vanish when the policies agree
    for e in ("k1", "k2", "k3"):
        assert not _per_category(e, P, P).any()


def test_k2_gradient_is_the_kl_gradient():
    # E_{y~q}[grad_theta k2(y)] (samples held fixed) = grad_theta KL(q_theta || p).
    theta = jnp.log(jnp.asarray(Q, jnp.float32))
    logp_ref = jnp.log(jnp.asarray(P, jnp.float32))
    q = jax.nn.softmax(theta)

    def surrogate(th):
        return jnp.sum(
            jax.lax.stop_gradient(q) * kl_penalty(jax.nn.log_softmax(th), logp_ref, "k2")
        )

    def exact(th):
        lq = jax.nn.log_softmax(th)
        return jnp.sum(jnp.exp(lq) * (lq - logp_ref))

    np.testing.assert_allclose(jax.grad(surrogate)(theta), jax.grad(exact)(theta), atol=1e-6)

    # k1's expected gradient is zero: as a loss term it pulls nothing.
    def k1_surrogate(th):
        return jnp.sum(
            jax.lax.stop_gradient(q) * kl_penalty(jax.nn.log_softmax(th), logp_ref, "k1")
        )

    np.testing.assert_allclose(jax.grad(k1_surrogate)(theta), 0.0, atol=1e-6)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_finite_at_plus_minus_80(est):
    logp = jnp.array([-1.0, -81.0])
    ref = jnp.array([-81.0, -1.0])
    val, grad = jax.value_and_grad(lambda lp: kl_penalty(lp, ref, est).sum())(logp)
    assert np.isfinite(val) and np.isfinite(grad).all()
    if est == "k3":  # clamped at log r = 20 on the overflowing side
        big = float(kl_penalty(jnp.array(-81.0), jnp.array(-1.0), "k3"))
        np.testing.assert_allclose(big, np.expm1(K3_MAX_LOG_RATIO) - K3_MAX_LOG_RATIO, rtol=1e-6)


def test_kl_shaped_rewards():
    logp = np.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], np.float32)
    ref = np.array([[-1.5, -2.0, -9.0], [-0.5, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    k1 = (logp - ref) * mask  # [[.5, 0, -], [-.5, 0, 0]]
    out = kl_shaped_rewards(jnp.array([1.0, 0.0]), logp, ref, mask, kl_coef=0.1, estimator="k1")
    np.testing.assert_allclose(out, [1.0 - 0.05, 0.0 + 0.05], rtol=1e-6)
    r_bt = np.ones_like(logp)
    out = kl_shaped_rewards(r_bt, logp, ref, mask, kl_coef=0.1, estimator="k1")
    np.testing.assert_allclose(out, r_bt - 0.1 * k1, rtol=1e-6)
    with pytest.raises(ValueError, match=r"not one of \['k1', 'k2', 'k3'\]"):
        kl_penalty(logp, ref, "k4")


def test_entropy_from_logits():
    logits = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32) * 3
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(entropy_from_logits(logits), -(p * np.log(p)).sum(-1), rtol=1e-5)
