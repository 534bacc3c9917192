"""The driver's record of a grid: attempts and outcomes per run id (atomic JSON).

A run is finished iff its DONE file exists; the state file only says how often
a run was launched, how often it failed (for the retry limit), and why a run
was stopped early. Losing the state file loses retry counts, never results.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.runs.atomic import atomic_write_json

STATE_FILE = "state.json"
DRIVER_LOCK = "driver.lock"


@dataclass
class RunRecord:
    name: str
    launches: int = 0
    failures: int = 0
    status: str = "pending"  # pending | running | done | failed | stopped
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped: dict[str, Any] | None = None  # early-stop decision, if any

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "launches": self.launches,
            "failures": self.failures,
            "status": self.status,
            "history": self.history,
            "stopped": self.stopped,
        }


class GridState:
    def __init__(self, grid_dir: Path, grid: str, runs: dict[str, RunRecord]):
        self.grid_dir = Path(grid_dir)
        self.grid = grid
        self.runs = runs

    @property
    def path(self) -> Path:
        return self.grid_dir / STATE_FILE

    @classmethod
    def load(cls, grid_dir: Path, grid: str) -> GridState:
        path = Path(grid_dir) / STATE_FILE
        runs: dict[str, RunRecord] = {}
        if path.exists():
            d = json.loads(path.read_text(encoding="utf-8"))
            for rid, r in d.get("runs", {}).items():
                runs[rid] = RunRecord(**r)
        return cls(Path(grid_dir), grid, runs)

    def record(self, run_id: str, name: str) -> RunRecord:
        if run_id not in self.runs:
            self.runs[run_id] = RunRecord(name=name)
        return self.runs[run_id]

    def save(self) -> None:
        atomic_write_json(
            self.path,
            {
                "grid": self.grid,
                "updated": time.time(),
                "runs": {k: v.to_json() for k, v in sorted(self.runs.items())},
            },
        )


class DriverLock:
    """One driver per grid directory; a second one exits with a clear message."""

    def __init__(self, grid_dir: Path):
        self.path = Path(grid_dir) / DRIVER_LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(
                f"another grid driver (pid {other}) is running {self.path.parent}; "
                "wait for it or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
