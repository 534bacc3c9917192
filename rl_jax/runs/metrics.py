"""Metrics sinks: JSONL (always), TensorBoard (tensorboardX), W&B (optional)."""

from __future__ import annotations

import hashlib
import math
import numbers
import shutil
import sys
from pathlib import Path
from typing import Any

from rl_jax.config.logging import LoggingConfig
from rl_jax.runs.run_dir import RunDir


def scalars(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, numbers.Number) or hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            out[k] = float(v)
    return out


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded
    yet: tensorboardX imports torch when it can, only to accept torch tensors, and that
    costs a JAX process ~180 MB of resident memory for logging floats and text."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _scalars_summary(values: list[tuple[str, float]]):
    """One Summary of scalars under their own names: tensorboardX's add_scalar rewrites a
    tag's characters outside [-/\\w.] (`val/pass@1` became `val/pass_1`), and TensorBoard
    shows any tag as it is."""
    from tensorboardX.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values])


class MetricsLogger:
    """Writes each row to metrics.jsonl, TensorBoard and (if enabled) W&B."""

    def __init__(
        self,
        run: RunDir,
        cfg: LoggingConfig | None = None,
        config: dict | None = None,
        *,
        purge_step: int | None = None,
    ):
        """purge_step: TensorBoard hides this run's earlier events at steps >= it (a
        resumed run rewinds to its checkpoint, as the JSONL rows are rewound)."""
        self.run = run
        self.cfg = cfg or LoggingConfig()
        self._tb = None
        self._wandb = None
        self._uploaded: dict[str, int] = {}  # staged event file -> bytes uploaded
        if self.cfg.tensorboard and run.remote:
            # What an earlier process staged here and did not upload belongs to steps
            # after its last checkpoint: this run writes them again.
            shutil.rmtree(self.events_dir, ignore_errors=True)
        if self.cfg.tensorboard:
            self._tb = summary_writer_class()(logdir=str(self.events_dir), purge_step=purge_step)
        if self.cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true but wandb is not installed") from e
            self._wandb = wandb.init(
                project=self.cfg.wandb_project,
                name=run.root.rstrip("/").rsplit("/", 1)[-1],
                id=run.run_id,
                config=config,
                resume="allow",
            )

    @property
    def events_dir(self) -> Path:
        """Where the event files are written: the run's events/ on a local disk; for a
        bucket run a local staging directory whose files `flush` uploads (TensorBoard
        appends to an event file; bucket objects cannot be appended to)."""
        if not self.run.remote:
            return Path(self.run.events_dir)
        from rl_jax.runtime import user_cache_dir

        key = hashlib.sha256(self.run.url().encode()).hexdigest()[:16]
        return Path(user_cache_dir("events")) / key

    def flush(self) -> None:
        """The run's rows and event files made durable (uploaded, for a bucket run)."""
        if self._tb is not None:
            self._tb.flush()
            if self.run.remote:
                self._upload_events()
        self.run.flush()

    def _upload_events(self) -> None:
        for f in sorted(self.events_dir.glob("events.out.tfevents.*")):
            size = f.stat().st_size
            if self._uploaded.get(f.name) != size:
                self.run.store.write(f"events/{f.name}", f.read_bytes())
                self._uploaded[f.name] = size

    def log(self, step: int, row: dict[str, Any]) -> None:
        row = {"step": int(step), **row}
        self.run.append_metrics(row)
        sc = scalars(row)
        if self._tb is not None:
            values = [(k, v) for k, v in sc.items() if k != "step" and math.isfinite(v)]
            if values:
                self._tb._get_file_writer().add_summary(_scalars_summary(values), step)
        if self._wandb is not None:
            self._wandb.log(sc, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text entry (TensorBoard's text tab, W&B as a string)."""
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=step)
        if self._wandb is not None:
            self._wandb.log({tag: text}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            if self.run.remote:
                self._upload_events()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
