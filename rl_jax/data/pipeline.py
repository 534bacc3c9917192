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

A task mixture (problems marked by rl_jax.data._mixture) is drawn slot by slot: each
slot of a global batch goes to a task by smooth weighted round-robin over the tasks'
weights (integer credits: after n slots every task has had its share of n within one
slot per task), and each task's problems come from an epoch stream of their own, as
above with one problem a batch. The state adds the credits and each task's stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from rl_jax.data._problem import MappedSequence, Problem

STATE_VERSION = 1
# A task's weight as an integer share of this (the credits of the round-robin are exact).
_WEIGHT_SCALE = 1_000_000


class DataExhausted(RuntimeError):
    """Every problem has been retired by No-Positive-Resampling."""


def _seed(*entropy: int) -> int:
    """A seed drawn from `entropy` (an epoch's shuffle: (seed, epoch))."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


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
    mixture: draw a task mixture's problems (rl_jax.data._mixture) in the mixture's
        proportions; False: as one source.
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
        mixture: bool = True,
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
        self._mix = _Mixture.of(problems, seed=seed, curriculum=curriculum) if mixture else None
        if self._mix is None:
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
        ds = ds.shuffle(seed=_seed(self.seed, self.epoch))
        return ds.batch(self.batch_size, drop_remainder=True)

    @property
    def batches_per_epoch(self) -> int:
        """Batches until every problem had its turn (a mixture: those of its slowest task)."""
        if self._mix is not None:
            return self._mix.batches_per_epoch(self.batch_size)
        return len(self._dataset)

    # -- iteration --------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> list[Problem]:
        lo = self.process_index * self.local_batch_size
        if self._mix is not None:
            self.step += 1
            return self._mix.draw(self.batch_size)[lo : lo + self.local_batch_size]
        if self.step >= len(self._dataset):
            self.epoch, self.step = self.epoch + 1, 0
            self._excluded = self._retired_positions()
            self._dataset = self._build()
        positions = self._dataset[self.step]  # [batch_size] indices into problems
        self.step += 1
        return [self._problems[int(i)] for i in positions[lo : lo + self.local_batch_size]]

    # -- checkpointing ----------------------------------------------------------
    def _fingerprint(self) -> str:
        n = len(self._problems)
        probe = [self._problems[i].id for i in sorted({0, n // 2, n - 1})]
        return hashlib.sha256(repr((n, probe)).encode()).hexdigest()[:16]

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable position: the batch `next()` will return."""
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "excluded": [int(i) for i in self._excluded],
            "seed": self.seed,
            "batch_size": self.batch_size,
            "fingerprint": self._fingerprint(),
        }
        if self._mix is not None:
            state["mixture"] = self._mix.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {state.get('version')} != {STATE_VERSION}")
        if (self._mix is None) != ("mixture" not in state):
            mine = "a task mixture" if self._mix is not None else "one source"
            raise ValueError(
                f"pipeline state was saved {'without' if self._mix else 'with'} a task "
                f"mixture, but this pipeline draws from {mine}; restore with the same data.mixture"
            )
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
        if self._mix is not None:
            self._mix.set_state(state["mixture"])
            return
        self._excluded = np.asarray(state["excluded"], np.int64)
        self._dataset = self._build()


class _Mixture:
    """A mixture's tasks, each an epoch stream of one problem at a time, and the
    round-robin that gives each slot of a batch to a task."""

    def __init__(self, names, weights, streams):
        self.names, self.weights, self.streams = names, weights, streams
        self.credits = [0] * len(names)

    @staticmethod
    def of(problems: Sequence[Problem], *, seed: int, curriculum) -> _Mixture | None:
        from rl_jax.data._mixture import MIX_TASK, MIX_WEIGHT

        if MIX_TASK not in problems[0].meta:
            return None
        members: dict[str, list[int]] = {}
        weights: dict[str, float] = {}
        for i in range(len(problems)):
            meta = problems[i].meta
            members.setdefault(meta[MIX_TASK], []).append(i)
            weights.setdefault(meta[MIX_TASK], meta[MIX_WEIGHT])
        names = list(members)
        streams = [
            PromptPipeline(
                MappedSequence(problems, lambda p: p, members[n]),  # the task's own
                batch_size=1,
                seed=_seed(seed, 0x313, k),
                curriculum=curriculum,
                process_index=0,
                process_count=1,
                mixture=False,
            )
            for k, n in enumerate(names)
        ]
        scaled = [max(1, round(weights[n] * _WEIGHT_SCALE)) for n in names]
        return _Mixture(names, scaled, streams)

    def draw(self, size: int) -> list[Problem]:
        """The next global batch of `size` problems, in slot order."""
        total = sum(self.weights)
        out = []
        for _ in range(size):
            for k, w in enumerate(self.weights):
                self.credits[k] += w
            k = max(range(len(self.credits)), key=self.credits.__getitem__)
            self.credits[k] -= total
            try:
                out += next(self.streams[k])
            except DataExhausted as e:
                raise DataExhausted(f"task {self.names[k]!r} of the mixture: {e}") from None
        return out

    def batches_per_epoch(self, size: int) -> int:
        total = sum(self.weights)
        return max(
            -(-len(s._problems) * total // (w * size))
            for s, w in zip(self.streams, self.weights, strict=True)
        )

    def get_state(self) -> dict[str, Any]:
        return {
            "tasks": self.names,
            "weights": self.weights,
            "credits": list(self.credits),
            "streams": [s.get_state() for s in self.streams],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state["tasks"] != self.names or state["weights"] != self.weights:
            raise ValueError(
                f"pipeline state was saved with mixture tasks {state['tasks']} (weights "
                f"{state['weights']}) but this pipeline has {self.names} ({self.weights}); "
                "restore with the same data.mixture"
            )
        self.credits = [int(c) for c in state["credits"]]
        for s, st in zip(self.streams, state["streams"], strict=True):
            s.set_state(st)
