"""The process that owns one attempt of one run: `python -m rl_jax.grid._guard`.

It takes the run directory's guard lock (`<run>/.grid/lock`) for as long as the run's
processes live, so a restarted driver can tell a run still going (from a driver that
was killed) from one that stopped, and never starts a second copy. On a local disk the
lock is an flock whose descriptor the trainer inherits: the lock holds while either
process lives. In a bucket it is a lease the guard renews while the trainer lives; the
trainer's own run lock (`<run>/.lock`) covers a trainer that outlives its guard, so a
run counts as going while either lock is held (`is_locked`). A run with a DONE file is
never started.

    python -m rl_jax.grid._guard --run-dir DIR_OR_URL --attempt K -- CMD ...

Exit status: the command's, BUSY if another process holds the run, 0 if DONE.
The outcome is also written to DIR/.grid/attempt-K.json for drivers that did
not start this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from rl_jax.runs import locks
from rl_jax.runs.storage import open_store

BUSY = 75  # EX_TEMPFAIL: another process is running this run; not a failure
GUARD_DIR = ".grid"
GUARD_LOCK = f"{GUARD_DIR}/lock"
RUN_LOCK = ".lock"  # the trainer's (rl_jax.runs.run_dir.LOCK)


def attempt_name(attempt: int) -> str:
    return f"{GUARD_DIR}/attempt-{attempt}.json"


def holder(run_dir: str) -> dict[str, Any] | None:
    """Who runs `run_dir` now (its guard, or a trainer that outlived it), else None."""
    return locks.holder(run_dir, GUARD_LOCK) or locks.holder(run_dir, RUN_LOCK)


def is_locked(run_dir: str) -> bool:
    """True while some process (a guard or its trainer) holds the run."""
    return holder(run_dir) is not None


def read_attempt(run_dir: str, attempt: int) -> dict[str, Any] | None:
    import json

    try:
        return json.loads(open_store(run_dir).read_bytes(attempt_name(attempt)))
    except (FileNotFoundError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_jax.grid._guard")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", required=True, type=int)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command after --")
    try:
        lock = locks.acquire(a.run_dir, GUARD_LOCK, what=f"run {a.run_dir}")
    except locks.LockBusy:
        print(f"[grid] {a.run_dir} is being run by another process; not starting", flush=True)
        return BUSY
    try:
        return _run_locked(lock, a.run_dir, a.attempt, cmd)
    finally:
        lock.release()  # a local trainer keeps its inherited descriptor while it lives


def _run_locked(lock, run_dir: str, attempt: int, cmd: list[str]) -> int:
    store = open_store(run_dir)
    record = {"attempt": attempt, "pid": os.getpid(), "start": time.time(), "cmd": cmd}
    if store.exists("DONE"):
        store.write_json(attempt_name(attempt), {**record, "rc": 0, "skipped": "DONE"})
        print(f"[grid] {run_dir} is finished (DONE); not starting", flush=True)
        return 0
    print(f"[grid] attempt {attempt}: {' '.join(cmd)}", flush=True)
    proc: subprocess.Popen | None = None
    stops: list[int] = []

    def forward(signum, _frame):
        # The trainer decides what a stop means (save and exit); we only pass it on.
        # A stop before the child exists is kept and passed on once it does.
        if proc is None:
            stops.append(signum)
        elif proc.poll() is None:
            proc.send_signal(signum)

    # Handlers go in before the child starts: a guard killed by a signal in between
    # would leave its child running with the lock descriptor, and the run locked.
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    fd = getattr(lock, "fd", None)
    try:
        proc = subprocess.Popen(cmd, pass_fds=(fd,) if fd is not None else ())
        if stops and proc.poll() is None:
            proc.send_signal(stops[0])
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if rc < 0:
        rc = 128 - rc  # killed by a signal: the shell's convention
    store.write_json(attempt_name(attempt), {**record, "rc": rc, "end": time.time()})
    return rc


if __name__ == "__main__":
    sys.exit(main())
