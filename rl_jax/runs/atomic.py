"""Atomic file writes: a killed process never leaves a torn file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> None:
    atomic_write_text(
        path, json.dumps(obj, indent=indent, sort_keys=True, default=_jsonable) + "\n"
    )


def append_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Append whole lines with one write + fsync.

    A torn last line (a writer killed mid-write) is cut off first: appended after
    it, it would become a bad line in the middle, which readers refuse.
    """
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = "".join(json.dumps(r, sort_keys=True, default=_jsonable) + "\n" for r in rows)
    with open(path, "a+b") as f:
        _cut_torn_tail(f)
        f.write(blob.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _cut_torn_tail(f) -> None:
    """Truncate an open file after its last newline (nothing to do if it ends in one)."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    pos = end
    while pos > 0:
        start = max(0, pos - 65536)
        f.seek(start)
        nl = f.read(pos - start).rfind(b"\n")
        if nl >= 0:
            f.truncate(start + nl + 1)
            return
        pos = start
    f.truncate(0)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read JSON lines, ignoring a torn (unterminated) last line from a killed writer."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # torn tail
                break
            raise
    return out


def truncate_jsonl_after(path: str | os.PathLike, key: str, last: int) -> None:
    """Keep only rows with row[key] <= last (rewind logs on resume), atomically.

    A missing file stays missing; a torn last line is dropped with the rows after `last`.
    """
    if not Path(path).exists():
        return
    rows = [r for r in read_jsonl(path) if r.get(key, -1) <= last]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def _jsonable(x: Any):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
