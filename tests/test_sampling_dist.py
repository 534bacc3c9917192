"""Sampling distributions: greedy, temperature, top-k, top-p; per-row keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.sampling._dist import (
    interrupt_lengths,
    inverse_cdf,
    logprob_temperature,
    row_keys,
    sample_logits,
    step_keys,
    step_uniforms,
    uniforms,
)

N = 20000  # draws per frequency test: 3 sigma of a frequency is < 0.011


def _draw(logits_v, *, n=N, seed=0, **kw):
    logits_bv = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (n, len(logits_v)))
    keys = step_keys(row_keys(jax.random.key(seed), jnp.arange(n)), jnp.int32(3))
    tok, lp = jax.jit(lambda lg, k: sample_logits(lg, k, **kw))(logits_bv, keys)
    return np.asarray(tok), np.asarray(lp)


def _freq(tokens, v):
    return np.bincount(tokens, minlength=v) / len(tokens)


PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS) + 1.7  # an offset must not matter


def test_greedy_is_argmax_with_untempered_logprob():
    logits = jax.random.normal(jax.random.key(1), (6, 11)) * 3
    keys = row_keys(jax.random.key(0), jnp.arange(6))
    tok, lp = sample_logits(logits, keys, temperature=0.0)
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)[np.arange(6), np.argmax(logits, -1)]
    np.testing.assert_allclose(lp, ref, rtol=1e-6, atol=1e-6)
    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(0.6) == 0.6


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_and_logprobs(temperature):
    tok, lp = _draw(LOGITS, temperature=temperature)
    want = PROBS ** (1 / temperature)
    want = want / want.sum()
    np.testing.assert_allclose(_freq(tok, 4), want, atol=0.012)
    np.testing.assert_allclose(lp, np.log(want)[tok], rtol=1e-5, atol=1e-6)


def test_top_k_truncates_but_reports_untruncated_logprob():
    tok, lp = _draw(LOGITS, temperature=1.0, top_k=2)
    np.testing.assert_allclose(_freq(tok, 4), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.012)
    np.testing.assert_allclose(lp, np.log(PROBS)[tok], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "top_p, kept", [(0.4, [0]), (0.6, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
    tok, _ = _draw(LOGITS, temperature=1.0, top_p=top_p)
    want = np.zeros(4)
    want[kept] = PROBS[kept] / PROBS[kept].sum()
    np.testing.assert_allclose(_freq(tok, 4), want, atol=0.012)


def test_top_k_then_top_p():
    # top-k=3 renormalises to [.526, .316, .158]; top_p=0.7 then keeps {0, 1}.
    tok, _ = _draw(LOGITS, temperature=1.0, top_k=3, top_p=0.7)
    np.testing.assert_allclose(_freq(tok, 4), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.012)


def test_zero_probability_tokens_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)
    tok, _ = _draw(logits, n=4000, temperature=1.0)
    assert set(np.unique(tok)) == {1, 3}


def test_row_output_does_not_depend_on_batch_layout():
    logits = jax.random.normal(jax.random.key(2), (16, 50))
    ids = jnp.arange(100, 116)
    key = jax.random.key(7)

    @jax.jit
    def draw(lg, rows, step):
        keys = step_keys(row_keys(key, rows), step)
        return sample_logits(lg, keys, temperature=1.0)[0]

    def run(idx):
        return np.asarray(draw(logits[idx], ids[idx], jnp.int32(5)))

    full = run(np.arange(16))
    perm = np.random.default_rng(0).permutation(16)
    np.testing.assert_array_equal(run(perm), full[perm])
    np.testing.assert_array_equal(run(np.arange(3, 7)), full[3:7])
    # another step or another row id gives other draws
    assert (np.asarray(draw(logits, ids, jnp.int32(6))) != full).any()
    assert (np.asarray(draw(logits, ids + 16, jnp.int32(5))) != full).any()


def test_interrupt_lengths_uniform_in_range():
    got = np.asarray(interrupt_lengths(jax.random.key(0), jnp.arange(4000), 5, 9))
    assert got.min() == 5 and got.max() == 9
    np.testing.assert_allclose(np.bincount(got)[5:] / 4000, 0.2, atol=0.03)
    again = np.asarray(interrupt_lengths(jax.random.key(0), jnp.arange(10, 20), 5, 9))
    np.testing.assert_array_equal(again, got[10:20])


def test_step_uniforms_are_the_per_step_draws():
    """The loop's precomputed [B, T] uniforms are, column by column, the draws
    sample_logits makes from step_keys(row_keys, t): same bits."""
    keys = row_keys(jax.random.key(4), jnp.arange(5) + 10)
    table = np.asarray(jax.jit(step_uniforms)(keys, jnp.arange(7, dtype=jnp.int32)))
    assert table.shape == (5, 7)
    for t in range(7):
        np.testing.assert_array_equal(table[:, t], np.asarray(uniforms(step_keys(keys, t))))


@pytest.mark.parametrize("V", [1, 2, 5, 64, 1000, 151936])
def test_inverse_cdf_matches_float64_cumsum(V):
    """Against the one-level inverse CDF in float64: the same index except where the
    target lies within float32 rounding of a boundary; never a zero-weight index,
    with most of the vocabulary (and whole blocks) at weight zero."""
    rng = np.random.default_rng(V)
    B = 64
    w = rng.random((B, V)).astype(np.float32) ** 4
    w[rng.random((B, V)) < 0.7] = 0.0
    w[:, rng.integers(0, V)] = 1.0  # a positive total in every row
    if V >= 1000:
        w[:, : V // 2] = 0.0  # whole blocks of zeros before the mass
        w[:, 0] = 1e-3
    u = rng.random(B).astype(np.float32)
    got = np.asarray(jax.jit(inverse_cdf)(jnp.asarray(w), jnp.asarray(u)))
    cdf = np.cumsum(w.astype(np.float64), axis=-1)
    target = (1.0 - u.astype(np.float64)) * cdf[:, -1]
    want = (cdf < target[:, None]).sum(-1)
    assert (w[np.arange(B), got] > 0).all()
    close = np.abs(cdf[np.arange(B), np.minimum(got, want)] - target) <= 1e-5 * cdf[:, -1]
    assert ((got == want) | close).all(), (got, want)


def test_inverse_cdf_hand_cases():
    """Weights [0, 1, 0, 3]: (1 - u) x 4 falls in (0, 1] -> 1, in (1, 4] -> 3."""
    w = jnp.asarray([[0.0, 1.0, 0.0, 3.0]] * 4)
    u = jnp.asarray([0.0, 0.74, 0.76, 0.999])  # targets 4, 1.04, 0.96, 0.004
    np.testing.assert_array_equal(np.asarray(inverse_cdf(w, u)), [3, 3, 1, 1])
