"""`rl-jax study SPEC --out DIR [--from GRID_DIR]`: a study's report from a grid's curves.

With --from, the grid's curves (GRID_DIR/curves.jsonl, written by `rl-jax grid`)
are cut to the columns a study needs and written to DIR/curves.jsonl, small
enough to commit. Then DIR/curves.jsonl is fitted and DIR/study.json,
DIR/report.md and DIR/plots/*.png are written. The same curves give the same
report, bit for bit. What is fitted follows the spec's report kind:
- a seeded leave-one-out grid (rl_jax.scaling.analyse_study): per-seed fits,
  seed noise, each variant's effect on A and B with intervals, half-budget
  extrapolation, the paper's findings from the spec's `report.paper`;
- an iso-compute grid (rl_jax.scaling.analyse_isocompute): per split the
  frontier and n*(C), n against B_p per budget, n*'s change with the budget,
  the interference histograms, and IsoCompute's findings beside these.

Exit status: 0 on success, 2 for unusable input (unknown spec, missing or
malformed curves, a baseline without runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_jax.config.paths import check_dir_path
from rl_jax.grid import load_spec
from rl_jax.grid.results import GROUP_KEY as GROUP
from rl_jax.scaling import (
    HIST_KEY,
    FitError,
    analyse_isocompute,
    analyse_study,
    curves_from_rows,
    load_rows,
    write_iso_study,
    write_study,
)

CURVES = "curves.jsonl"
# Columns kept per evaluation row, besides the axis labels and the report's x and metric.
KEEP = ("run_id", GROUP, "grid", "seed", "status", "step", "rollouts", "flops", "generated_tokens")
KEEP += ("device_seconds", "eval_device_seconds")


def compact_rows(rows: list[dict], axes: list[str], x: str, metric: str) -> list[dict]:
    """Evaluation rows (those with the metric), cut to KEEP, the axes and every val/ column."""
    keep = set(KEEP) | set(axes) | {x, metric}
    out = []
    for r in rows:
        if r.get(metric) is None:
            continue
        out.append({k: v for k, v in r.items() if k in keep or k.startswith("val/")})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl-jax study", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="the grid spec the curves come from (file or experiments/ name)")
    p.add_argument("--out", required=True, help="study directory: curves.jsonl in, report out")
    p.add_argument("--from", dest="grid_dir", help="a grid directory to take curves.jsonl from")
    p.add_argument(
        "--baseline", default="", help="leave-one-out: group to compare against (default: spec's)"
    )
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    spec = load_spec(a.spec)  # a ConfigError: the CLI shell prints it and exits 2
    if a.baseline and spec.report.kind == "isocompute":
        print(
            f"rl-jax study: --baseline: {spec.name} is an iso-compute grid (no baseline)",
            file=sys.stderr,
        )
        return 2
    check_dir_path(a.out, "--out")
    out = Path(a.out)
    dest = out / CURVES
    if a.grid_dir and not _collect(spec, Path(a.grid_dir) / CURVES, dest):
        return 2
    if not dest.is_file():
        print(f"rl-jax study: {dest} not found; give --from GRID_DIR", file=sys.stderr)
        return 2
    try:
        if spec.report.kind == "isocompute":
            _isocompute(spec, load_rows(dest), out, plots=not a.no_plots)
        else:
            _leave_one_out(spec, load_rows(dest), out, a)
    except FitError as e:
        print(f"rl-jax study: {dest}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'report.md'} and {out / 'study.json'}")
    return 0


def _collect(spec, src: Path, dest: Path) -> bool:
    """The grid's evaluation rows, compacted, written to dest; False (said) without them."""
    if not src.is_file():
        print(f"rl-jax study: {src} not found (run `rl-jax grid` first)", file=sys.stderr)
        return False
    rep = spec.report
    keep = [ax.name for ax in spec.axes]
    if rep.kind == "isocompute":
        keep += [*rep.frontier, HIST_KEY]
    rows = compact_rows(load_rows(src), keep, rep.x, rep.metric)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return True


def _heading(spec, runs: int) -> dict[str, str]:
    """The report's title and preamble."""
    preamble = (
        f"Grid `{spec.name}` ({spec.description or spec.recipe}); {runs} runs. "
        f"Regenerated from this directory's curves.jsonl by `rl-jax study {spec.name} --out DIR`."
    )
    return {"title": f"Study: {spec.name}", "preamble": preamble}


def _leave_one_out(spec, rows: list[dict], out: Path, a) -> None:
    rep = spec.report
    curves = curves_from_rows(rows, x=rep.x, metric=rep.metric, group_by=GROUP)
    study = analyse_study(
        curves,
        baseline=a.baseline or rep.baseline or curves[0].group,
        paper=dict(rep.paper),
        fraction=rep.fit_fraction,
        n_boot=rep.n_boot,
        r0=rep.r0,
        fit_start=rep.fit_start,
        paired=rep.paired,
    )
    write_study(study, out, **_heading(spec, len(curves)), plots=not a.no_plots)


def _isocompute(spec, rows: list[dict], out: Path, *, plots: bool) -> None:
    rep = spec.report
    study = analyse_isocompute(
        rows,
        split_by=rep.split_by,
        x=rep.x,
        metric=rep.metric,
        n_key=rep.frontier[0],
        bp_key=rep.frontier[1],
        group_by=GROUP,
        n_boot=rep.n_boot,
    )
    runs = sum(s.runs for s in study.splits.values())
    write_iso_study(study, out, **_heading(spec, runs), plots=plots)
