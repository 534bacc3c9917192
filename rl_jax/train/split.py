"""Split mode: the sampler on its own devices, decoding in a background thread.

With `mesh.sampler_devices=N` the first N devices hold a copy of the policy in
the sampler's layout and decode PipelineRL waves while the remaining devices
train, at the same time; after every batch the trainer pushes its new weights
to the sampler by resharding (`jax.device_put` to the sampler's shardings) and
every later decode chunk uses them, rows in flight included (PipelineRL's
in-flight update, as in the colocated pipeline).

Staleness bound. A wave (one batch of B_p x n rows) may only start while fewer
than W = (k + 1) // M waves are started and not yet trained. Wave j therefore
starts after waves 0..j-W finished training, and the weights it samples with
are at least version (j - W + 1) * M (the trainer pushes before it frees the
slot). Its updates run at versions j * M .. j * M + M - 1, so no token is more
than W * M - 1 <= k versions older than the update that trains on it. The
trainer asserts this on every update (`rl_jax.train.phases.update`).

With sampling.stream the sampler thread runs PipelineRL's continuous stream
instead (`SplitStream`, rl_jax.train.stream): the engine on the sampler's
devices, groups admitted as its slots free up, a batch the next B_p complete
groups; its bound is the stream's (admission when t batches are trained, with
weights of version >= t x M: the trainer pushes before its locked `trained`).

Unlike the colocated modes, which weights a decode chunk sees depends on
timing, so split runs are not bitwise reproducible; the bound always holds.
One process only: under `jax.distributed` every process would have to issue
the same device work in the same order, which timing-driven threads do not.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

Weights = tuple[Any, int]  # (params in the sampler's layout, policy version)


class _Worker:
    """A sampler thread handing finished batches to the trainer through a queue (an
    exception raised in the thread reaches the trainer's `take`)."""

    def _start(self) -> None:
        self._ready: queue.Queue = queue.Queue()
        # (start, end) of each sampler round and of each trainer batch: how much the
        # two overlapped is the point of split mode (benchmarks and tests read these).
        self.intervals: list[tuple[float, float]] = []
        self.train_intervals: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, name="rl_jax-sampler", daemon=True)
        self._thread.start()

    def push(self, weights: Weights) -> None:
        """Newer weights for every later chunk (and wave or admission); a subclass
        holds them as `_weights` under its condition `_cond`."""
        with self._cond:
            self._weights = weights

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

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # handed to the trainer, which re-raises it
            self._ready.put(e)

    def _loop(self) -> None:
        raise NotImplementedError


class SplitSampler(_Worker):
    """The sampling half of split mode; the trainer drives it with push / allow / take /
    trained.

    start_wave(step, problems, weights) -> Wave and draw() -> problems come from the
    trainer (`draw` is called under `lock`, which the trainer also holds while it
    updates the curriculum that prompt draws read).
    """

    def __init__(
        self,
        sampler,
        *,
        waves: int,
        chunk: int,
        first_step: int,
        weights: Weights,
        start_wave: Callable,
        draw: Callable[[], list],
        lock: threading.Lock,
    ):
        self.sampler = sampler
        self.waves_max = waves
        self.chunk = chunk
        self._start_wave = start_wave
        self._draw = draw
        self.lock = lock
        self._cond = threading.Condition()
        self._weights = weights
        self._outstanding = 0  # waves started and not yet trained
        self._limit = first_step  # waves may start for steps < limit
        self._next_step = first_step
        self._stop = False
        self._start()

    # ---- the trainer's side ---------------------------------------------------------------

    def allow(self, limit: int) -> None:
        """Waves may start for steps below `limit` (the next checkpoint, or the last step)."""
        with self._cond:
            self._limit = max(self._limit, limit)
            self._cond.notify_all()

    def trained(self) -> None:
        """The trainer finished a wave's updates (and pushed the weights): a slot is free."""
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    # ---- the sampler thread ---------------------------------------------------------------

    def _can_start(self) -> bool:
        return self._outstanding < self.waves_max and self._next_step < self._limit

    def _loop(self) -> None:
        waves: list = []
        while True:
            with self._cond:
                while not self._stop and not waves and not self._can_start():
                    self._cond.wait()
                if self._stop:
                    return
                starts = []
                while self._can_start():
                    starts.append(self._next_step)
                    self._next_step += 1
                    self._outstanding += 1
                weights = self._weights
            t0 = time.perf_counter()
            for step in starts:
                with self.lock:
                    problems = self._draw()
                waves.append(self._start_wave(step, problems, weights))
            # One chunk of every unfinished wave, each with the newest weights.
            for w in waves:
                if not self.sampler.done(w.state):
                    with self._cond:
                        params, version = self._weights
                    w.state = self.sampler.decode(
                        params, w.state, max_steps=self.chunk, version=version
                    )
            oldest = waves[0]
            if self.sampler.done(oldest.state):
                waves.pop(0)
                self._ready.put((oldest.step, oldest.problems, self.sampler.result(oldest.state)))
            self.intervals.append((t0, time.perf_counter()))


class SplitStream(_Worker):
    """Split mode on the engine: the stream (`EngineStream`, on the sampler's devices)
    decodes in the sampler thread; the trainer drives it with push / allow / take /
    trained (push before trained: the bound relies on that order)."""

    def __init__(self, stream, *, weights: Weights):
        self.stream = stream
        self._cond = stream.cond  # one lock for the book, the weights and stopping
        self._weights = weights
        self._stop = False
        self._start()

    def allow(self, limit: int) -> None:
        """Groups may enter for steps below `limit` (the next checkpoint, or the last)."""
        self.stream.allow(limit)

    def trained(self) -> None:
        """The trainer finished a batch's updates (and pushed the weights)."""
        self.stream.trained()

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
