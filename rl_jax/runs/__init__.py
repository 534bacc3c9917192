"""Run directories, atomic writes, metrics sinks and progress bars."""

from rl_jax.config.logging import LoggingConfig
from rl_jax.runs.atomic import (
    append_jsonl,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    read_jsonl,
    truncate_jsonl_after,
)
from rl_jax.runs.metrics import MetricsLogger
from rl_jax.runs.progress import progress_bar
from rl_jax.runs.run_dir import RunDir, RunDirError, RunLock, create_run_dir
from rl_jax.runs.samples import format_samples, logged_rows, sample_rows

__all__ = [
    "LoggingConfig",
    "MetricsLogger",
    "RunDir",
    "RunDirError",
    "append_jsonl",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "create_run_dir",
    "format_samples",
    "logged_rows",
    "progress_bar",
    "read_jsonl",
    "sample_rows",
    "truncate_jsonl_after",
]
