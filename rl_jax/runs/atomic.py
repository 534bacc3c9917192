"""Whole-file writes and whole-line JSONL appends: a killed writer never leaves a torn file.

Local paths only, except `read_jsonl`, which also reads URLs. Run directories go
through `rl_jax.runs.storage`, which keeps these semantics on a bucket.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.runs.storage import _jsonable, append_bytes, atomic_write_bytes, is_remote

__all__ = [
    "JsonlScan",
    "append_jsonl",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "jsonl_bytes",
    "jsonl_rows",
    "read_jsonl",
    "scan_jsonl",
    "truncate_jsonl_after",
]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> None:
    atomic_write_text(
        path, json.dumps(obj, indent=indent, sort_keys=True, default=_jsonable) + "\n"
    )


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True, default=_jsonable) + "\n" for r in rows).encode()


def append_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Append whole lines with one write + fsync (a torn last line is cut first)."""
    if rows:
        append_bytes(path, jsonl_bytes(rows))


@dataclass
class JsonlScan:
    """The rows of a JSONL file and what was wrong with it.

    `bad` holds (1-based line number, reason) of each line that is not a JSON object in
    UTF-8; `torn` is True when the file ends in a partial line (a writer was killed)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # line number of each row
    bad: list[tuple[int, str]] = field(default_factory=list)
    torn: bool = False


def scan_jsonl(data: bytes) -> JsonlScan:
    out = JsonlScan()
    parts = data.split(b"\n")
    if parts and parts[-1] != b"":
        out.torn = True  # no newline after the last line
    parts = parts[:-1]
    for i, raw in enumerate(parts, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.bad.append((i, "not UTF-8"))
            continue
        except ValueError as e:
            out.bad.append((i, f"not JSON ({e.msg})"))
            continue
        if not isinstance(row, dict):
            out.bad.append((i, f"a JSON {type(row).__name__}, not an object"))
            continue
        out.rows.append(row)
        out.lines.append(i)
    return out


def _read_bytes(path: str | os.PathLike) -> bytes | None:
    if is_remote(path):
        from rl_jax.config import paths

        fs, inner = paths.filesystem(str(path), "path")
        try:
            return fs.cat_file(inner)
        except FileNotFoundError:
            return None
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file (a path or URL; none when it is absent). A torn last line
    is no row; a bad line elsewhere is a ValueError naming the file and the line."""
    data = _read_bytes(path)
    return [] if data is None else jsonl_rows(data, str(path))


def jsonl_rows(data: bytes, where: str) -> list[dict[str, Any]]:
    """The rows of JSONL bytes, a torn last line dropped; a bad line elsewhere is a
    ValueError naming `where` and the line."""
    scan = scan_jsonl(data)
    if scan.bad:
        line, why = scan.bad[0]
        raise ValueError(f"{where}: line {line} is {why}")
    return scan.rows


def truncate_jsonl_after(path: str | os.PathLike, key: str, last: int) -> None:
    """Keep only rows with row[key] <= last, atomically (a missing file stays missing)."""
    data = _read_bytes(path)
    if data is None:
        return
    rows = [r for r in scan_jsonl(data).rows if r.get(key, -1) <= last]
    atomic_write_bytes(path, jsonl_bytes(rows))
