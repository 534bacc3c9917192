"""Run directories (local or in a bucket), atomic writes, locks, metrics sinks, progress."""

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
from rl_jax.runs.run_dir import RunDir, RunDirError, create_run_dir, open_run_dir
from rl_jax.runs.samples import format_samples, logged_rows, sample_rows
from rl_jax.runs.storage import STORAGE_EXIT, StorageError, is_remote, open_store

__all__ = [
    "STORAGE_EXIT",
    "LoggingConfig",
    "MetricsLogger",
    "RunDir",
    "RunDirError",
    "StorageError",
    "append_jsonl",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "create_run_dir",
    "format_samples",
    "is_remote",
    "logged_rows",
    "open_run_dir",
    "open_store",
    "progress_bar",
    "read_jsonl",
    "sample_rows",
    "truncate_jsonl_after",
]
