"""The driver's record of a grid: attempts and outcomes per run id (atomic JSON).

A run is finished iff its DONE file exists; the state file only says how often
a run was launched, how often it failed (for the retry limit), and why a run
was stopped early. Losing the state file loses retry counts, never results.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rl_jax.knobs import ConfigError
from rl_jax.runs import locks
from rl_jax.runs.storage import join, open_store

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


@dataclass
class GridState:
    grid_dir: str
    grid: str
    runs: dict[str, RunRecord]

    @classmethod
    def load(cls, grid_dir: str, grid: str, plans: Sequence[Any] = ()) -> GridState:
        """The state file's records; `plans` (RunPlans): a record kept under another id of a
        plan's run directory (a grid run under an earlier run-id version) is that plan's. A
        damaged state file is a ConfigError naming it."""
        try:
            d = json.loads(open_store(grid_dir).read_bytes(STATE_FILE).decode("utf-8"))
        except FileNotFoundError:
            d = {}
        except ValueError as e:  # not JSON, not UTF-8
            raise _damaged(grid_dir, str(e)) from None
        runs = _records(grid_dir, d)
        by_name = {r.name: rid for rid, r in runs.items()}
        for p in plans:
            rid = by_name.get(p.name)
            if p.run_id not in runs and rid is not None:
                runs[p.run_id] = runs.pop(rid)
        return cls(str(grid_dir), grid, runs)

    def record(self, run_id: str, name: str) -> RunRecord:
        return self.runs.setdefault(run_id, RunRecord(name=name))

    def save(self) -> None:
        open_store(self.grid_dir).write_json(
            STATE_FILE,
            {
                "grid": self.grid,
                "updated": time.time(),
                "runs": {k: asdict(v) for k, v in sorted(self.runs.items())},
            },
        )


def _records(grid_dir: str, d: Any) -> dict[str, RunRecord]:
    """The RunRecords of a state file's content; one of another shape is a ConfigError."""
    runs = d.get("runs", {}) if isinstance(d, dict) else None
    if not isinstance(runs, dict):
        raise _damaged(grid_dir, f"a JSON {type(d).__name__} without a 'runs' object")
    out = {}
    for rid, r in runs.items():
        try:
            rec = RunRecord(**r)
        except TypeError as e:  # not an object, or fields RunRecord does not have
            raise _damaged(grid_dir, f"run {rid}: {e}") from None
        counts = (rec.launches, rec.failures)
        if not all(type(n) is int for n in counts) or not isinstance(rec.name, str):
            raise _damaged(grid_dir, f"run {rid}: {r}")
        out[rid] = rec
    return out


def _damaged(grid_dir: str, why: str) -> ConfigError:
    return ConfigError(
        f"{join(grid_dir, STATE_FILE)} is damaged ({why}); move it aside to start the grid's"
        " record over (finished runs stay finished: their DONE files say so; retry counts"
        " restart)"
    )


def driver_lock(grid_dir: str):
    """One driver per grid directory: a second one is refused (LockBusy: exit 2) naming
    the holder. An flock on a disk, a renewed lease in a bucket (rl_jax.runs.locks)."""
    return locks.acquire(grid_dir, DRIVER_LOCK, what=f"grid directory {grid_dir} (a grid driver)")
