"""Run directories: runs/<name>/ with config, run id, metrics, curve rows, events, plots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_jax.config import RunConfig, flatten, run_id, to_dict
from rl_jax.runs.atomic import append_jsonl, atomic_write_json, read_jsonl


@dataclass(frozen=True)
class RunDir:
    root: Path
    run_id: str

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

    def is_done(self) -> bool:
        return self.done_path.exists()

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


def create_run_dir(cfg: RunConfig, root: str | Path | None = None) -> RunDir:
    """Create (or reopen) the run directory and write the resolved config atomically.

    Reopening with a different resolved config is refused: it would mix two
    experiments' rows in one curve.
    """
    rid = run_id(cfg)
    path = Path(root) if root is not None else Path(cfg.out_dir) / cfg.name
    rd = RunDir(path, rid)
    for d in (path, rd.plots_dir, rd.checkpoints_dir):
        d.mkdir(parents=True, exist_ok=True)
    if rd.config_path.exists():
        old = json.loads(rd.config_path.read_text())
        if old.get("run_id") != rid:
            raise FileExistsError(
                f"{path} holds run {old.get('run_id')} with another config; "
                f"this config's run id is {rid}. Use another run name or directory."
            )
    atomic_write_json(
        rd.config_path, {"run_id": rid, "config": to_dict(cfg), "knobs": flatten(cfg)}
    )
    return rd
