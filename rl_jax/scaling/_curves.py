"""Curve rows in, curves out: the reading side of the DESIGN.md curve-row contract.

A curve row is one evaluation point of one run: `run_id`, the recipe's knobs
(flattened dotted keys, or nested under `knobs`), `step`, compute counters and
metrics. Files are JSON lines (a torn last line from a killed writer is
skipped), CSV or parquet; a directory means every `curve.jsonl` below it (the
run-directory layout). Any column may serve as x or metric, so curves from
other tools fit too.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.scaling._sigmoid import FitError

CURVE_FILE = "curve.jsonl"  # rl_jax.runs.RunDir.curve_path
SOURCE_KEY = "_source"  # the file a row came from (added by load_rows)


class CurveError(FitError):
    """Rows that cannot be turned into curves; the message names the run, column and fix."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Curve:
    """One run's curve: x (compute) strictly increasing, y the metric."""

    run_id: str
    group: str  # recipe (the --group-by column) or the run id
    x: np.ndarray  # [N]
    y: np.ndarray  # [N]
    steps: np.ndarray | None  # [N] or None without a `step` column
    meta: dict[str, Any] = field(repr=False)  # the first row (knobs and all)
    warnings: tuple[str, ...] = ()
    reliable: bool = True  # False when rows were dropped for NaN values


def _flatten(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, Mapping):
            # `knobs` holds the recipe's dotted keys: no prefix of its own.
            out.update(_flatten(v, "" if (k == "knobs" and not prefix) else f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _scalar(text: str) -> Any:
    """A CSV cell as int, float, bool or string; '' means absent (None)."""
    if text == "":
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return text


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    # rl_jax.runs.atomic is light (no JAX); imported here to keep `import rl_jax.scaling` lean.
    from rl_jax.runs.atomic import read_jsonl

    try:
        return read_jsonl(path)
    except json.JSONDecodeError as e:
        raise CurveError(f"{path}: not JSON lines ({e})") from None
    except ValueError as e:  # a line that is not JSON or not UTF-8: the message names both
        raise CurveError(str(e)) from None


def _read_csv(path: Path) -> list[dict[str, Any]]:
    # utf-8-sig: a byte-order mark (spreadsheets write one) is not part of the first header.
    with open(path, newline="", encoding="utf-8-sig") as f:
        # A blank cell is an absent value (the row did not record that column).
        try:
            return [
                {k: _scalar(v) for k, v in r.items() if k is not None and v not in ("", None)}
                for r in csv.DictReader(f)
            ]
        except csv.Error as e:
            raise CurveError(f"{path}: not CSV ({e})") from None


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CurveError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert to CSV"
        ) from None
    try:
        return pq.read_table(path).to_pylist()  # nulls stay None, NaN stays NaN
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise CurveError(f"{path}: not a parquet file ({e})") from None


_READERS = {".jsonl": _read_jsonl, ".json": _read_jsonl, ".csv": _read_csv}
_READERS[".parquet"] = _read_parquet
_READERS[".pq"] = _read_parquet


def load_rows(paths: str | Path | Iterable[str | Path]) -> list[dict[str, Any]]:
    """Read curve rows from files (JSON lines, CSV, parquet) or run directories.

    Nested dicts are flattened to dotted keys; each row records its file under `_source`.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        if _is_url(p):  # a bucket's curve file, or a run or grid directory in one
            files.extend(_remote_files(str(p)))
            continue
        p = Path(p)
        if p.is_dir():
            found = sorted(p.rglob(CURVE_FILE))
            if not found:
                raise CurveError(f"{p} is a directory without any {CURVE_FILE} below it")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise CurveError(f"{p}: no such file or directory")
    rows = []
    for f in files:
        reader = _READERS.get(_suffix(f).lower())
        if reader is None:
            raise CurveError(
                f"{f}: unknown file type {_suffix(f)!r}; use one of {sorted(_READERS)}"
            )
        try:
            read = reader(f)
        except UnicodeDecodeError as e:
            raise CurveError(
                f"{f}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                f"a {_suffix(f)} curve file is UTF-8"
            ) from None
        except OSError as e:
            raise CurveError(f"{f}: cannot read it ({e.strerror or e})") from None
        for i, r in enumerate(read):
            if not isinstance(r, Mapping):
                raise CurveError(f"{f}: row {i + 1} is {type(r).__name__}, not an object")
            row = _flatten(r)
            row[SOURCE_KEY] = str(f)
            rows.append(row)
    return rows


def _is_url(p: str | Path) -> bool:
    return isinstance(p, str) and "://" in p and not p.startswith("file://")


def _suffix(f: str | Path) -> str:
    return Path(str(f).rstrip("/").rsplit("/", 1)[-1]).suffix


def _remote_files(url: str) -> list[str]:
    """`url` itself when it names a file, else every curve.jsonl below it."""
    from rl_jax.config import paths

    fs, inner = paths.filesystem(url, "curve path", use_listings_cache=False)
    proto = url.split("://", 1)[0]
    if fs.isfile(inner):
        return [url]
    found = sorted(n for n in fs.find(inner) if n.rsplit("/", 1)[-1] == CURVE_FILE)
    if not found:
        raise CurveError(f"{url}: no such file, nor any {CURVE_FILE} below it")
    return [f"{proto}://{n}" for n in found]


def _is_bad(v: Any) -> bool:
    try:
        return not math.isfinite(float(v))
    except (TypeError, ValueError):
        return True


def _unknown_column(name: str, rows: Sequence[Mapping[str, Any]], what: str) -> CurveError:
    cols = sorted({k for r in rows for k in r if k != SOURCE_KEY})
    numeric = [c for c in cols if any(isinstance(r.get(c), (int, float)) for r in rows)]
    close = difflib.get_close_matches(name, cols, n=3, cutoff=0.4)
    hint = f"; did you mean {close}?" if close else ""
    return CurveError(f"no {what} column {name!r} in the rows{hint} numeric columns: {numeric}")


def curves_from_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    x: str = "flops",
    metric: str = "val/pass@1",
    group_by: str | None = "recipe",
    run_key: str = "run_id",
) -> list[Curve]:
    """Split rows into one Curve per run, sorted by step (or file order without `step`).

    - Rows without the metric (absent, null, a blank CSV cell) are not evaluation rows of it
      and are skipped.
    - Rows whose metric is NaN/inf, or whose x is missing or NaN, are dropped; the curve says
      so and is marked unreliable (a NaN evaluation is a sign of a broken run).
    - Compute must strictly increase along a run; otherwise a CurveError names the rows.
    - group: the `group_by` column when a run has it (non-empty), else the run id.
    Rows without `run_key` form one run per source file (curves exported by other tools).
    """
    if not rows:
        raise CurveError("no curve rows to fit")
    rows = [_flatten(r) if any(isinstance(v, Mapping) for v in r.values()) else r for r in rows]
    if not any(x in r for r in rows):
        raise _unknown_column(x, rows, "compute (--x)")
    if not any(r.get(metric) is not None for r in rows):
        raise _unknown_column(metric, rows, "metric (--metric)")
    curves = []
    for rid, rrows in _rows_by_run(rows, run_key).items():
        curve = _curve(rid, rrows, x=x, metric=metric, group_by=group_by)
        if curve is not None:
            curves.append(curve)
    if not curves:
        raise CurveError(f"no row has the metric {metric!r}")
    return curves


def _rows_by_run(rows, run_key: str) -> dict[str, list[Mapping[str, Any]]]:
    """Rows grouped by run id, in first-seen order; rows without one by their source file."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        rid = r.get(run_key)
        if rid is None or rid == "":
            rid = Path(str(r.get(SOURCE_KEY, "rows"))).stem
        runs.setdefault(str(rid), []).append(r)
    return runs


def _curve(rid: str, rrows, *, x: str, metric: str, group_by: str | None) -> Curve | None:
    """One run's Curve from its rows (None when none has the metric); see curves_from_rows."""
    evals = [r for r in rrows if r.get(metric) is not None]
    if not evals:
        return None
    warnings: list[str] = []
    bad = [r for r in evals if _is_bad(r.get(x)) or _is_bad(r.get(metric))]  # None is bad too
    if bad:
        steps = [r.get("step", "?") for r in bad][:5]
        warnings.append(
            f"run {rid}: dropped {len(bad)} row(s) with missing/NaN {x!r} or {metric!r} "
            f"(steps {steps}); check the run before trusting its fit"
        )
        evals = [r for r in evals if not any(r is b for b in bad)]
    if not evals:
        raise CurveError(f"run {rid}: every evaluation row has a NaN {x!r} or {metric!r}")
    has_step = all(isinstance(r.get("step"), (int, float)) for r in evals)
    if has_step:
        evals = _dedupe_steps(rid, sorted(evals, key=lambda r: r["step"]), x, warnings)
    xs = np.array([float(r[x]) for r in evals])
    ys = np.array([float(r[metric]) for r in evals])
    steps = np.array([r["step"] for r in evals]) if has_step else None
    _check_increasing(rid, xs, steps, x)
    g = evals[0].get(group_by) if group_by else None
    return Curve(
        run_id=rid,
        group=str(g) if g not in (None, "") else rid,
        x=xs,
        y=ys,
        steps=steps,
        meta=dict(evals[0]),
        warnings=tuple(warnings),
        reliable=not bad,
    )


def _dedupe_steps(rid, rows, x, warnings):
    """A resumed run may log a step twice; identical compute is the same point (keep the last)."""
    out: list[Mapping[str, Any]] = []
    dup = 0
    for r in rows:
        if out and out[-1]["step"] == r["step"]:
            if float(out[-1][x]) != float(r[x]):
                raise CurveError(
                    f"run {rid}: step {r['step']} appears twice with different {x!r} "
                    f"({out[-1][x]} and {r[x]}); two runs share a run_id?"
                )
            out[-1] = r
            dup += 1
        else:
            out.append(r)
    if dup:
        warnings.append(f"run {rid}: {dup} repeated step(s) (a resumed run?) kept once")
    return out


def _check_increasing(rid: str, xs: np.ndarray, steps: np.ndarray | None, x: str) -> None:
    bad = np.flatnonzero(np.diff(xs) <= 0)
    if bad.size:
        i = int(bad[0])
        where = (
            f"step {steps[i]} -> {steps[i + 1]}" if steps is not None else f"rows {i} -> {i + 1}"
        )
        raise CurveError(
            f"run {rid}: compute {x!r} is not increasing ({where}: {xs[i]:g} -> {xs[i + 1]:g}); "
            "x must be a cumulative counter; is it per-step, or are two runs mixed?"
        )


def group_curves(curves: Sequence[Curve]) -> dict[str, list[Curve]]:
    """Recipe -> its runs (seeds), in first-seen order."""
    out: dict[str, list[Curve]] = {}
    for c in curves:
        out.setdefault(c.group, []).append(c)
    return out


def knob_value(curve: Curve, key: str) -> float:
    """A numeric knob of a run (e.g. `sampling.n`), with an error naming the run if absent."""
    v = curve.meta.get(key)
    if v is None or _is_bad(v):
        raise CurveError(f"run {curve.run_id} has no numeric {key!r} column")
    return float(v)
