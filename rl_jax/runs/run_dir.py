"""Run directories: runs/<name>/ with config, run id, metrics, curve rows, events, plots.

One process writes a run directory at a time: `create_run_dir` takes an
exclusive lock (fcntl) on `<run>/.lock` and holds it until `RunDir.close()` or
the process ends, so a second launch of the same run is refused instead of
interleaving its rows and checkpoints with the first one's.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.config import RunConfig, flatten, run_id, to_dict
from rl_jax.knobs import ConfigError
from rl_jax.runs.atomic import append_jsonl, atomic_write_json, read_jsonl


class RunDirError(ConfigError):
    """The run directory cannot be used (busy, another run's, not writable): exit 2."""


class RunLock:
    """An exclusive flock on a file; released by `release()` or when the process ends."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot create the run lock {path}: {e.strerror}") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(self._fd)
            os.close(self._fd)
            self._fd = None
            raise RunDirError(
                f"run directory {path.parent} is in use by another process"
                f"{f' (pid {holder})' if holder else ''}; wait for it to finish or stop it"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.release()


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class RunDir:
    root: Path
    run_id: str
    lock: RunLock | None = field(default=None, compare=False, repr=False)

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def curve_path(self) -> Path:
        return self.root / "curve.jsonl"

    @property
    def samples_path(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def events_dir(self) -> Path:
        return self.root / "events"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def done_path(self) -> Path:
        return self.root / "DONE"

    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    def is_done(self) -> bool:
        return self.done_path.exists()

    def read_done(self) -> dict[str, Any] | None:
        """The DONE summary; None when there is none or it does not parse (the run is then
        finished again from its last checkpoint, which rewrites it)."""
        try:
            summary = json.loads(self.done_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            print(
                f"warning: {self.done_path} is damaged ({e}); finishing the run again",
                file=sys.stderr,
                flush=True,
            )
            return None
        return summary if isinstance(summary, dict) else None

    def write_config(self, cfg: RunConfig) -> None:
        atomic_write_json(
            self.config_path, {"run_id": self.run_id, "config": to_dict(cfg), "knobs": flatten(cfg)}
        )

    def close(self) -> None:
        """Release the run directory's lock (held from `create_run_dir`)."""
        if self.lock is not None:
            self.lock.release()

    def mark_done(self, summary: dict[str, Any]) -> None:
        atomic_write_json(self.done_path, summary)

    def append_metrics(self, row: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, [row])

    def append_curve(self, row: dict[str, Any]) -> None:
        append_jsonl(self.curve_path, [row])

    def curve(self) -> list[dict[str, Any]]:
        return read_jsonl(self.curve_path)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)


def create_run_dir(
    cfg: RunConfig, root: str | Path | None = None, *, lock: bool = True, write: bool = True
) -> RunDir:
    """Create (or reopen) the run directory, lock it and write the resolved config.

    Reopening with a different resolved config is refused: it would mix two
    experiments' rows in one curve. A config.json that no longer parses is
    rewritten when the rows and the DONE file in the directory carry this run's id
    (checkpoints are checked against it when they are restored).
    `lock=False` is for the processes of a multi-process run other than the first;
    `write=False` leaves config.json to `RunDir.write_config`, for a caller that
    checks more of the config before the directory records it.
    """
    rid = run_id(cfg)
    path = Path(root) if root is not None else Path(cfg.out_dir) / cfg.name
    try:
        for d in (path, path / "plots", path / "checkpoints"):
            d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run directory {path}: {e.strerror or e}") from e
    run_lock = RunLock(path / ".lock") if lock else None
    rd = RunDir(path, rid, run_lock)
    try:
        _check_owner(rd)
        if write:
            rd.write_config(cfg)
    except BaseException:
        rd.close()
        raise
    return rd


def _check_owner(rd: RunDir) -> None:
    """Refuse a directory that holds another run (config.json, or else its rows)."""
    try:
        old = json.loads(rd.config_path.read_text(encoding="utf-8"))
        found = {old.get("run_id")} if isinstance(old, dict) else {None}
        source = str(rd.config_path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        # Damaged: judge by the run ids the directory's rows and DONE file carry.
        found, source = set(), f"the rows in {rd.root} ({rd.config_path} is damaged: {e})"
        try:
            found |= {r.get("run_id") for r in read_jsonl(rd.curve_path) if "run_id" in r}
        except (OSError, ValueError):
            pass
        done = rd.read_done() if rd.done_path.exists() else None
        if done and "run_id" in done:
            found.add(done["run_id"])
        print(f"warning: {rd.config_path} is damaged; rewriting it", file=sys.stderr, flush=True)
    other = sorted(str(r) for r in found if r != rd.run_id)
    if other:
        raise RunDirError(
            f"{rd.root} holds run {', '.join(other)} with another config (from {source}); "
            f"this config's run id is {rd.run_id}. Use another run name or directory."
        )
