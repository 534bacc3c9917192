"""`rl-jax fit CURVES... --x flops --metric val/pass@1 --out DIR`: fit, compare, report.

Writes DIR/fits.json (one object per run or recipe), DIR/recipes.{md,csv},
DIR/report.md and DIR/plots/*.{png,svg}. Curves of a task mixture (val/<task>/pass@1
beside val/pass@1) are also fitted per task (--per-task): DIR/tasks/<task>/ holds each
task's report, DIR/tasks.md and DIR/tasks.json the per-task table. Exit status: 0 when something was
fitted (a curve that does not fit is named on stderr and in the report); 2, with
one line naming the file and what is wrong and nothing written, for unusable input:
an unreadable or non-UTF-8 file, an unknown column, a bad option, or curves none of
which can be fitted (fewer points than the sigmoid has parameters, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_jax.cli import one_line
from rl_jax.config.paths import check_dir_path
from rl_jax.scaling import (
    BOOTSTRAP_KINDS,
    FRONTIER_MODES,
    SIGMOID_METHODS,
    SOURCE_KEY,
    FitError,
    fit_runs,
    fit_tasks,
    load_rows,
    task_table,
    task_table_markdown,
    write_report,
)


def _r0(text: str) -> str | float:
    if text in ("first", "fit"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use 'first', 'fit' or a number") from None


def _grid(text: str) -> str | tuple[float, ...]:
    if text in ("data", "paper"):
        return text
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use 'data', 'paper' or comma-separated values"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rl-jax fit",
        description="Fit ScaleRL sigmoids (and power laws) to compute-performance curves; "
        "compare recipes; check extrapolation; iso-compute frontier; early decision.",
    )
    p.add_argument("curves", nargs="+", help="curve files (.jsonl, .csv, .parquet) or run dirs")
    p.add_argument("--x", default="flops", help="compute column (default: flops)")
    p.add_argument("--metric", default="val/pass@1", help="metric column (default: val/pass@1)")
    p.add_argument("--out", default="fits", help="output directory (default: fits)")
    p.add_argument(
        "--group-by",
        default="recipe",
        help="column naming a run's recipe; runs of one recipe are seeds (default: recipe; "
        "'none' fits runs only)",
    )
    _add_sigmoid_options(p)
    _add_analysis_options(p)
    p.add_argument(
        "--per-task",
        default="auto",
        choices=("auto", "off"),
        help="auto (default): also fit each task of a mixture (val/<task>/<leaf> columns "
        "beside --metric); off: --metric only",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def _add_sigmoid_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="grid", choices=sorted(SIGMOID_METHODS))
    p.add_argument("--r0", type=_r0, default="first", help="'first', 'fit' or a number")
    p.add_argument(
        "--fit-start",
        default=None,
        help="exclude points before this compute (a number, or 'P%%' of each run's last)",
    )
    p.add_argument("--a-grid", type=_grid, default="data", help="'data', 'paper' or values")
    p.add_argument("--c-mid-grid", type=_grid, default="data", help="'data', 'paper' or values")
    p.add_argument(
        "--metric-range",
        type=float,
        nargs=2,
        default=(0.0, 1.0),
        metavar=("LO", "HI"),
        help="bounds of the metric; A <= HI (default: 0 1, pass rates)",
    )


def _add_analysis_options(p: argparse.ArgumentParser) -> None:
    """Intervals, the extrapolation check, the early decision and the iso-compute frontier."""
    p.add_argument("--bootstrap", default="residual", choices=BOOTSTRAP_KINDS)
    p.add_argument("--n-boot", type=int, default=200)
    p.add_argument("--level", type=float, default=0.95, help="interval level (default: 0.95)")
    p.add_argument(
        "--extrapolate",
        type=float,
        default=0.5,
        help="fit each run on this fraction of its compute and predict the rest; 0 disables",
    )
    p.add_argument("--a-tol", type=float, default=0.02, help="the paper's A tie width")
    p.add_argument(
        "--stop-threshold",
        type=float,
        default=0.05,
        help="early decision: stop a recipe whose P(beats leader) is below this",
    )
    p.add_argument("--frontier", default="auto", choices=FRONTIER_MODES)
    p.add_argument("--n-key", default="sampling.n", help="column of n (rollouts per problem)")
    p.add_argument(
        "--bp-key", default="data.prompts_per_batch", help="column of B_p (problems per batch)"
    )


# Options passed to rl_jax.scaling.fit_runs under their own names.
_FIT_OPTIONS = ("x", "fit_start", "n_boot", "level", "a_tol", "stop_threshold", "frontier")
_FIT_OPTIONS += ("n_key", "bp_key", "seed", "r0", "method", "a_grid", "c_mid_grid")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = {k: getattr(args, k) for k in _FIT_OPTIONS}
    opts.update(
        group_by=None if args.group_by.lower() == "none" else args.group_by,
        bootstrap_kind=args.bootstrap,
        extrapolate=args.extrapolate or None,
        metric_range=tuple(args.metric_range),
    )
    try:
        if args.seed < 0:
            raise FitError(f"--seed={args.seed} must be an integer >= 0 (numpy's seeds are)")
        check_dir_path(args.out, "--out")
        rows = load_rows(args.curves)
        report = fit_runs(rows, metric=args.metric, **opts)
        fitted = [e for e in report.entries if e.fit is not None]
        if not fitted:
            raise FitError("nothing could be fitted: " + "; ".join(_failures(report, rows)))
        tasks = fit_tasks(rows, metric=args.metric, **opts) if args.per_task == "auto" else {}
        written = write_report(report, args.out, plots=not args.no_plots)
        written += _write_tasks(tasks, args.out, x=args.x, plots=not args.no_plots)
    except (FitError, ValueError) as e:
        print(f"rl-jax fit: {one_line(e)}", file=sys.stderr)
        return 2
    for e in report.entries:
        if e.error:
            print(f"rl-jax fit: {e.name}: {e.error}", file=sys.stderr)
        elif not e.reliable:
            print(f"rl-jax fit: {e.name}: fit flagged unreliable (see report.md)", file=sys.stderr)
    for row in task_table(tasks):
        if "error" in row:
            print(f"rl-jax fit: task {row['task']}: {row['name']}: {row['error']}", file=sys.stderr)
        else:
            print(
                f"task {row['task']}: {row['name']}: A {row['A']:.3f}  B {row['B']:.2f}  "
                f"C_mid {row['C_mid']:.3g}  R0 {row['R0']:.3f}  ({row['points']} points)"
            )
    print(
        f"fitted {len(fitted)} of {len(report.entries)} runs/recipes"
        + (f" and {len(tasks)} tasks" if tasks else "")
        + f"; wrote {len(written)} files to {args.out} (report.md, fits.json"
        + (", tasks.md)" if tasks else ")")
    )
    return 0


def _write_tasks(tasks: dict, out: str, *, x: str, plots: bool) -> list[Path]:
    """Each task's full report under OUT/tasks/<task>/, and OUT/tasks.{md,json}."""
    if not tasks:
        return []
    written: list[Path] = []
    for task, rep in tasks.items():
        if not isinstance(rep, str):
            written += write_report(rep, Path(out) / "tasks" / task, plots=plots)
    rows = task_table(tasks)
    md = Path(out) / "tasks.md"
    md.write_text(
        "# Per-task fits\n\nEach task of the mixture fitted on its own column "
        f"(val/<task>/...); reports in tasks/<task>/.\n\n{task_table_markdown(rows, x)}\n"
    )
    js = Path(out) / "tasks.json"
    js.write_text(json.dumps(rows, indent=1, default=float) + "\n")
    return [*written, md, js]


def _failures(report, rows) -> list[str]:
    """'FILE: run R: why' for each curve that did not fit."""
    files: dict[str, set[str]] = {}
    for r in rows:
        src = str(r.get(SOURCE_KEY, "rows"))
        rid = r.get("run_id")
        # A row without a run id belongs to its file's run (rl_jax.scaling.curves_from_rows).
        files.setdefault(str(rid) if rid not in (None, "") else Path(src).stem, set()).add(src)
    out = [
        f"{', '.join(sorted(files.get(e.name, {'?'})))}: run {e.name}: {e.error}"
        for e in report.entries
        if e.error and e.kind == "run"
    ]
    return out or [f"{e.name}: {e.error}" for e in report.entries if e.error]
