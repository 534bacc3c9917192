"""Progress with rate and ETA: a rich bar on a terminal, lines in a log; a no-op when
disabled.

A run whose output goes to a file (nohup, a grid's log, a TPU host's log) gets a line at
most every `LINE_EVERY_S` seconds as steps finish, and a line saying it is still at
work when a step takes longer than `QUIET_S` seconds, so a log never goes silent.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _NullBar:
    def advance(self, n: int = 1, **fields) -> None:
        pass

    def update(self, **fields) -> None:
        pass


class _Bar:
    """A rich progress task; each advance also shows the task's speed."""

    def __init__(self, progress: Progress, task):
        self._p, self._t = progress, task

    def advance(self, n: int = 1, **fields) -> None:
        self._p.update(self._t, advance=n, **fields)
        speed = self._p.tasks[self._t].speed
        self._p.update(self._t, rate=f"{speed:.2f} it/s" if speed else "")

    def update(self, **fields) -> None:
        self._p.update(self._t, **fields)


LINE_EVERY_S = 30.0
QUIET_S = 60.0


def _clock(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Lines:
    """Progress as lines on stderr (not a terminal)."""

    def __init__(self, total: int, description: str, completed: int):
        self.total, self.description = total, description
        self.done = self.start_done = completed
        self.start = self.last_line = self.last_step = time.monotonic()
        self.info = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="progress", daemon=True)
        self._thread.start()

    def _line(self, text: str) -> None:
        print(f"{self.description}: {text}", file=sys.stderr, flush=True)
        self.last_line = time.monotonic()

    def advance(self, n: int = 1, **fields) -> None:
        with self._lock:
            now = time.monotonic()
            self.done += n
            self.last_step = now
            self.info = fields.get("info", self.info)
            if now - self.last_line >= LINE_EVERY_S or self.done >= self.total:
                rate = (now - self.start) / max(self.done - self.start_done, 1)
                eta = rate * (self.total - self.done)
                self._line(
                    f"step {self.done}/{self.total}  {rate:.2f} s/step  eta {_clock(eta)}"
                    + (f"  {self.info}" if self.info else "")
                )

    def update(self, **fields) -> None:
        self.info = fields.get("info", self.info)

    def _watch(self) -> None:
        while not self._stop.wait(min(QUIET_S / 4, 15.0)):
            with self._lock:
                now = time.monotonic()
                if now - self.last_line >= QUIET_S:
                    self._line(
                        f"at step {self.done + 1}/{self.total} for {_clock(now - self.last_step)}"
                        f" (elapsed {_clock(now - self.start)})"
                    )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def progress_bar(total: int, description: str, *, enabled: bool = True, completed: int = 0):
    """`with progress_bar(100, "train") as bar: bar.advance(info="...")`."""
    if not enabled:
        yield _NullBar()
        return
    if not sys.stdout.isatty():
        lines = _Lines(total, description, completed)
        try:
            yield lines
        finally:
            lines.close()
        return
    cols = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*cols, refresh_per_second=4) as p:
        task = p.add_task(description, total=total, completed=completed, info="", rate="")
        yield _Bar(p, task)
