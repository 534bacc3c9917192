"""`rl-jax study SPEC --out DIR [--from GRID_DIR]`: a seeded leave-one-out study's report.

With --from, the grid's curves (GRID_DIR/curves.jsonl, written by `rl-jax grid`)
are cut to the columns a study needs and written to DIR/curves.jsonl, small
enough to commit. Then DIR/curves.jsonl is fitted (rl_jax.scaling.analyse_study:
per-seed fits, seed noise, each variant's effect on A and B with intervals,
half-budget extrapolation, the paper's findings from the spec's
`report.paper`) and DIR/study.json, DIR/report.md and DIR/plots/*.png are
written. The same curves give the same report, bit for bit.

Exit status: 0 on success, 2 for unusable input (unknown spec, missing or
malformed curves, a baseline without runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_jax.grid import load_spec
from rl_jax.grid.results import GROUP_KEY as GROUP
from rl_jax.scaling import FitError, analyse_study, curves_from_rows, load_rows, write_study

CURVES = "curves.jsonl"
# Columns kept per evaluation row, besides the axis labels and the report's x and metric.
KEEP = ("run_id", GROUP, "seed", "status", "step", "rollouts", "flops", "generated_tokens")
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
    p.add_argument("--baseline", default="", help="group to compare against (default: spec's)")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    spec = load_spec(a.spec)  # a ConfigError: the CLI shell prints it and exits 2
    rep = spec.report
    out = Path(a.out)
    dest = out / CURVES
    if a.grid_dir:
        src = Path(a.grid_dir) / CURVES
        if not src.is_file():
            print(f"rl-jax study: {src} not found (run `rl-jax grid` first)", file=sys.stderr)
            return 2
        rows = compact_rows(load_rows(src), [ax.name for ax in spec.axes], rep.x, rep.metric)
        out.mkdir(parents=True, exist_ok=True)
        dest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    if not dest.is_file():
        print(f"rl-jax study: {dest} not found; give --from GRID_DIR", file=sys.stderr)
        return 2
    try:
        curves = curves_from_rows(load_rows(dest), x=rep.x, metric=rep.metric, group_by=GROUP)
        baseline = a.baseline or rep.baseline or curves[0].group
        study = analyse_study(
            curves,
            baseline=baseline,
            paper=dict(rep.paper),
            fraction=rep.fit_fraction,
            n_boot=rep.n_boot,
            r0=rep.r0,
            fit_start=rep.fit_start,
            paired=rep.paired,
        )
    except FitError as e:
        print(f"rl-jax study: {dest}: {e}", file=sys.stderr)
        return 2
    preamble = (
        f"Grid `{spec.name}` ({spec.description or spec.recipe}); {len(curves)} runs. "
        f"Regenerated from this directory's curves.jsonl by `rl-jax study {spec.name} --out DIR`."
    )
    write_study(study, out, title=f"Study: {spec.name}", preamble=preamble, plots=not a.no_plots)
    print(f"wrote {out / 'report.md'} and {out / 'study.json'}")
    return 0
