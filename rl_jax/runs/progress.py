"""Console progress bar with rate and ETA (rich); a no-op when disabled."""

from __future__ import annotations

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
    def __init__(self, progress: Progress, task):
        self._p, self._t = progress, task

    def advance(self, n: int = 1, **fields) -> None:
        self._p.update(self._t, advance=n, **fields)

    def update(self, **fields) -> None:
        self._p.update(self._t, **fields)


@contextmanager
def progress_bar(total: int, description: str, *, enabled: bool = True, completed: int = 0):
    """`with progress_bar(100, "train") as bar: bar.advance(info="...")`."""
    if not enabled:
        yield _NullBar()
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
        bar = _Bar(p, task)

        orig = bar.advance

        def advance(n: int = 1, **fields):
            orig(n, **fields)
            speed = p.tasks[task].speed
            p.update(task, rate=f"{speed:.2f} it/s" if speed else "")

        bar.advance = advance  # type: ignore[method-assign]
        yield bar
