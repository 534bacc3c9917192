"""Worker processes that run untrusted-input scorers under a hard per-call time limit.

math-verify (sympy) and third-party scorers can spin for minutes or eat memory
on adversarial input, and their own `signal.alarm` timeouts do not work off the
main thread. So each call runs in a worker process; the parent waits at most
`timeout_s` per call, then SIGKILLs that worker and gets a fresh one.

Workers are forked by a *zygote*: a fresh interpreter (`python -m
rl_jax.rewards._sandbox`) that imports the verifier's packages once and then
forks a worker per request, handing the parent its socket over a Unix socket.
Forking the zygote is safe (it is single-threaded, unlike a trainer running
JAX threads), a replacement worker costs milliseconds instead of re-importing
sympy, and nothing re-runs the user's `__main__` script (which multiprocessing's
spawn and forkserver do, breaking unguarded scripts). Each worker caps its
address space so a runaway allocation fails inside it instead of swapping the
host.

A call that times out, raises, or whose worker dies yields `None`: the caller
turns that into no credit. Nothing here ever raises into the training loop
except a zygote that cannot start at all (a broken install).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

START_TIMEOUT_S = 120.0
# Longest single wait for a worker (poll takes at most 2**31 - 1 ms); a longer time limit
# is waited out in several.
MAX_WAIT_S = 3600.0
# Address space a worker may add to its size at start (the code verifier asks more where
# its programs' own limit is larger: they are forked from the worker, under its hard limit).
WORKER_MEMORY_MB = 2048


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(conn: Connection, mem_limit_bytes: int) -> None:
    if mem_limit_bytes > 0:
        try:
            import resource

            limit = _vm_bytes() + mem_limit_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass
    conn.send(("ready", None))
    fns: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, target, args = msg
        try:
            fn = fns.get(target)
            if fn is None:
                fn = fns[target] = _resolve(target)
            result: tuple[str, Any] = ("ok", fn(*args))
        except BaseException as e:  # MemoryError, RecursionError, anything a scorer throws
            result = ("err", f"{type(e).__name__}: {str(e)[:200]}")
        try:
            conn.send((task_id, result))
        except Exception as e:  # an unpicklable result
            conn.send((task_id, ("err", f"result not sendable: {type(e).__name__}")))


def _zygote_main(control_fd: int, mem_limit_bytes: int, preload: list[str]) -> None:
    """Import `preload`, then fork one worker per request byte on the control socket."""
    # Ctrl-C reaches the whole process group; the parent decides, by closing the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    for m in preload:
        try:
            importlib.import_module(m)
        except Exception as e:  # reported when a call needs the module
            print(f"rl_jax sandbox: cannot import {m}: {e}", file=sys.stderr)
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            req = control.recv(1)
        except OSError:
            return
        if not req:  # the parent has gone
            return
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            control.close()
            theirs.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _worker_main(Connection(mine.detach()), mem_limit_bytes)
            finally:
                os._exit(0)
        mine.close()
        socket.send_fds(control, [str(pid).encode()], [theirs.fileno()])
        theirs.close()


_ZYGOTE_CMD = (
    "import sys; from rl_jax.rewards._sandbox import _zygote_main; "
    "_zygote_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])"
)


class _Zygote:
    def __init__(self, preload: tuple[str, ...], mem_limit_bytes: int):
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_CMD, str(child.fileno()), str(mem_limit_bytes),
             *preload],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
        child.close()
        self.control = parent

    def fork(self) -> tuple[int, Connection]:
        self.control.settimeout(START_TIMEOUT_S)
        try:
            self.control.sendall(b"F")
            msg, fds, _, _ = socket.recv_fds(self.control, 32, 1)
        except (OSError, TimeoutError) as e:
            raise RuntimeError(f"sandbox zygote did not answer: {e}") from None
        if not fds:
            raise RuntimeError(
                f"sandbox zygote exited (code {self.proc.poll()}); check that the verifier's "
                "packages import"
            )
        return int(msg), Connection(fds[0])

    def close(self) -> None:
        self.control.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@dataclass
class _Slot:
    pid: int
    conn: Connection
    state: str  # "starting" | "idle" | "busy"
    since: float
    task: int = -1
    deadline: float = 0.0


class SandboxPool:
    """`workers` processes running `module:function` targets with a per-call time limit."""

    def __init__(
        self, *, workers: int, preload: tuple[str, ...] = (), mem_limit_mb: int = WORKER_MEMORY_MB
    ):
        if workers < 1:
            raise ValueError(f"SandboxPool needs workers >= 1, got {workers}")
        self._preload = tuple(preload)
        self._lock = threading.Lock()
        self._mem = mem_limit_mb * 2**20
        self._zygote = [_Zygote(self._preload, self._mem)]  # a cell: the finalizer sees swaps
        self._slots = [self._spawn() for _ in range(workers)]
        self.timeouts = 0  # calls killed at their time limit, cumulative
        self.errors = 0  # calls that raised or whose worker died, cumulative
        self.last_elapsed: list[float] = []
        weakref.finalize(self, SandboxPool._shutdown, self._slots, self._zygote)

    def _spawn(self) -> _Slot:
        try:
            pid, conn = self._zygote[0].fork()
        except RuntimeError:
            # The zygote itself died (e.g. the OOM killer): start a new one, once.
            self._zygote[0].close()
            self._zygote[0] = _Zygote(self._preload, self._mem)
            pid, conn = self._zygote[0].fork()
        return _Slot(pid=pid, conn=conn, state="starting", since=time.monotonic())

    def _replace(self, i: int) -> None:
        old = self._slots[i]
        try:
            os.kill(old.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        old.conn.close()
        self._slots[i] = self._spawn()

    def run(self, target: str, arg_list: list[tuple], *, timeout_s: float) -> list[Any]:
        """`target(*args)` for each args; the result, or None on timeout, error or crash."""
        with self._lock:
            return self._run(target, arg_list, timeout_s)

    def _run(self, target: str, arg_list: list[tuple], timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * len(arg_list)
        elapsed = [0.0] * len(arg_list)
        self.last_elapsed = elapsed  # per call: dispatch to result or kill (tests, metrics)
        pending = deque(range(len(arg_list)))
        while True:
            now = time.monotonic()
            for s in self._slots:
                if s.state == "idle" and pending:
                    s.task = pending.popleft()
                    s.conn.send((s.task, target, arg_list[s.task]))
                    s.state, s.since, s.deadline = "busy", now, now + timeout_s
            active = [s for s in self._slots if s.state != "idle"]
            if not pending and not any(s.state == "busy" for s in active):
                return results
            limits = [
                s.deadline if s.state == "busy" else s.since + START_TIMEOUT_S for s in active
            ]
            left = min(max(0.0, min(limits) - now), MAX_WAIT_S)
            ready = wait([s.conn for s in active], timeout=left)
            for conn in ready:
                i = next(k for k, s in enumerate(self._slots) if s.conn is conn)
                s = self._slots[i]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if s.state == "starting":
                        raise RuntimeError(
                            f"sandbox worker {s.pid} exited while starting (preload "
                            f"{self._preload}); check that the verifier's packages import"
                        ) from None
                    self.errors += 1
                    elapsed[s.task] = time.monotonic() - s.since
                    self._replace(i)
                    continue
                if s.state == "starting":
                    s.state = "idle"
                elif msg[0] == s.task:
                    elapsed[s.task] = time.monotonic() - s.since
                    status, value = msg[1]
                    if status == "ok":
                        results[s.task] = value
                    else:
                        self.errors += 1
                    s.state = "idle"
            now = time.monotonic()
            for i, s in enumerate(self._slots):
                if s.state == "busy" and now >= s.deadline:
                    self.timeouts += 1
                    elapsed[s.task] = now - s.since
                    self._replace(i)
                elif s.state == "starting" and now >= s.since + START_TIMEOUT_S:
                    raise RuntimeError(
                        f"sandbox worker did not start within {START_TIMEOUT_S:.0f} s "
                        f"(preload {self._preload})"
                    )

    def close(self) -> None:
        with self._lock:
            SandboxPool._shutdown(self._slots, self._zygote)

    @staticmethod
    def _shutdown(slots: list[_Slot], zygote: list[_Zygote]) -> None:
        for s in slots:
            try:
                if s.state == "busy":  # stuck in a call: it would never read the request
                    os.kill(s.pid, signal.SIGKILL)
                else:
                    s.conn.send(None)
            except (OSError, ValueError):
                pass
            s.conn.close()
        slots.clear()
        zygote[0].close()


_POOLS: dict[tuple[int, tuple[str, ...], int], SandboxPool] = {}


def shared_pool(
    *, workers: int, preload: tuple[str, ...], mem_limit_mb: int = WORKER_MEMORY_MB
) -> SandboxPool:
    """One pool per (workers, preload, memory limit) per process, so repeated `rewards.get`
    calls share it."""
    key = (workers, preload, mem_limit_mb)
    pool = _POOLS.get(key)
    if pool is None or not pool._slots:
        pool = _POOLS[key] = SandboxPool(
            workers=workers, preload=preload, mem_limit_mb=mem_limit_mb
        )
    return pool


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


def _pid() -> int:
    """A trivial target (tests: which worker ran a call)."""
    return os.getpid()


def _sleep(seconds: float) -> float:
    """A target that overruns its limit (tests: stuck workers are killed and replaced)."""
    time.sleep(seconds)
    return seconds
