"""Verifiers on known right and wrong answers; scales, batching, shaping, registry."""

import numpy as np
import pytest

from rl_jax import rewards
from rl_jax.config import ConfigError, RewardConfig
from rl_jax.rewards import _math, evaluate_expression, parse_number

needs_math = pytest.mark.skipif(not _math.available(), reason="math-verify not installed")


def test_registry_lists_known_names_on_unknown():
    assert {"arith", "countdown", "numeric", "math", "gym"} <= set(rewards.names())
    with pytest.raises(KeyError, match="known rewards: .*'arith'"):
        rewards.get("arithmetic")


@pytest.mark.parametrize(
    "completion, answer, right",
    [
        ("64", "64", True),  # 46 written least-significant digit first
        ("64;", "64", True),  # the answer ends at the first non-answer character
        (" 64\n12", "64", True),
        ("-22", "-22", True),
        ("640", "64", False),
        ("46", "64", False),
        ("064", "64", False),  # canonical strings: leading zeros are wrong
        ("6 4", "64", False),
        ("", "64", False),
        ("answer: 64", "64", False),  # the CPU task answers first, no preamble
    ],
)
def test_arith(completion, answer, right):
    fn = rewards.get("arith", scale="01")
    assert fn(completion, answer) == (1.0 if right else 0.0)


@pytest.mark.parametrize(
    "completion, right",
    [
        ("(25-7)*3-8", True),
        ("(25 - 7) * 3 - 8 = 46", True),
        ("3*(25-7)-8;", True),
        ("8-(7-25)*3", False),  # = 62
        ("I think <answer>3*(25-7)-8</answer>", True),
        ("25*3-7-8-14", False),  # 14 is not given
        ("(25-7)*3", False),  # 8 unused: each number exactly once
        ("(25-7)*3-8-8", False),  # 8 used twice
        ("(25-7)*3+8", False),  # wrong value
        ("25/(7-7)*3-8", False),  # division by zero, numbers wrong too
        ("-8+(25-7)*3", False),  # no unary minus
        ("(25-7)*3-8)", False),  # unbalanced
        ("46", False),
        ("", False),
    ],
)
def test_countdown(completion, right):
    fn = rewards.get("countdown", scale="pm1")
    assert fn(completion, "3,7,8,25=46") == (1.0 if right else -1.0)


def test_countdown_exact_fractions_and_grammar():
    assert evaluate_expression("(7/3)*3") == 7  # exact, not float
    assert rewards.get("countdown", scale="01")("(8/3)*3+7", "3,3,7,8=15") == 1.0
    with pytest.raises(ValueError):
        evaluate_expression("2**3")
    with pytest.raises(ValueError):
        evaluate_expression("__import__('os')")
    with pytest.raises(ValueError, match="not of the form"):
        rewards.parse_countdown_answer("46")


@pytest.mark.parametrize(
    "completion, answer, right",
    [
        ("Janet has 3 + 4 = 7 eggs.\n#### 7", "7", True),
        ("so the total is 1,000 dollars", "1000", True),
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
        ("\\boxed{72 \\text{ dollars}}", "72", True),
        ("the final answer is -3.50", "-3.5", True),
        ("It is 3/4 of it.", "0.75", True),
        ("#### 8 and later 7", "7", False),  # #### wins over a later number
        ("\\boxed{7} ... 8", "8", False),  # \boxed wins over a later number
        ("answer: 71", "7", False),
        ("no number", "7", False),
        ("1e3", "1000", False),  # no exponents: no huge numbers can be built
        ("1e3", "3", False),  # nor a part of one read as a number
        ("the answer is 2.5e-3", "2.5", False),
        ("the answer is 1E5", "1", False),
        ("the answer is \u06612", "2", False),  # no part of another script's digits either
        ("\\boxed{x = 7}", "7", True),  # a \boxed{} with an equation: its value
        ("\\boxed{72 dollars}", "72", True),  # or its one number among words
        ("\\boxed{7 \\mathrm{cm}}", "7", True),
        ("\\boxed{\\textbf{12}}", "12", True),
        ("\\boxed{72^\\circ}", "72", True),  # degrees and a unit's power are units
        ("\\boxed{72^{\\circ}}", "72", True),
        ("\\boxed{12 \\text{ cm}^2}", "12", True),
        ("\\boxed{\\sqrt{2}^2}", "2", False),
        ("\\boxed{2^{10}}", "10", False),  # other math: no part of it is the answer
        ("\\boxed{\\sqrt{2}}", "2", False),
        ("\\boxed{3 \\times 4}", "4", False),
        ("\\boxed{\\frac{1.5}{2}}", "2", False),
        ("\\boxed{1{,}000}", "1000", True),  # LaTeX's thousands separator
        ("\\boxed{1{,}000}", "0", False),
        ("The answer is $1{,}000$.", "1", False),
        ("The answer is $12{,}345.5$.", "12345.5", True),
        ("the answer is \u22125", "5", False),  # U+2212 MINUS SIGN: minus five
        ("\\boxed{\u22125}", "5", False),
        ("the answer is \u22125", "-5", True),
        ("\\boxed{\u2212\\frac{1}{2}}", "-0.5", True),
    ],
)
def test_numeric(completion, answer, right):
    fn = rewards.get("numeric", scale="01")
    assert fn(completion, answer) == (1.0 if right else 0.0)


def test_parse_number_bounds():
    assert parse_number("-1,234.5") == pytest.approx(-1234.5)
    assert parse_number("\\frac{3}{4}") == pytest.approx(0.75)
    assert parse_number("9" * 49) is None  # longer than MAX_NUMBER_CHARS
    assert parse_number("1/0") is None
    assert parse_number("١٢٣") is None  # only ASCII digits


@needs_math
def test_math_verify_right_and_wrong():
    fn = rewards.get("math", scale="01", timeout_s=5.0, workers=2)
    right = [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("We get \\boxed{x^2 + 2x + 1}", "(x+1)^2"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("The answer is \\boxed{72}.", "72"),
    ]
    wrong = [
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("\\boxed{x^2+1}", "(x+1)^2"),
        ("no answer here", "72"),
        ("\\boxed{71}", "72"),
    ]
    got = fn.batch([c for c, _ in right + wrong], [a for _, a in right + wrong])
    np.testing.assert_array_equal(got, [1.0] * len(right) + [0.0] * len(wrong))
    assert fn.well_formed("\\boxed{3}") and not fn.well_formed("3")


def test_scales_and_score_batch():
    for scale, (hi, lo) in rewards.SCALES.items():
        fn = rewards.get("arith", scale=scale)
        out = rewards.score_batch(fn, ["64", "65", "x"], ["64", "64", "64"])
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, [hi, lo, lo])
    with pytest.raises(ValueError, match="scale"):
        rewards.get("arith", scale="pm2")


def test_score_batch_plain_callable_never_raises():
    def flaky(c, a):
        if c == "boom":
            raise RuntimeError("verifier bug")
        return 1.0 if c == a else 0.0

    np.testing.assert_array_equal(
        rewards.score_batch(flaky, ["1", "boom", "2"], ["1", "1", "1"]), [1.0, 0.0, 0.0]
    )
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        rewards.score_batch(flaky, ["1", "2"], ["1"])


def test_overlong_penalty_matches_dapo():
    # L_max 14, L_cache 2: no penalty up to 12 tokens, linear to -1 at 14, -1 beyond.
    got = rewards.overlong_penalty([0, 12, 13, 14, 20], l_max=14, l_cache=2)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0], atol=1e-6)
    with pytest.raises(ValueError):
        rewards.overlong_penalty([1], l_max=2, l_cache=2)


def test_shape_rewards_format_and_overlong():
    fn = rewards.get("arith", scale="pm1")
    comps, answers = ["64", "x", "65"], ["64", "64", "64"]
    base = rewards.score_batch(fn, comps, answers)
    cfg = RewardConfig(format_coef=0.1, overlong_penalty=True, overlong_max=10, overlong_cache=4)
    got = rewards.shape_rewards(base, cfg=cfg, reward_fn=fn, completions=comps, lengths=[3, 8, 12])
    np.testing.assert_allclose(got, [1.1, -1.0 - 0.5, -1.0 + 0.1 - 1.0], atol=1e-6)
    with pytest.raises(ValueError, match="lengths"):
        rewards.shape_rewards(base, cfg=cfg, reward_fn=fn, completions=comps)


def test_reward_config_validation_and_from_config():
    with pytest.raises(ConfigError, match="rewards.overlong_cache"):
        RewardConfig(overlong_penalty=True, overlong_max=10, overlong_cache=10)
    with pytest.raises(ConfigError, match="rewards.scale"):
        RewardConfig(scale="+-1")
    fn = rewards.from_config(RewardConfig(name="auto", scale="01"), task_reward="countdown")
    assert fn.name == "countdown" and fn.scale == "01"
    with pytest.raises(ValueError, match="auto"):
        rewards.from_config(RewardConfig(name="auto"))


def test_sandbox_kills_stuck_worker_and_recovers():
    pool = rewards.SandboxPool(workers=1)
    try:
        (pid,) = pool.run("rl_jax.rewards._sandbox:_pid", [()], timeout_s=30)
        import time

        t = time.monotonic()
        out = pool.run("rl_jax.rewards._sandbox:_sleep", [(30.0,)], timeout_s=0.3)
        assert out == [None] and time.monotonic() - t < 5
        assert pool.timeouts == 1
        (pid2,) = pool.run("rl_jax.rewards._sandbox:_pid", [()], timeout_s=30)
        assert pid2 != pid  # a fresh worker replaced the killed one
        assert pool.run("rl_jax.rewards._sandbox:_sleep", [(0.01,)] * 3, timeout_s=30) == [0.01] * 3
        # a target that raises is no result, not an exception here
        assert pool.run("rl_jax.rewards._sandbox:_sleep", [("x",)], timeout_s=30) == [None]
        assert pool.errors == 1
        # even the zygote dying (say, the OOM killer) only costs a restart
        pool._zygote[0].proc.kill()
        assert pool.run("rl_jax.rewards._sandbox:_sleep", [(30.0,)], timeout_s=0.3) == [None]
        assert pool.run("rl_jax.rewards._sandbox:_sleep", [(0.01,)], timeout_s=30) == [0.01]
    finally:
        pool.close()


def test_sandbox_takes_any_finite_time_limit():
    # A limit longer than one poll can wait (2**31 - 1 ms, about 25 days) is waited out in
    # several waits, not an OverflowError into the training loop.
    pool = rewards.SandboxPool(workers=1)
    try:
        assert pool.run("rl_jax.rewards._sandbox:_sleep", [(0.01,)], timeout_s=1e7) == [0.01]
    finally:
        pool.close()
