"""Fit every run and recipe of a set of curve rows, and write the report.

`fit_runs` is the in-process API (the trainer's demo and the grid driver call
it); `write_report` writes DIR/fits.json, DIR/recipes.{md,csv}, DIR/report.md and
the plots. A fit that fails is an entry with an `error` and no numbers; a fit
that should not be trusted has `reliable: false` and its reasons.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.scaling._bootstrap import BOOTSTRAP_KINDS, Bootstrap, bootstrap, bootstrap_runs
from rl_jax.scaling._compare import (
    PAPER_A_TOL,
    check_a_tol,
    md_cell,
    recipe_table_rows,
    table_csv,
    table_markdown,
)
from rl_jax.scaling._curves import Curve, CurveError, curves_from_rows, group_curves
from rl_jax.scaling._early import EarlyDecision, early_decision
from rl_jax.scaling._extrapolate import Extrapolation, extrapolation_check
from rl_jax.scaling._isocompute import Frontier, FrontierError, fit_frontier
from rl_jax.scaling._power import PowerLawFit, fit_power_law
from rl_jax.scaling._sigmoid import (
    FitError,
    SigmoidFit,
    SigmoidOptions,
    _merge_options,
    fit_sigmoid,
    fit_sigmoid_runs,
)

FRONTIER_MODES = ("auto", "on", "off")
# Below this many seeds a bootstrap over runs alone is too coarse (C(2k-1, k) resamples):
# its samples are pooled with a residual bootstrap of the pooled fit.
_MIN_SEEDS_ALONE = 5


@dataclass(frozen=True, kw_only=True, eq=False)
class FitEntry:
    """The fit of one run, or of a recipe's runs pooled."""

    kind: str  # 'run' or 'recipe'
    name: str  # run id, or recipe name
    recipe: str
    run_ids: tuple[str, ...]
    fit: SigmoidFit | None
    boot: Bootstrap | None
    error: str | None
    warnings: tuple[str, ...]
    power_law: PowerLawFit | None = None  # runs only
    extrapolation: Extrapolation | None = None  # runs only
    data_reliable: bool = True  # False when NaN rows were dropped from its runs
    rank: int | None = None

    @property
    def reliable(self) -> bool:
        return self.fit is not None and self.fit.reliable and self.data_reliable

    def to_json(self, *, x: str, metric: str) -> dict[str, Any]:
        d: dict[str, Any] = {
            "run_id": self.name,
            "kind": self.kind,
            "recipe": self.recipe,
            "run_ids": list(self.run_ids),
            "x": x,
            "metric": metric,
            "rank": self.rank,
            "reliable": self.reliable,
            "error": self.error,
        }
        f, bs = self.fit, self.boot
        for p in ("R0", "A", "B", "C_mid"):
            d[p] = None if f is None else getattr(f, p)
            d[f"{p}_interval"] = None if bs is None else list(bs.interval(p))
        d["interval_level"] = None if bs is None else bs.level
        d["interval_kind"] = None if bs is None else bs.kind
        if f is not None:
            d |= {k: getattr(f, k) for k in ("r2", "rmse", "sigma", "n_points", "method")}
            d |= {"r0_source": f.r0_source, "fit_start": f.options.fit_start}
        d["warnings"] = list(self.warnings) + (list(bs.warnings) if bs is not None else [])
        pl = self.power_law
        pl_keys = ("A", "B", "D", "r2", "rmse", "reliable", "warnings")
        d["power_law"] = None if pl is None else {k: getattr(pl, k) for k in pl_keys}
        d["extrapolation"] = None if self.extrapolation is None else self.extrapolation.summary()
        return _jsonable(d)


@dataclass(frozen=True, kw_only=True, eq=False)
class FitReport:
    x: str
    metric: str
    settings: dict[str, Any]
    curves: tuple[Curve, ...] = field(repr=False)
    entries: tuple[FitEntry, ...]
    recipes: dict[str, FitEntry]  # recipe -> the entry that stands for it in the table
    table: list[dict]
    early: EarlyDecision | None
    early_note: str | None
    frontier: Frontier | None
    frontier_note: str | None

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json(x=self.x, metric=self.metric) for e in self.entries]


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(t) for k, t in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(t) for t in v]
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None  # JSON has no NaN
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    return v


def parse_fit_start(value: float | str | None, x_max: float) -> float | None:
    """An absolute compute, or 'P%' of the run's last compute (e.g. '10%')."""
    if value is None:
        return None
    if not isinstance(value, str):
        value = float(value)
        if not math.isfinite(value):
            raise FitError(f"fit_start={value!r} must be a finite number")
        return value
    v = value.strip()
    percent = v.endswith("%")
    try:
        number = float(v[:-1] if percent else v)
    except ValueError:
        raise FitError(f"fit_start={value!r}: use a number or a percentage") from None
    if not math.isfinite(number):
        raise FitError(f"fit_start={value!r} must be a finite number or percentage")
    if not percent:
        return number
    frac = number / 100
    if not 0 <= frac < 1:
        raise FitError(f"fit_start={value!r}: percentage must be in [0, 100)")
    return frac * x_max


def _check_choices(
    bootstrap_kind: str, frontier: str, extrapolate: float | None, a_tol: float, fit_start
) -> None:
    check_a_tol(a_tol)
    parse_fit_start(fit_start, 1.0)  # its form; a percentage is of each run's compute
    if bootstrap_kind not in BOOTSTRAP_KINDS:
        raise FitError(f"unknown bootstrap kind {bootstrap_kind!r}; known: {BOOTSTRAP_KINDS}")
    if frontier not in FRONTIER_MODES:
        raise FitError(f"frontier={frontier!r}: use one of {FRONTIER_MODES}")
    if extrapolate is not None and not 0 < extrapolate < 1:
        raise FitError(f"extrapolate={extrapolate!r} must be a fraction in (0, 1) or None")


def _fit_settings(base, fit_start, bootstrap_kind, n_boot, level, extrapolate, a_tol) -> dict:
    """The fit's settings as the report records them (explicit grids are not spelled out)."""
    return {
        "method": base.method,
        "r0": base.r0,
        "fit_start": fit_start,
        "a_grid": base.a_grid if isinstance(base.a_grid, str) else "explicit",
        "c_mid_grid": base.c_mid_grid if isinstance(base.c_mid_grid, str) else "explicit",
        "metric_range": list(base.metric_range),
        "bootstrap": bootstrap_kind,
        "n_boot": n_boot,
        "level": level,
        "extrapolate": extrapolate,
        "a_tol": a_tol,
    }


def _fit_groups(curves, base, fit_start, n_boot, level, bootstrap_kind, extrapolate, seed):
    """(every run's and pooled recipe's entry, {recipe: its entry}): a recipe of one run is
    that run's fit; a recipe of several gets a pooled fit beside its runs'."""
    entries: list[FitEntry] = []
    recipes: dict[str, FitEntry] = {}
    for i, (recipe, runs) in enumerate(group_curves(curves).items()):
        run_entries = [
            _fit_run(c, base, fit_start, n_boot, level, bootstrap_kind, extrapolate, seed + 7 * i)
            for c in runs
        ]
        entries.extend(run_entries)
        if len(runs) == 1:
            recipes[recipe] = run_entries[0]
        else:
            e = _fit_recipe(recipe, runs, base, fit_start, n_boot, level, bootstrap_kind, seed + i)
            entries.append(e)
            recipes[recipe] = e
    return entries, recipes


def _ranked_table(entries, recipes, ok, *, a_tol: float) -> list[dict[str, Any]]:
    """The recipe table of the fitted recipes `ok`; writes each one's rank into its entry
    (in `entries` and `recipes` both)."""
    table = recipe_table_rows(
        {k: e.fit for k, e in ok.items()},
        {k: e.boot for k, e in ok.items()},
        runs={k: len(e.run_ids) for k, e in ok.items()},
        a_tol=a_tol,
    )
    for row in table:
        e = recipes[row["recipe"]]
        idx = next(j for j, t in enumerate(entries) if t is e)
        entries[idx] = recipes[row["recipe"]] = dataclasses.replace(e, rank=row["rank"])
        row["reliable"] = entries[idx].reliable
    return table


def _frontier_or_note(curves, frontier: str, n_key: str, bp_key: str, metric_range):
    """(the IsoCompute frontier, None) or (None, why there is none); "on" raises instead."""
    if frontier == "off":
        return None, "not requested"
    try:
        return fit_frontier(curves, n_key=n_key, bp_key=bp_key, metric_range=metric_range), None
    except (FrontierError, CurveError) as e:
        if frontier == "on":
            raise
        return None, str(e)


def fit_runs(
    rows: Sequence[Mapping[str, Any]] | Sequence[Curve],
    *,
    x: str = "flops",
    metric: str = "val/pass@1",
    group_by: str | None = "recipe",
    fit_start: float | str | None = None,
    n_boot: int = 200,
    level: float = 0.95,
    bootstrap_kind: str = "residual",
    extrapolate: float | None = 0.5,
    a_tol: float = PAPER_A_TOL,
    stop_threshold: float = 0.05,
    frontier: str = "auto",
    n_key: str = "sampling.n",
    bp_key: str = "data.prompts_per_batch",
    seed: int = 0,
    **sigmoid_kwargs,
) -> FitReport:
    """Fit every run and recipe in `rows` (curve rows, or Curves from curves_from_rows).

    sigmoid_kwargs are SigmoidOptions fields (r0, method, a_grid, c_mid_grid, metric_range,
    ...). A recipe with several runs (seeds) gets a pooled fit with a bootstrap over runs.
    """
    _check_choices(bootstrap_kind, frontier, extrapolate, a_tol, fit_start)
    base = _merge_options(None, **sigmoid_kwargs)
    if rows and isinstance(rows[0], Curve):
        curves = list(rows)
    else:
        curves = curves_from_rows(rows, x=x, metric=metric, group_by=group_by)
    settings = {"x": x, "metric": metric, "group_by": group_by}
    settings |= _fit_settings(base, fit_start, bootstrap_kind, n_boot, level, extrapolate, a_tol)
    entries, recipes = _fit_groups(
        curves, base, fit_start, n_boot, level, bootstrap_kind, extrapolate, seed
    )
    ok = {k: e for k, e in recipes.items() if e.fit is not None}
    table = _ranked_table(entries, recipes, ok, a_tol=a_tol)
    early, early_note = None, None
    with_boot = {k: e.boot for k, e in ok.items() if e.boot is not None}
    if len(with_boot) >= 2:
        early = early_decision(with_boot, threshold=stop_threshold, seed=seed)
    else:
        early_note = f"needs two fitted recipes with intervals; have {len(with_boot)}"
    fr, fr_note = _frontier_or_note(curves, frontier, n_key, bp_key, base.metric_range)
    return FitReport(
        x=x,
        metric=metric,
        settings=settings,
        curves=tuple(curves),
        entries=tuple(entries),
        recipes=recipes,
        table=table,
        early=early,
        early_note=early_note,
        frontier=fr,
        frontier_note=fr_note,
    )


def _options_for(base: SigmoidOptions, fit_start, x_max: float) -> SigmoidOptions:
    return dataclasses.replace(base, fit_start=parse_fit_start(fit_start, x_max))


def _fit_run(c: Curve, base, fit_start, n_boot, level, kind, extrapolate, seed) -> FitEntry:
    opts = _options_for(base, fit_start, float(c.x.max()))
    warnings = list(c.warnings)
    fit = boot = pl = ext = None
    error = None
    try:
        fit = fit_sigmoid(c.x, c.y, options=opts)
        boot = _bootstrap_or_note(fit, kind, n_boot, level, seed, warnings)
    except FitError as e:
        error = str(e)
    try:
        pl = fit_power_law(c.x, c.y, metric_range=opts.metric_range, fit_start=opts.fit_start)
    except FitError as e:
        warnings.append(f"power law: {e}")
    if fit is not None and extrapolate is not None:
        try:
            ext = extrapolation_check(
                c.x,
                c.y,
                fraction=extrapolate,
                n_boot=n_boot,
                level=level,
                kind=kind,
                seed=seed,
                options=opts,
            )
        except FitError as e:
            warnings.append(f"extrapolation check skipped: {e}")
    return FitEntry(
        kind="run",
        name=c.run_id,
        recipe=c.group,
        run_ids=(c.run_id,),
        fit=fit,
        boot=boot,
        power_law=pl,
        extrapolation=ext,
        error=error,
        warnings=tuple(warnings),
        data_reliable=c.reliable,
    )


def _bootstrap_or_note(fit, kind, n_boot, level, seed, warnings) -> Bootstrap | None:
    try:
        return bootstrap(fit, kind=kind, n_boot=n_boot, level=level, seed=seed)
    except FitError as e:
        warnings.append(f"no intervals: {e}")
        return None


def _fit_recipe(recipe, runs, base, fit_start, n_boot, level, kind, seed) -> FitEntry:
    x_max = max(float(c.x.max()) for c in runs)
    opts = _options_for(base, fit_start, x_max)
    warnings = [w for c in runs for w in c.warnings]
    pairs = [(c.x, c.y) for c in runs]
    fit = boot = None
    error = None
    try:
        fit = fit_sigmoid_runs(pairs, options=opts)
        seeds = bootstrap_runs(pairs, fit, n_boot=n_boot, level=level, seed=seed)
        if len(runs) >= _MIN_SEEDS_ALONE:
            boot = seeds
        else:
            # Few seeds: pool the seed resamples with residual resamples of the pooled fit, so
            # the interval reflects both run-to-run spread and evaluation noise.
            res = bootstrap(fit, kind=kind, n_boot=n_boot, level=level, seed=seed + 1)
            both = {k: np.concatenate([seeds.samples[k], res.samples[k]]) for k in res.samples}
            boot = dataclasses.replace(seeds, kind=f"runs+{kind}", samples=both)
    except FitError as e:
        if fit is None:
            error = str(e)
        else:
            warnings.append(f"no intervals: {e}")
    return FitEntry(
        kind="recipe",
        name=recipe,
        recipe=recipe,
        run_ids=tuple(c.run_id for c in runs),
        fit=fit,
        boot=boot,
        error=error,
        warnings=tuple(warnings),
        data_reliable=all(c.reliable for c in runs),
    )


# --------------------------------------------------------------------------- writing


def _f(v, digits=3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, np.integer)):
        return str(v)
    v = float(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def _ci(lo_hi: tuple[float, float] | None) -> str:
    """An interval as [lo, hi] in _f's format; "-" for None (no interval)."""
    if lo_hi is None:
        return "-"
    lo, hi = lo_hi
    return f"[{_f(lo)}, {_f(hi)}]"


def _signed(v, digits=3) -> str:
    return "-" if v is None or not np.isfinite(v) else f"{v:+.{digits}f}"


def _json_text(obj) -> str:
    return json.dumps(_jsonable(obj), indent=2) + "\n"


def write_texts(out_dir: str | Path, texts: Mapping[str, str]) -> list[Path]:
    """Write each {file name: text} atomically into out_dir (created); their paths."""
    from rl_jax.runs.atomic import atomic_write_text  # light module, no JAX

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        atomic_write_text(out / name, text)
    return [out / name for name in texts]


def write_report(report: FitReport, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write fits.json, recipes.md/.csv, report.md (and JSON for the early decision and the
    iso-compute analysis when present) plus PNG/SVG plots under out_dir/plots."""
    out = Path(out_dir)
    texts = {
        "fits.json": _json_text(report.to_json()),
        "recipes.csv": table_csv(report.table),
        "recipes.md": table_markdown(report.table),
    }
    if report.early is not None:
        texts["early_decision.json"] = _json_text(report.early.to_dict())
    if report.frontier is not None:
        texts["isocompute.json"] = _json_text(report.frontier.summary())
    written = write_texts(out, texts)
    plot_files: dict[str, list[Path]] = {}
    if plots:
        plot_files = _write_plots(report, out / "plots")
        written.extend(p for ps in plot_files.values() for p in ps)
    return written + write_texts(out, {"report.md": _markdown(report, plot_files, out)})


def _write_plots(report: FitReport, pdir: Path) -> dict[str, list[Path]]:
    from rl_jax.scaling._plots import (
        plot_curves,
        plot_extrapolation,
        plot_frontier,
        plot_heatmaps,
        plot_n_star,
        recipe_plot,
        safe_names,
    )

    by_run = {c.run_id: c for c in report.curves}
    files: dict[str, list[Path]] = {}
    items = [recipe_plot(report, recipe) for recipe in report.recipes]
    if items:
        files["curves"] = plot_curves(
            items, pdir / "curves", x_label=report.x, y_label=report.metric, title="fitted curves"
        )
    stems = safe_names(e.name for e in report.entries if e.extrapolation is not None)
    for e in report.entries:
        if e.extrapolation is not None:
            c = by_run[e.name]
            files[f"extrapolation:{e.name}"] = plot_extrapolation(
                e.extrapolation,
                c.x,
                c.y,
                pdir / f"extrapolation_{stems[e.name]}",
                x_label=report.x,
                y_label=report.metric,
            )
    fr = report.frontier
    if fr is not None:
        files["frontier"] = plot_frontier(fr, pdir / "frontier", x_label=report.x)
        if fr.budgets:
            files["heatmap"] = plot_heatmaps(fr, pdir / "frontier_heatmap", y_label=report.metric)
        files["n_star"] = plot_n_star(fr, pdir / "n_star", x_label=report.x)
    return files


def _img(files: dict[str, list[Path]], key: str, out: Path) -> str:
    ps = files.get(key)
    if not ps:
        return ""
    png = next(p for p in ps if p.suffix == ".png")
    return f"![{md_cell(key)}]({png.relative_to(out).as_posix()})\n"


def _markdown(rep: FitReport, files: dict[str, list[Path]], out: Path) -> str:
    s = rep.settings
    lines = [
        "# Scaling-curve fits",
        "",
        f"x = `{rep.x}`, metric = `{rep.metric}`; sigmoid R(C) = R0 + (A - R0) / "
        f"(1 + (C_mid / C)^B), method `{s['method']}`, R0 `{s['r0']}`, fit start "
        f"`{s['fit_start']}`, A/C_mid grids `{s['a_grid']}`/`{s['c_mid_grid']}`. "
        f"Intervals: {s['level']:.0%} percentile, `{s['bootstrap']}` bootstrap, "
        f"{s['n_boot']} resamples (recipes with several runs: over runs too).",
        "",
        "## Recipes",
        "",
        f"Ranked by the ScaleRL rule: A within {s['a_tol']:g} counts as equal (one tier); "
        "within a tier, recipes are refitted at the tier's mean A and ranked by B.",
        "",
        table_markdown(rep.table) if rep.table else "No recipe could be fitted.\n",
        _img(files, "curves", out),
        "## Fits",
        "",
        "| run / recipe | kind | points | R0 | A | A interval | B | B interval | C_mid | "
        "C_mid interval | R^2 | reliable |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += _fits_rows(rep)
    lines += ["", "## Errors and warnings", ""]
    lines += _problems(rep)
    lines += [
        "",
        "## Sigmoid versus power law (R = A - D / C^B)",
        "",
        "| run | sigmoid A | sigmoid R^2 | power-law A | power-law B | power-law R^2 | note |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _power_law_rows(rep)
    lines += ["", "## Extrapolation checks", ""]
    lines += _extrapolation_md(rep, files, out)
    lines += ["", "## Early decision", ""]
    lines += _early_md(rep)
    lines += ["", "## Iso-compute analysis", ""]
    fr = rep.frontier
    if fr is None:
        lines.append(f"Not computed: {rep.frontier_note}.")
    else:
        lines += _frontier_md(fr, files, out)
    return "\n".join(lines) + "\n"


def _fits_rows(rep: FitReport) -> list[str]:
    lines = []
    for e in rep.entries:
        f, bs = e.fit, e.boot
        if f is None:
            lines.append(
                f"| {md_cell(e.name)} | {e.kind} | - | - | - | - | - | - | - | - | - | ERROR |"
            )
            continue
        ci = {p: _ci(bs.interval(p) if bs is not None else None) for p in ("A", "B", "C_mid")}
        lines.append(
            f"| {md_cell(e.name)} | {e.kind} | {f.n_points} | {_f(f.R0)} | {_f(f.A)} | {ci['A']} | "
            f"{_f(f.B, 2)} | {ci['B']} | {_f(f.C_mid)} | {ci['C_mid']} | {_f(f.r2)} | "
            f"{_f(e.reliable)} |"
        )
    return lines


def _problems(rep: FitReport) -> list[str]:
    """Every entry's error and warnings (its own, its fit's, its bootstrap's), or "None."."""
    problems = [
        (e, w)
        for e in rep.entries
        for w in ([e.error] if e.error else [])
        + list(e.warnings)
        + (list(e.fit.warnings) if e.fit is not None else [])
        + (list(e.boot.warnings) if e.boot is not None else [])
    ]
    return [f"- **{md_cell(e.name)}**: {md_cell(w)}" for e, w in problems] or ["None."]


def _power_law_rows(rep: FitReport) -> list[str]:
    lines = []
    for e in rep.entries:
        if e.kind != "run" or e.fit is None or e.power_law is None:
            continue
        pl = e.power_law
        lines.append(
            f"| {md_cell(e.name)} | {_f(e.fit.A)} | {_f(e.fit.r2)} | {_f(pl.A)} | {_f(pl.B)} | "
            f"{_f(pl.r2)} | {md_cell('; '.join(pl.warnings) or '-')} |"
        )
    return lines


def _extrapolation_md(rep: FitReport, files, out) -> list[str]:
    s = rep.settings
    exts = [e for e in rep.entries if e.extrapolation is not None]
    if not exts:
        return [f"None (extrapolate = {s['extrapolate']})."]
    lvl = f"{s['level']:.0%}"
    lines = [
        f"Fit on compute up to {s['extrapolate']:.0%} of each run, predict the rest. "
        f"'inside' = held-out evaluations within the {lvl} predictive interval.",
        "",
        "| run | points fitted / held out | A (partial fit) | A interval | A (full) | "
        "final error | final inside | inside | RMSE | power-law RMSE |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in exts:
        x = e.extrapolation
        sm = x.summary()
        lines.append(
            f"| {md_cell(e.name)} | {sm['n_fit']} / {sm['n_test']} | {_f(x.fit.A)} | "
            f"{_ci(x.boot.interval('A'))} | {_f(e.fit.A)} | {x.final_error:+.4f} | "
            f"{_f(x.final_within)} | {x.coverage:.0%} | {_f(x.rmse, 4)} | "
            f"{_f(x.power_law_rmse, 4)} |"
        )
    lines.append("")
    lines += [_img(files, f"extrapolation:{e.name}", out) for e in exts]
    return lines


def _early_md(rep: FitReport) -> list[str]:
    if rep.early is None:
        return [f"Not computed: {rep.early_note}."]
    ed = rep.early
    lines = [
        f"Leader: **{ed.leader}**. P(beats leader) = P(A > A_leader + {ed.margin:g}) from "
        f"independent bootstrap distributions; stop when below {ed.threshold:g}.",
        "",
        "| recipe | A | A interval | P(beats leader) | P(best) | stop | reliable fit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ed.rows:
        pb = "leader" if r.p_beats_leader is None else f"{r.p_beats_leader:.3f}"
        lines.append(
            f"| {md_cell(r.name)} | {_f(r.A)} | {_ci(r.A_interval)} | "
            f"{pb} | {r.p_best:.3f} | {'STOP' if r.stop else 'continue'} | "
            f"{_f(r.reliable)} |"
        )
    return lines


def _frontier_md(fr: Frontier, files, out) -> list[str]:
    lines = [
        f"Runs over `{fr.n_key}` = {[f'{v:g}' for v in fr.n_values]} and `{fr.bp_key}` = "
        f"{[f'{v:g}' for v in fr.bp_values]}. Per n: record-breaking points, a monotone sigmoid; "
        "the frontier is their upper envelope (each n over the compute its runs reached).",
        "",
        "| n | A | B | C_mid | R0 | reliable |",
        "|---|---|---|---|---|---|",
    ]
    for n in fr.n_values:
        f = fr.fits.get(n)
        if f is None:
            lines.append(f"| {n:g} | - | - | - | - | {fr.fit_errors.get(n)} |")
        else:
            lines.append(
                f"| {n:g} | {_f(f.A)} | {_f(f.B, 2)} | {_f(f.C_mid)} | {_f(f.R0)} | "
                f"{_f(f.reliable)} |"
            )
    nf = fr.n_star_fit
    lines.append("")
    if nf is None:
        lines.append(f"n*(C): no fit ({fr.n_star_note}).")
    else:
        lines.append(
            f"n*(C): log2 n* = {nf.R0:.2f} + ({nf.A:.2f} - {nf.R0:.2f}) / "
            f"(1 + ({nf.C_mid:.3g} / C)^{nf.B:.2f}), i.e. n* from {2**nf.R0:.3g} to "
            f"{2**nf.A:.3g}; {fr.n_star_note}."
        )
    lines += [
        "",
        "Sensitivity (mean reward range across n at fixed B_p, and across B_p at fixed n):",
        "",
        "| budget | range over n | range over B_p | relative over n | relative over B_p | "
        "runs reaching it |",
        "|---|---|---|---|---|---|",
    ]
    for r in fr.sensitivity:
        lines.append(
            f"| {r['budget']:.3g} | {_f(r['reward_range_over_n'])} | "
            f"{_f(r['reward_range_over_bp'])} | {_pct(r['relative_over_n'])} | "
            f"{_pct(r['relative_over_bp'])} | {r['runs_covering']} |"
        )
    if fr.warnings:
        lines += ["", *[f"- {w}" for w in fr.warnings]]
    lines += ["", _img(files, "frontier", out), _img(files, "heatmap", out)]
    lines.append(_img(files, "n_star", out))
    return lines


def _pct(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.1%}"
