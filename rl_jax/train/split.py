"""Split mode: the sampler on its own devices, decoding in a background thread.

With `mesh.sampler_devices=N` the first N devices hold a copy of the policy in
the sampler's layout and run PipelineRL's continuous stream (rl_jax.train.stream:
the engine on the sampler's devices, groups admitted as its slots free up, a batch
the next B_p complete groups) while the remaining devices train, at the same time.
After every batch the trainer pushes its new weights to the sampler by resharding
(`jax.device_put` to the sampler's shardings) and every later decode chunk uses
them, rows in flight included (PipelineRL's in-flight update, as in the colocated
pipeline).

Staleness bound: the stream's. A group admitted when t batches are trained
samples with weights of version >= t x M, because the trainer pushes a batch's
weights before its locked `trained` (`StreamBook` keeps the deadlines); the
trainer checks every token (`rl_jax.train.phases.check_staleness`).

Unlike the colocated modes, which weights a decode chunk sees depends on
timing, so split runs are not bitwise reproducible; the bound always holds.
One process only: under `jax.distributed` every process would have to issue
the same device work in the same order, which timing-driven threads do not.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from rl_jax.train.stream import Weights


class SplitStream:
    """The sampling half of split mode: the stream (`EngineStream`, on the sampler's
    devices) decodes in a sampler thread, which hands finished batches to the trainer
    through a queue (an exception raised in the thread reaches the trainer's `take`).
    The trainer drives it with push / allow / take / trained (push before trained: the
    bound relies on that order)."""

    def __init__(self, stream, *, weights: Weights):
        self.stream = stream
        self._cond = stream.cond  # one lock for the book, the weights and stopping
        self._weights = weights
        self._stop = False
        self._ready: queue.Queue = queue.Queue()
        # (start, end) of each sampler round and of each trainer batch: how much the
        # two overlapped is the point of split mode (benchmarks and tests read these).
        self.intervals: list[tuple[float, float]] = []
        self.train_intervals: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, name="rl_jax-sampler", daemon=True)
        self._thread.start()

    # ---- the trainer's side ---------------------------------------------------------------

    def push(self, weights: Weights) -> None:
        """Newer weights for every later chunk and admission."""
        with self._cond:
            self._weights = weights

    def allow(self, limit: int) -> None:
        """Groups may enter for steps below `limit` (the next checkpoint, or the last)."""
        self.stream.allow(limit)

    def trained(self) -> None:
        """The trainer finished a batch's updates (and pushed the weights)."""
        self.stream.trained()

    def take(self) -> tuple[int, Any, Any]:
        """The oldest finished batch: (the step it is for, its problems, its Rollouts);
        blocks until there is one."""
        while True:
            try:
                item = self._ready.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the split-mode sampler thread stopped") from None
                continue
            if isinstance(item, BaseException):
                raise RuntimeError("the split-mode sampler thread failed") from item
            return item

    @property
    def busy_s(self) -> float:
        """Seconds the thread spent issuing and waiting on sampler work."""
        return sum(t1 - t0 for t0, t1 in self.intervals)

    def overlap_s(self) -> float:
        """Seconds during which the sampler thread and the trainer were both working."""
        total, i = 0.0, 0
        a, b = sorted(self.intervals), sorted(self.train_intervals)
        for s0, s1 in b:
            while i < len(a) and a[i][1] <= s0:
                i += 1
            j = i
            while j < len(a) and a[j][0] < s1:
                total += max(0.0, min(s1, a[j][1]) - max(s0, a[j][0]))
                j += 1
        return total

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the sampler thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # handed to the trainer, which re-raises it
            self._ready.put(e)

    def _loop(self) -> None:
        stream = self.stream
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or stream.has_work())
                if self._stop:
                    return
            t0 = time.perf_counter()
            stream.step(lambda: self._weights)  # reads the weights under the lock
            while (got := stream.take()) is not None:
                # Batches are formed for steps first_step, first_step + 1, ... in turn
                # (`formed` changes only here, in this thread).
                self._ready.put((stream.book.formed - 1, *got))
            self.intervals.append((t0, time.perf_counter()))
