"""Hostile output is normal input: every verifier, >= 50 adversarial completions, each call
gives no credit, raises nothing, executes nothing and returns within its time limit."""

import time

import pytest

from rl_jax import rewards
from rl_jax.rewards import _gym, _math

TIMEOUT_S = 0.5
# Scheduling slack on a loaded 2-core machine (the pool kills at the deadline itself): from a
# call's deadline to the parent noticing it, and for a killed worker's replacement (a fork of
# the preloaded zygote, milliseconds when the machine is idle).
KILL_SLACK_S = 1.0
RESPAWN_SLACK_S = 2.0
PURE_LIMIT_S = 0.5  # arith / countdown / numeric: bounded by construction, ~1 ms


def hostile(marker: str) -> list:
    cmd = f"touch {marker}"
    big = 2**20
    out = [
        # numbers and powers that would take forever or exhaust memory if evaluated
        "9**9**9**9",
        "9^9^9^9",
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{10^{10^{10^{10}}}}",
        "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
        "\\boxed{100000000!}",
        "\\boxed{(1+x)^{1000000}}",
        "\\boxed{\\frac{" + "9" * 5000 + "}{7}}",
        "1" + "0" * 100_000,
        "1e99999999",
        "#### " + "9" * 10_000,
        "99999999999*99999999999",
        # nesting and size
        "(" * 10**6 + "1" + ")" * 10**6,
        "((((((((((1))))))))))" * 10_000,
        "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
        "\\boxed{" * 10_000,
        "x" * big,
        "1" * big,
        "1," * 200_000 + "x",
        "answer is " * 50_000,
        " " * 100_000 + "1",
        "\n" * 100_000,
        "<answer>" * 10_000,
        "<answer>" + "(" * 5000 + "</answer>",
        "1 + 1 = 2. " * 100_000,
        # broken encodings and non-text
        b"\xff\xfe\xfd\x80\x81",
        b"4\xff6",
        "\udcff\udcfe",
        "\x00" * 1000,
        "",
        None,
        12345,
        ["6", "4"],
        # code that must never run
        f"__import__('os').system('{cmd}')",
        f"\\boxed{{__import__('os').system('{cmd}')}}",
        f"eval(\"__import__('os').system('{cmd}')\")",
        f"exec(\"import os; os.system('{cmd}')\")",
        f"<answer>__import__('os').system('{cmd}')</answer>",
        f"$ {cmd} $",
        f"`{cmd}`",
        "os.system('rm -rf /')",
        "lambda: (yield)",
        "${jndi:ldap://example/a}",
        # LaTeX that makes parsers and sympy spin
        "\\boxed{\\int_0^\\infty e^{-x^{x^{x}}} dx}",
        "\\boxed{\\sum_{n=1}^{10^{100}} n^{n^{n}}}",
        "\\boxed{\\prod_{k=1}^{10^{9}} k}",
        "\\boxed{\\lim_{x\\to 0} \\sin(1/x)^{1/x}}",
        "\\boxed{\\sqrt{-1}^{\\sqrt{-1}^{99999}}}",
        "\\boxed{\\begin{pmatrix}" + "1&" * 2000 + "1\\end{pmatrix}^{1000}}",
        "\\boxed{\\frac{1}{0}}",
        "\\boxed{0/0}",
        "\\def\\x{\\x}\\x \\boxed{\\x}",
        "\\newcommand{\\a}{\\a\\a}\\a \\boxed{\\a}",
        "\\input{/etc/passwd} \\boxed{1}",
        "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(3000)) + "}",
        "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
        # countdown-shaped attacks
        "25/0*3-8-7",
        "3" * 1000,
        "(" * 17 + "25" + ")" * 17,
        "-" * 1000,
        "NaN",
        "inf",
        "١٢٣",  # non-ASCII digits
    ]
    assert len(out) >= 50
    return out


def _check(fn, answer, items, limit_s):
    slowest = 0.0
    for c in items:
        t = time.monotonic()
        r = fn(c, answer)
        dt = time.monotonic() - t
        slowest = max(slowest, dt)
        assert r == fn.low, (fn.name, repr(c)[:80], r)
        assert dt < limit_s, (fn.name, repr(c)[:80], dt)
    return slowest


@pytest.mark.parametrize(
    "name, answer",
    [("arith", "64"), ("countdown", "3,7,8,25=46"), ("numeric", "46")],
)
def test_pure_verifiers_survive_hostile_output(tmp_path, name, answer):
    marker = tmp_path / "executed"
    fn = rewards.get(name, scale="pm1")
    _check(fn, answer, hostile(str(marker)), PURE_LIMIT_S)
    # format rewards read the same hostile input
    for c in hostile(str(marker)):
        assert fn.well_formed(c) in (True, False)
    assert not marker.exists()


def _check_pooled(fn, answer, items):
    # Batched, as the trainer calls it: every call no credit, each within its limit (the pool
    # times each call from dispatch to result or kill).
    out = fn.batch(items, [answer] * len(items))
    credited = [repr(c)[:60] for c, r in zip(items, out, strict=True) if r != fn.low]
    assert not credited
    slowest = max(fn.pool.last_elapsed)
    assert slowest < fn.timeout_s + KILL_SLACK_S, slowest
    # One by one through the single-call API, the worst offenders included: a killed worker
    # is replaced in time for the next call.
    _check(fn, answer, items[:2] + items[-4:], fn.timeout_s + RESPAWN_SLACK_S)


@pytest.mark.skipif(not _math.available(), reason="math-verify not installed")
def test_math_verify_survives_hostile_output(tmp_path):
    marker = tmp_path / "executed"
    # The pool starts (workers spawn and import the verifier) under a limit that a loaded
    # machine cannot miss; the short limit then holds for calls to running workers.
    patient = rewards.get("math", scale="01", timeout_s=10.0, workers=2)
    assert patient("\\boxed{46}", "46") == 1.0
    fn = rewards.get("math", scale="01", timeout_s=TIMEOUT_S, workers=2)
    _check_pooled(fn, "46", hostile(str(marker)))
    assert fn.pool.timeouts > 0  # some inputs did spin and were cut off
    # and the pool still answers: the same shared pool, asked with a time limit that a
    # loaded CI machine (a respawned worker, another test process) cannot miss
    assert patient("\\boxed{46}", "46") == 1.0
    assert not marker.exists()


@pytest.mark.skipif(not _gym.available(), reason="reasoning-gym not installed")
def test_reasoning_gym_scorer_survives_hostile_output(tmp_path):
    import reasoning_gym

    marker = tmp_path / "executed"
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    answer = rewards.encode_gym_answer("basic_arithmetic", entry)
    patient = rewards.get("gym", scale="01", timeout_s=10.0, workers=2)  # starts the pool
    assert patient(f"<answer>{entry['answer']}</answer>", answer) == 1.0
    fn = rewards.get("gym", scale="01", timeout_s=TIMEOUT_S, workers=2)
    _check_pooled(fn, answer, hostile(str(marker)))
    assert not marker.exists()
