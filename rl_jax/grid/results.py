"""A grid's results: every curve row in one table, fitted by rl_jax.scaling, and report.md.

Outputs under the grid directory:
- curves.jsonl: every curve row of every run, plus grid, run_name, group (the
  axis labels without the seed: the "recipe" whose seeds are pooled), seed,
  status and one column per axis (its point label);
- fits/<split>/: rl_jax.scaling's full report of those rows (fits with
  bootstrap intervals, the recipe table by the paper's rule, extrapolation
  checks, power-law comparison, early decision, iso-compute frontier, plots);
  one per point of `report.split_by` (e.g. easy and hard), else fits/all/;
- report.md: run status and attempts, early stops, and per split the recipe
  table, the curves, and for iso-compute grids the heat map, the frontier and
  the fitted n*(C).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_jax import scaling
from rl_jax.grid.driver import run_dir, run_status
from rl_jax.grid.expand import RunPlan
from rl_jax.grid.spec import GridSpec
from rl_jax.grid.state import GridState
from rl_jax.knobs import ConfigError
from rl_jax.runs.atomic import atomic_write_text, read_jsonl
from rl_jax.runs.storage import is_remote, join, open_store

FITS_DIR = "fits"
GROUP_KEY = "group"  # the column scaling groups runs by (seeds of one axis point pooled)


# ---- gathering --------------------------------------------------------------------------


def gather(
    spec: GridSpec, plans: Sequence[RunPlan], root: str, runs: str, status: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Every curve row of the grid, labelled, in plan order; written to curves.jsonl.
    `runs`: where the runs' directories are (Backend.runs_root); `status`: each run id's
    (driver.run_status). A damaged curve file is a ConfigError naming it and its line."""
    out = []
    for p in plans:
        extra = {
            "grid": spec.name,
            "run_name": p.name,
            GROUP_KEY: p.group,
            "seed": p.seed,
            "status": status[p.run_id],
            **dict(p.labels),
        }
        try:
            curve = read_jsonl(join(run_dir(runs, p), "curve.jsonl"))
        except ValueError as e:  # a bad line before the last: rows that cannot be read
            raise ConfigError(
                f"{e}; run {p.name}'s curve is damaged: restore the file, or remove the run's"
                " directory to run it again"
            ) from None
        for row in curve:
            out.append({**row, **extra, "run_id": p.run_id})
    text = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in out)
    open_store(root).write_text("curves.jsonl", text)
    return out


def split_of(spec: GridSpec, plan: RunPlan) -> str:
    """The point of `report.split_by` a run belongs to ('all' without one)."""
    return dict(plan.labels)[spec.report.split_by] if spec.report.split_by else "all"


def _rows_by_split(spec: GridSpec, plans: Sequence[RunPlan], rows: list[dict]):
    split = {p.run_id: split_of(spec, p) for p in plans}
    by_split: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_split[split[r["run_id"]]].append(r)
    return {name: by_split.get(name, []) for name in dict.fromkeys(split.values())}


def _fit_options(spec: GridSpec) -> dict[str, Any]:
    r = spec.report
    return dict(
        x=r.x,
        group_by=GROUP_KEY,
        extrapolate=r.fit_fraction,
        n_boot=r.n_boot,
        fit_start=r.fit_start,
        r0=r.r0,
        stop_threshold=spec.early_stop.threshold if spec.early_stop else 0.05,
        frontier="auto" if r.kind == "isocompute" else "off",
        n_key=r.frontier[0],
        bp_key=r.frontier[1],
    )


def fit_grid(spec: GridSpec, plans: Sequence[RunPlan], rows: list[dict]):
    """{split: (scaling.FitReport or None, note)} for the grid's rows."""
    out: dict[str, tuple[Any, str]] = {}
    opts = _fit_options(spec)
    for name, subset in _rows_by_split(spec, plans, rows).items():
        if not subset:
            out[name] = (None, "no curve rows yet")
            continue
        try:
            out[name] = (scaling.fit_runs(subset, metric=spec.report.metric, **opts), "")
        except scaling.FitError as e:
            out[name] = (None, str(e))
    return out


def fit_grid_tasks(spec: GridSpec, plans: Sequence[RunPlan], rows: list[dict]):
    """{split: {task: scaling.FitReport or why not}} for grids of task mixtures (rows with
    val/<task>/... columns of the report's metric); splits without tasks left out."""
    out = {}
    for name, subset in _rows_by_split(spec, plans, rows).items():
        opts = {**_fit_options(spec), "frontier": "off"}
        tasks = scaling.fit_tasks(subset, metric=spec.report.metric, **opts)
        if tasks:
            out[name] = tasks
    return out


# ---- early stopping ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """What the early-stop check needs of a run: its group, its split, its planned steps."""

    group: str
    split: str
    steps: int


def early_stopper(spec: GridSpec, plans: Sequence[RunPlan]):
    """The driver's early-stop check (`early_check` over the grid's plans)."""
    check = early_check(
        spec, {p.run_id: RunInfo(p.group, split_of(spec, p), p.steps) for p in plans}
    )

    def on_plans(curves: dict[str, list[dict]], running: Sequence[RunPlan]) -> dict[str, dict]:
        return check(curves, [p.run_id for p in running])

    return on_plans


def early_check(spec: GridSpec, runs: Mapping[str, RunInfo]):
    """check(curves, running ids) -> {run id: why to stop it}, by rl_jax.scaling's decisions.

    Per split, each group (an axis point, its seeds pooled) whose runs have at least
    `min_points` evaluations is fitted and bootstrapped. An iso-compute grid stops groups
    whose probability of reaching the frontier in the compute they have left is below
    `threshold` (`scaling.reach_decision`); other grids, groups whose P(A > the leader's A)
    is (`scaling.early_decision`). Runs of a flagged group stop once they have done
    `min_fraction` of their steps. Fits are cached on the rows they saw: a check refits only
    the groups that have a new evaluation.
    """
    es = spec.early_stop
    assert es is not None
    rep = spec.report
    cache: dict[str, tuple] = {}  # group -> (evaluations seen, its bootstrap or None)

    def check(curves: dict[str, list[dict]], running: Sequence[str]) -> dict[str, dict]:
        groups = _early_groups(spec, runs, curves)
        stop_groups: dict[str, dict] = {}
        for gs in groups.values():
            boots = {g: _boot(rep, cache, g, members) for g, members in gs.items()}
            boots = {g: b for g, b in boots.items() if b is not None}
            if len(boots) < 2:
                continue
            if rep.kind == "isocompute":
                stop_groups.update(_reach_stops(es, runs, gs, boots, set(running), rep.x))
            else:
                stop_groups.update(_leader_stops(es, boots))
        out = {}
        for rid in running:
            info = stop_groups.get(runs[rid].group)
            step = max((r.get("step", 0) for r in curves.get(rid, [])), default=0)
            if info is not None and step >= es.min_fraction * runs[rid].steps:
                out[rid] = {**info, "step": step}
        return out

    return check


def _early_groups(spec: GridSpec, runs: Mapping[str, RunInfo], curves: dict[str, list[dict]]):
    """{split: {group: [(run id, xs, ys, steps)]}} of runs with `min_points` evaluations."""
    x, metric = spec.report.x, spec.report.metric
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for rid, rows in curves.items():
        rows = evaluations(rows, x, metric)
        if len(rows) < spec.early_stop.min_points or rid not in runs:
            continue
        xs = [float(r[x]) for r in rows]
        ys = [float(r[metric]) for r in rows]
        steps = [int(r.get("step", 0)) for r in rows]
        groups[runs[rid].split][runs[rid].group].append((rid, xs, ys, steps))
    return groups


def _boot(rep, cache: dict, group: str, members: list):
    """The group's pooled fit, bootstrapped; None when it cannot be fitted yet. The cache
    keeps each group's latest fit with the evaluations it saw."""
    seen = tuple((rid, len(xs)) for rid, xs, _, _ in members)
    if group in cache and cache[group][0] == seen:
        return cache[group][1]
    pairs = [(xs, ys) for _, xs, ys, _ in members]
    x_max = max(max(xs) for xs, _ in pairs)
    opts = {"r0": rep.r0, "fit_start": scaling.parse_fit_start(rep.fit_start, x_max)}
    try:
        f = (
            scaling.fit_sigmoid_runs(pairs, **opts)
            if len(pairs) > 1
            else scaling.fit_sigmoid(*pairs[0], **opts)
        )
        boot = scaling.bootstrap(f, n_boot=100)
    except scaling.FitError:
        boot = None
    cache[group] = (seen, boot)
    return boot


def _leader_stops(es, boots: dict) -> dict[str, dict]:
    ed = scaling.early_decision(boots, threshold=es.threshold)
    lead = next(r for r in ed.rows if r.name == ed.leader)
    return {
        row.name: {
            "reason": (
                f"P(A > leader's) = {row.p_beats_leader:.3f} < {es.threshold}:"
                f" A = {row.A:.3f} vs {lead.A:.3f} of {ed.leader}"
            ),
            "p": row.p_beats_leader,
            "A": row.A,
            "leader": ed.leader,
            "leader_A": lead.A,
        }
        for row in ed.rows
        if row.stop
    }


def _reach_stops(es, runs, gs: dict, boots: dict, running: set[str], x: str) -> dict[str, dict]:
    """Groups of an iso-compute split that will not reach the frontier of the others.

    A group's future starts where its least advanced running run is (a finished seed does not
    make the others' compute free) and ends at its planned steps times its compute per step."""
    progress = {}
    for g, bs in boots.items():
        members = gs[g]
        first = min(min((v for v in xs if v > 0), default=math.inf) for _, xs, _, _ in members)
        live = [xs[-1] for rid, xs, _, _ in members if rid in running]
        reached = min(live) if live else max(xs[-1] for _, xs, _, _ in members)
        per_step = [xs[-1] / st[-1] for _, xs, _, st in members if st[-1] > 0]
        planned = max(runs[rid].steps for rid, _, _, _ in members)
        end = max(planned * max(per_step), reached) if per_step else reached
        gaps = [b - a for _, xs, _, _ in members for a, b in zip(xs, xs[1:], strict=False)]
        every = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
        if math.isfinite(first):
            progress[g] = scaling.Progress(
                fit=bs, first=first, reached=reached, end=end, every=every
            )
    if len(progress) < 2:
        return {}
    rd = scaling.reach_decision(progress, threshold=es.threshold)
    out = {}
    for row in rd.rows:
        if not row.stop:
            continue
        lead = _frontier_at(progress, row.name, row.end)
        out[row.name] = {
            "reason": (
                f"P(reaching the frontier in the {row.end - row.reached:.4g} {x} left)"
                f" = {row.p_reach:.3f} < {es.threshold}; at its end {lead} holds it"
            ),
            "p": row.p_reach,
            "reached": row.reached,
            "end": row.end,
            "leader": lead,
        }
    return out


def _frontier_at(progress: dict, name: str, c: float) -> str:
    """The other group whose measured curve (held past its reach) is highest at compute c."""
    fits = {
        g: float(p.fit.fit.predict(min(c, p.reached)))
        for g, p in progress.items()
        if g != name and p.first <= c
    }
    return max(fits, key=fits.get) if fits else ""


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def evaluations(rows: Sequence[Mapping[str, Any]], *keys: str) -> list:
    """The rows with a finite number in each of `keys` (an evaluation's x and metric), in
    step order; one whose step is not a number is a ConfigError naming its run."""
    out = [r for r in rows if all(_finite(r.get(k)) for k in keys)]
    for r in out:
        if not _finite(r.get("step", 0)):
            raise ConfigError(
                f"a curve row of run {r.get('run_id', '?')} has step={r.get('step')!r}, not"
                " a number: its curve file is damaged"
            )
    return sorted(out, key=lambda r: r.get("step", 0))


# ---- report -----------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return "-" if v is None else str(v)


def _img(root: Path, path: Path, alt: str) -> str:
    return f"![{alt}]({path.relative_to(root).as_posix()})" if path.exists() else ""


def write_report(
    spec: GridSpec, plans: Sequence[RunPlan], root: str, runs: str | None = None
) -> str:
    """Gather the curves, fit them with rl_jax.scaling and write <root>/report.md (for
    a grid in a bucket: written locally, then uploaded with its fits and plots)."""
    if not is_remote(root):
        return str(_write_report(spec, plans, root, runs, Path(root)))
    with tempfile.TemporaryDirectory() as tmp:
        _write_report(spec, plans, root, runs, Path(tmp))
        open_store(root).upload_tree(Path(tmp))
    return join(root, "report.md")


def _write_report(spec, plans, root: str, runs: str | None, local: Path) -> Path:
    runs = runs or join(root, "runs")
    st = GridState.load(root, spec.name, plans)
    status = {p.run_id: run_status(st, runs, p) for p in plans}
    rows = gather(spec, plans, root, runs, status)
    x, metric = spec.report.x, spec.report.metric
    per_run: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        per_run[r["run_id"]].append(r)
    md = [f"# Grid {spec.name}", ""]
    if spec.description:
        md += [spec.description, ""]
    b = spec.budget
    md += [
        f"Recipe `{spec.recipe}`, {len(plans)} runs"
        + (f", budget {b.amount:g} {b.unit} per run" if b else "")
        + f". Metric `{metric}` against `{x}`. Every curve row: `curves.jsonl`; full fits"
        f" (intervals, extrapolation checks, power law, early decision): `{FITS_DIR}/`.",
        "",
        "## Runs",
        "",
        f"| run | status | steps | launches | last {metric} | {x} |",
        "|---|---|---|---|---|---|",
    ]
    for p in plans:
        rec = st.runs.get(p.run_id)
        evals = evaluations(per_run.get(p.run_id, []), metric)
        last = evals[-1] if evals else {}
        launches = rec.launches if rec else 0
        md.append(
            f"| {p.name} | {status[p.run_id]} | {p.steps} | {launches} | {_fmt(last.get(metric))} |"
            f" {_fmt(last.get(x))} |"
        )
    counts = Counter(status.values())
    md += ["", "Status: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
    stopped = [
        (p, st.runs[p.run_id].stopped)
        for p in plans
        if st.runs.get(p.run_id) and st.runs[p.run_id].stopped
    ]
    if spec.early_stop is not None or stopped:
        md += ["## Early stopping", ""]
        md += [
            f"- {p.name}: stopped at step {s.get('step')}: {s.get('reason')}" for p, s in stopped
        ]
        md += ([] if stopped else ["No run was stopped early."]) + [""]
    names = {p.run_id: p.name for p in plans}
    for split, (rep, note) in fit_grid(spec, plans, rows).items():
        md += _split_section(spec, local, split, rep, note, names)
    for split, tasks in fit_grid_tasks(spec, plans, rows).items():
        md += _tasks_section(spec, local, split, tasks)
    path = local / "report.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def _split_section(spec, root: Path, split: str, rep, note: str, names) -> list[str]:
    title = "Fits" if split == "all" else f"Fits: {spec.report.split_by} = {split}"
    md = [f"## {title}", ""]
    if rep is None:
        return md + [f"No fits: {note}.", ""]
    out = root / FITS_DIR / split
    scaling.write_report(rep, out)
    plots = out / "plots"
    md += [
        f"Details: [{FITS_DIR}/{split}/report.md]({FITS_DIR}/{split}/report.md). Recipes are"
        " the grid's axis points (seeds pooled), ranked by the ScaleRL rule: A within"
        f" {scaling.PAPER_A_TOL:g} is a tie, broken by B refitted at the tier's mean A.",
        "",
        scaling.table_markdown(rep.table) if rep.table else "No recipe could be fitted.",
        _img(root, plots / "curves.png", "fitted curves"),
        "",
    ]
    exts = [e for e in rep.entries if e.extrapolation is not None]
    if exts:
        md += [
            f"Extrapolation: each run fitted on its first {spec.report.fit_fraction:.0%} of"
            " compute, then the rest predicted.",
            "",
            "| run | A (partial fit) | A (all points) | final error | held-out points inside"
            " the interval |",
            "|---|---|---|---|---|",
        ]
        for e in exts:
            ex = e.extrapolation
            md.append(
                f"| {names.get(e.name, e.name)} | {_fmt(ex.fit.A)} | {_fmt(e.fit.A)} |"
                f" {ex.final_error:+.4f} | {ex.coverage:.0%} |"
            )
        md.append("")
    # An iso-compute grid stops runs by the frontier (reach_decision), not by asymptotes: the
    # asymptote comparison would contradict what its driver did.
    if rep.early is not None and spec.report.kind != "isocompute":
        stops = [r.name for r in rep.early.rows if r.stop]
        md += [
            f"Early decision: leader `{rep.early.leader}`; "
            + (
                f"cannot catch it (P < {rep.early.threshold:g}): {stops}."
                if stops
                else "every recipe can still catch it."
            ),
            "",
        ]
    if spec.report.kind == "isocompute":
        md += _frontier_section(root, rep, plots)
    return md


def _tasks_section(spec, root: Path, split: str, tasks: dict) -> list[str]:
    """Each task of a mixture fitted on its own column, as ScaleRL's math + code figure."""
    where = f"{FITS_DIR}/{split}/tasks"
    title = "Per-task fits" + ("" if split == "all" else f": {spec.report.split_by} = {split}")
    for task, rep in tasks.items():
        if not isinstance(rep, str):
            scaling.write_report(rep, root / where / task)
    table = scaling.task_table_markdown(scaling.task_table(tasks), spec.report.x)
    return [f"## {title}", "", f"Each task's full report: `{where}/<task>/`.", "", table, ""]


def _frontier_section(root: Path, rep, plots: Path) -> list[str]:
    fr = rep.frontier
    md = ["### Iso-compute frontier", ""]
    if fr is None:
        return md + [f"Not computed: {rep.frontier_note}.", ""]
    md += [
        f"n = {[f'{v:g}' for v in fr.n_values]}, B_p = {[f'{v:g}' for v in fr.bp_values]}."
        " Per n a sigmoid through the record-breaking points of its runs; the frontier is"
        " their upper envelope, n*(C) its argmax.",
        "",
    ]
    nf = fr.n_star_fit
    if nf is None:
        md.append(f"n*(C): no fit ({fr.n_star_note}).")
    else:
        md.append(
            f"Fitted n*(C): log2 n* = {nf.R0:.2f} + ({nf.A:.2f} - {nf.R0:.2f}) /"
            f" (1 + ({nf.C_mid:.3g} / C)^{nf.B:.2f}): n* from {2**nf.R0:.3g} to {2**nf.A:.3g}"
            f" ({fr.n_star_note})."
        )
    for b in fr.budgets:
        mat = fr.heat[b]
        if not (mat == mat).any():
            continue
        i, j = divmod(int(_nanargmax(mat)), mat.shape[1])
        md.append(
            f"- at {rep.x} = {b:.3g}: best cell n = {fr.n_values[i]:g}, B_p = {fr.bp_values[j]:g}"
            f" ({mat[i, j]:.3f})"
        )
    md += [
        "",
        _img(root, plots / "frontier_heatmap.png", "frontier heat map"),
        _img(root, plots / "frontier.png", "frontier"),
        _img(root, plots / "n_star.png", "n*(C)"),
        "",
    ]
    return md


def _nanargmax(mat) -> int:
    import numpy as np

    return int(np.nanargmax(mat))
