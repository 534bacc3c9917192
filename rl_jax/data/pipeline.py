"""PromptPipeline: batches of problems over epochs on grain, checkpointable exactly.

Each epoch is a grain `MapDataset`: the problems still active at the epoch's
start (No-Positive-Resampling retires the rest), shuffled with a seed derived
from (seed, epoch), cut into global batches of `batch_size`, a remainder
dropped. A global batch is one contiguous slice of the shuffled epoch; process
p of P (multi-host, `jax.process_index()`) takes the p-th of its P equal parts.
So the union of all processes' batches at a step is the single-process batch,
whatever the process count.

Random access makes the state tiny and exact: (epoch, step in epoch, the
problems excluded at the epoch's start). A pipeline restored from `get_state()`
yields the same batches as one that never stopped, even if the curriculum has
retired more problems since that epoch began (they leave at the next epoch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from rl_jax.data._problem import Problem

STATE_VERSION = 1


class DataExhausted(RuntimeError):
    """Every problem has been retired by No-Positive-Resampling."""


def _epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def shard_problems(
    problems: Sequence[Problem], *, process_index: int, process_count: int
) -> list[Problem]:
    """This process's share of a fixed set (e.g. validation), round-robin."""
    return [problems[i] for i in range(process_index, len(problems), process_count)]


class PromptPipeline:
    """Iterator of per-process batches (list[Problem]) over endless epochs.

    batch_size: the *global* batch (B_p); each process yields batch_size // process_count.
    curriculum: anything with `is_retired(id) -> bool` and `retired_ids() -> set[int]`
        (a `Curriculum`); retired problems are skipped from the next epoch on.
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        *,
        batch_size: int,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
        curriculum=None,
    ):
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if batch_size < 1 or batch_size % process_count:
            raise ValueError(
                f"batch_size={batch_size} must be a positive multiple of process_count="
                f"{process_count} (each process takes an equal part of the global batch)"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        if len(problems) == 0:
            raise ValueError("PromptPipeline needs at least one problem")
        self._problems = problems
        self.batch_size, self.seed = batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = batch_size // process_count
        self.curriculum = curriculum
        self._ids: np.ndarray | None = None
        self.epoch, self.step = 0, 0
        self._excluded = np.zeros(0, np.int64)
        self._excluded = self._retired_positions()
        self._dataset = self._build()

    # -- epochs ---------------------------------------------------------------
    def _retired_positions(self) -> np.ndarray:
        if self.curriculum is None or not self.curriculum.retired_ids():
            return np.zeros(0, np.int64)
        if self._ids is None:  # read once: lazy sources decode a record per id
            self._ids = np.fromiter((p.id for p in self._problems), np.int64, len(self._problems))
        retired = np.fromiter(self.curriculum.retired_ids(), np.int64)
        return np.flatnonzero(np.isin(self._ids, retired)).astype(np.int64)

    def _build(self) -> grain.MapDataset:
        active = np.setdiff1d(np.arange(len(self._problems)), self._excluded)
        if active.size == 0:
            raise DataExhausted(
                f"all {len(self._problems)} problems are retired by No-Positive-Resampling "
                "(pass rate >= data.npr_threshold); raise the threshold, disable "
                "data.no_positive_resampling, or use more/harder problems"
            )
        ds = grain.MapDataset.source(active)
        if active.size < self.batch_size:
            # Too few problems left for one batch: repeat the active set within the epoch.
            ds = ds.repeat(-(-self.batch_size // int(active.size)))
        ds = ds.shuffle(seed=_epoch_seed(self.seed, self.epoch))
        return ds.batch(self.batch_size, drop_remainder=True)

    @property
    def batches_per_epoch(self) -> int:
        return len(self._dataset)

    # -- iteration --------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> list[Problem]:
        if self.step >= len(self._dataset):
            self.epoch, self.step = self.epoch + 1, 0
            self._excluded = self._retired_positions()
            self._dataset = self._build()
        positions = self._dataset[self.step]  # [batch_size] indices into problems
        self.step += 1
        lo = self.process_index * self.local_batch_size
        return [self._problems[int(i)] for i in positions[lo : lo + self.local_batch_size]]

    # -- checkpointing ----------------------------------------------------------
    def _fingerprint(self) -> str:
        n = len(self._problems)
        probe = [self._problems[i].id for i in sorted({0, n // 2, n - 1})]
        return hashlib.sha256(repr((n, probe)).encode()).hexdigest()[:16]

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable position: the batch `next()` will return."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "excluded": [int(i) for i in self._excluded],
            "seed": self.seed,
            "batch_size": self.batch_size,
            "fingerprint": self._fingerprint(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {state.get('version')} != {STATE_VERSION}")
        mine = {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "fingerprint": self._fingerprint(),
        }
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"pipeline state was saved with {key}={state[key]!r} but this pipeline has "
                    f"{key}={value!r}; restore with the same problems, data.seed and "
                    "data.prompts_per_batch"
                )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._excluded = np.asarray(state["excluded"], np.int64)
        self._dataset = self._build()
