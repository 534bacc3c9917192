"""Hostile programs are normal input for the code verifier: a representative part of
benchmarks/code_hostile.py (the benchmark runs all of it) through `rewards.get("code")`
as the trainer calls it. Every program scores 0 within its time limit, nothing leaks
out (no marker file, no connection, no signal to this process), and the pool still
answers afterwards."""

import os
import socket
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rl_jax import rewards
from rl_jax.rewards import _code_jail

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from code_hostile import ANSWER, EXPECT, Context, corpus  # noqa: E402

pytestmark = pytest.mark.skipif(not _code_jail.layers()["rlimits"], reason="POSIX only")

TIMEOUT_S = 1.0
# From a call's deadline to its worker having killed and reaped the program's group and
# deleted its directory, on a loaded 2-core machine (the goal: p99 under limit + 1 s).
KILL_SLACK_S = 1.0


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    yield s
    s.close()


@pytest.fixture
def ctx(tmp_path, listener):
    (tmp_path / "markers").mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text(f"{EXPECT}\n")
    return Context(str(tmp_path / "markers"), str(secret), listener.getsockname()[1], os.getpid())


def _accepted(listener) -> int:
    n = 0
    while True:
        try:
            listener.accept()[0].close()
        except BlockingIOError:
            return n
        n += 1


def test_hostile_programs_score_zero_within_the_limit(ctx, tmp_path):
    progs = corpus(ctx)
    families = Counter(f for f, _ in progs)
    assert len(progs) >= 50 and len(families) == 6, families
    fn = rewards.get("code", scale="01", timeout_s=TIMEOUT_S, workers=2)
    assert fn(f"def f(n):\n    return {EXPECT}", ANSWER) == 1.0  # the honest answer passes
    out = fn.batch([p for _, p in progs], [ANSWER] * len(progs))
    escaped = [
        (f, p[:80], o) for (f, p), r, o in zip(progs, out, fn.last_outcomes, strict=True) if r > 0
    ]
    assert not escaped
    assert "error" not in fn.last_outcomes  # no sandbox worker was lost
    assert max(fn.pool.last_elapsed) < TIMEOUT_S + KILL_SLACK_S, max(fn.pool.last_elapsed)
    assert {"refused", "timeout"} <= set(fn.last_outcomes)
    assert not list((tmp_path / "markers").iterdir())
    assert not os.path.exists("/tmp/rl_jax_hostile_marker")
    # the pool still verifies, with the same workers
    assert fn.batch([f"def f(n):\n    return {EXPECT}"] * 2, [ANSWER] * 2).tolist() == [1.0, 1.0]
    assert np.all(out == 0.0)


def test_no_connection_reached_the_listener(ctx, listener):
    progs = [p for f, p in corpus(ctx, full=True) if f == "network"]
    fn = rewards.get("code", scale="01", timeout_s=TIMEOUT_S, workers=2)
    assert fn.batch(progs, [ANSWER] * len(progs)).tolist() == [0.0] * len(progs)
    assert _accepted(listener) == 0
    socket.create_connection(("127.0.0.1", ctx.port)).close()  # the listener does listen
    assert _accepted(listener) == 1
