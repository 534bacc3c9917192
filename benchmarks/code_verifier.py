"""The code verifier under attack and under load: one JSON line.

    python benchmarks/code_verifier.py                 # the full hostile corpus + throughput
    python benchmarks/code_verifier.py --smoke         # a few of each (tests)

hostile: every program of benchmarks/code_hostile.py (over 200: file reads and writes
outside the sandbox, processes, signals, sockets, loops, bombs, memory, output, exits,
spoofed verdicts, harness patching) through `rl_jax.rewards.get("code")`, as the trainer
calls it (a batch over the sandbox pool). Reported: calls, outcomes, worst and p99
latency against the time limit, escapes (a reward above 0, a marker file outside the
sandbox, a connection to the listener, a sandbox worker lost), and that this process
(the trainer's stand-in) is still alive to report.

throughput: correct programs with 4 assert tests each, and as many wrong ones, verified
on `--workers` workers (default 2): programs per second.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from code_hostile import ANSWER, EXPECT, Context, corpus  # noqa: E402

from rl_jax import rewards  # noqa: E402
from rl_jax.rewards import _code_jail  # noqa: E402


def hostile(*, full: bool, timeout_s: float, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        marker_dir = Path(d) / "markers"
        marker_dir.mkdir()
        secret = Path(d) / "secret.txt"
        secret.write_text(f"{EXPECT}\n")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        ctx = Context(str(marker_dir), str(secret), listener.getsockname()[1], os.getpid())
        progs = corpus(ctx, full=full)
        fn = rewards.get("code", scale="01", timeout_s=timeout_s, workers=workers)
        fn(f"def f(n):\n    return {EXPECT}", ANSWER)  # the pool starts outside the timing
        t0 = time.perf_counter()
        scores = fn.batch([p for _, p in progs], [ANSWER] * len(progs))
        wall = time.perf_counter() - t0
        elapsed = np.asarray(fn.pool.last_elapsed)
        outcomes = list(fn.last_outcomes)
        connections = 0
        while True:
            try:
                listener.accept()[0].close()
                connections += 1
            except BlockingIOError:
                break
        listener.close()
        markers = sorted(p.name for p in marker_dir.iterdir())
        stray = Path("/tmp/rl_jax_hostile_marker").exists()
        escaped = [
            {"family": fam, "program": p[:200], "outcome": o}
            for (fam, p), r, o in zip(progs, scores, outcomes, strict=True)
            if r > 0 or o == "error"
        ]
        fn.close()
    return {
        "calls": len(progs),
        "families": dict(Counter(f for f, _ in progs)),
        "outcomes": dict(Counter(outcomes)),
        "time_limit_s": timeout_s,
        "latency_worst_s": round(float(elapsed.max()), 3),
        "latency_p99_s": round(float(np.percentile(elapsed, 99)), 3),
        "latency_p50_s": round(float(np.percentile(elapsed, 50)), 3),
        "p99_within_limit_plus_1s": bool(np.percentile(elapsed, 99) < timeout_s + 1.0),
        "wall_s": round(wall, 2),
        "escapes": len(escaped) + len(markers) + connections + int(stray),
        "escaped": escaped,
        "markers": markers,
        "connections": connections,
        "trainer_alive": True,  # this line runs in the process the programs tried to kill
    }


def _program(k: int, correct: bool) -> str:
    body = "s = 0\n    for c in str(abs(n)):\n        s += int(c)\n    return s + K"
    body = body.replace("K", str(k if correct else k + 1))
    return f"```python\ndef digit_sum_plus(n):\n    {body}\n```"


def _answer(k: int) -> str:
    cases = [(123, 6), (9, 9), (0, 0), (4056, 15)]
    tests = [f"assert digit_sum_plus({n}) == {v + k}" for n, v in cases]
    return json.dumps({"entry_point": "digit_sum_plus", "tests": tests})


def throughput(*, programs: int, workers: int, timeout_s: float) -> dict:
    fn = rewards.get("code", scale="01", timeout_s=timeout_s, workers=workers)
    fn(_program(0, True), _answer(0))  # the pool starts outside the timing
    comps = [_program(i % 7, i % 2 == 0) for i in range(programs)]
    answers = [_answer(i % 7) for i in range(programs)]
    t0 = time.perf_counter()
    scores = fn.batch(comps, answers)
    wall = time.perf_counter() - t0
    expected = np.asarray([i % 2 == 0 for i in range(programs)], np.float32)
    fn.close()
    return {
        "programs": programs,
        "tests_per_program": 4,
        "workers": workers,
        "wall_s": round(wall, 3),
        "programs_per_s": round(programs / wall, 1),
        "verdicts_right": bool((scores == expected).all()),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few programs (tests)")
    p.add_argument("--timeout", type=float, default=2.0, help="rewards.timeout_s")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--programs", type=int, default=400, help="throughput programs")
    p.add_argument("--skip-hostile", action="store_true")
    a = p.parse_args(argv)
    out = {
        "benchmark": "code_verifier",
        "layers": _code_jail.layers(),
        "landlock_abi": _code_jail.landlock_abi(),
    }
    if not a.skip_hostile:
        out["hostile"] = hostile(full=not a.smoke, timeout_s=a.timeout, workers=a.workers)
    out["throughput"] = throughput(
        programs=16 if a.smoke else a.programs, workers=a.workers, timeout_s=a.timeout
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
