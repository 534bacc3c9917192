"""The process that owns one attempt of one run: `python -m rl_jax.grid._guard`.

It takes an exclusive lock on the run directory for as long as the run's
processes live, so a restarted driver can tell a run still going (from a
driver that was killed) from one that stopped, and never starts a second copy.
The lock file descriptor is passed to the trainer as well: the lock holds while
either process lives. A run with a DONE file is never started.

    python -m rl_jax.grid._guard --run-dir DIR --attempt K -- CMD ...

Exit status: the command's, BUSY if another process holds the run, 0 if DONE.
The outcome is also written to DIR/.grid/attempt-K.json for drivers that did
not start this process.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rl_jax.runs.atomic import atomic_write_json

BUSY = 75  # EX_TEMPFAIL: another process is running this run; not a failure
GUARD_DIR = ".grid"


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / GUARD_DIR / "lock"


def attempt_path(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / GUARD_DIR / f"attempt-{attempt}.json"


def is_locked(run_dir: Path) -> bool:
    """True while some process (a guard or its trainer) holds the run's lock."""
    path = lock_path(run_dir)
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_jax.grid._guard")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--attempt", required=True, type=int)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command after --")
    run_dir: Path = a.run_dir
    lp = lock_path(run_dir)
    lp.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        return _run_locked(fd, run_dir, a.attempt, cmd)
    finally:
        os.close(fd)  # the trainer keeps its own copy while it lives


def _run_locked(fd: int, run_dir: Path, attempt: int, cmd: list[str]) -> int:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"[grid] {run_dir} is being run by another process; not starting", flush=True)
        return BUSY
    record = {"attempt": attempt, "pid": os.getpid(), "start": time.time(), "cmd": cmd}
    if (run_dir / "DONE").exists():
        atomic_write_json(attempt_path(run_dir, attempt), {**record, "rc": 0, "skipped": "DONE"})
        print(f"[grid] {run_dir} is finished (DONE); not starting", flush=True)
        return 0
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
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
    try:
        proc = subprocess.Popen(cmd, pass_fds=(fd,))
        if stops and proc.poll() is None:
            proc.send_signal(stops[0])
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if rc < 0:
        rc = 128 - rc  # killed by a signal: the shell's convention
    atomic_write_json(attempt_path(run_dir, attempt), {**record, "rc": rc, "end": time.time()})
    return rc


if __name__ == "__main__":
    sys.exit(main())
