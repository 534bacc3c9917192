"""A seeded leave-one-out study written out: study.json (every number), report.md, plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.scaling._compare import TABLE_COLUMNS, md_cell, table_markdown
from rl_jax.scaling._report import _ci, _f, _json_text, _jsonable, _signed, write_texts
from rl_jax.scaling._study import Effect, Study, mean_curve

# The recipe table's columns without its fit-quality ones (points, R^2).
RECIPE_COLUMNS = tuple(c for c in TABLE_COLUMNS if c not in ("points", "r2"))


def _effect_json(e: Effect) -> dict[str, Any]:
    paired = (
        {
            "paired_seeds": e.paired_seeds,
            "dA_interval_unpaired": list(e.dA_interval_unpaired or ()),
            "dB_interval_unpaired": list(e.dB_interval_unpaired or ()),
        }
        if e.paired_seeds
        else {}
    )
    return {
        "group": e.group,
        "seeds": e.seeds,
        "dA": e.dA,
        "dA_interval": list(e.dA_interval),
        "A_class": e.a_class,
        "A_exceeds_noise": e.a_exceeds_noise,
        "A_common": e.a_common,
        "dB_at_common_A": e.dB,
        "dB_interval": list(e.dB_interval),
        "B_class": e.b_class,
        "B_exceeds_noise": e.b_exceeds_noise,
        "paper": None if e.paper is None else {"A": e.paper.a, "B": e.paper.b},
        "verdict": e.verdict,
        **paired,
    }


def _run_rows(study: Study, of) -> list[dict[str, Any]]:
    """Per run of the study: its group, seed and id, then the dict `of(its SeedFit)`."""
    return [
        {"group": g, "seed": s.seed, "run_id": s.run_id, **of(s)}
        for g, fits in study.seed_fits.items()
        for s in fits
    ]


def _extrapolation_rows(study: Study) -> list[dict[str, Any]]:
    return _run_rows(
        study, lambda s: s.extrapolation.summary() if s.extrapolation is not None else {}
    )


def extrapolation_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "final_error" in r]
    if not done:
        return {"runs": 0}
    err = np.array([r["final_error"] for r in done])
    n_test = np.array([r["n_test"] for r in done])
    inside = np.array([r["coverage"] for r in done]) * n_test
    return {
        "runs": len(done),
        "final_abs_error_median": float(np.median(np.abs(err))),
        "final_abs_error_max": float(np.abs(err).max()),
        "final_within_0.02": int((np.abs(err) <= 0.02).sum()),
        "final_inside_interval": int(sum(r["final_within"] for r in done)),
        "held_out_points": int(n_test.sum()),
        "held_out_inside": float(inside.sum() / n_test.sum()),
    }


def study_json(study: Study) -> dict[str, Any]:
    keys = ("R0", "A", "B", "C_mid", "r2", "reliable")
    runs = _run_rows(study, lambda s: {p: getattr(s.fit, p) for p in keys})
    ext_rows = _extrapolation_rows(study)
    mean = study.baseline_mean
    return _jsonable(
        {
            "baseline": study.baseline,
            **({"paired": True} if study.paired else {}),
            "level": study.level,
            "a_tol": study.a_tol,
            "settings": study.report.settings,
            "recipes": study.report.table,
            "runs": runs,
            "seed_noise": study.noise,
            "effects": [_effect_json(e) for e in study.effects],
            "extrapolation": {"runs": ext_rows, "summary": extrapolation_summary(ext_rows)},
            "baseline_mean_extrapolation": (
                mean.summary() if mean is not None else {"error": study.baseline_mean_note}
            ),
            "notes": study.notes,
        }
    )


def plot_names(study: Study) -> dict[str, str]:
    """Plot key -> its PNG's path under the study directory (drawn or not, the report links
    the same names, so its text does not depend on whether plots were drawn)."""
    from rl_jax.scaling._plots import safe_names

    names = {"recipes": "plots/recipes.png"}
    stems = safe_names(e.group for e in study.effects)
    names.update({f"loo:{g}": f"plots/loo_{s}.png" for g, s in stems.items()})
    if study.baseline_mean is not None:
        names["baseline_mean"] = "plots/baseline_mean_extrapolation.png"
    return names


def _img(names: dict[str, str], key: str) -> list[str]:
    return [f"![{md_cell(key)}]({names[key]})", ""] if key in names else []


def _seed_table(study: Study) -> list[str]:
    lines = [
        "| recipe | seeds | A per seed | sd(A) | B per seed | sd(B) | reliable fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, fits in study.seed_fits.items():
        a = [s.fit.A for s in fits]
        b = [s.fit.B for s in fits]
        sd = (lambda v: _f(float(np.std(v, ddof=1)))) if len(fits) > 1 else (lambda v: "-")
        lines.append(
            f"| {md_cell(g)} | {len(fits)} | {', '.join(_f(v) for v in a)} | {sd(a)} | "
            f"{', '.join(_f(v, 2) for v in b)} | {sd(b)} | "
            f"{sum(s.fit.reliable for s in fits)}/{len(fits)} |"
        )
    return lines


def _effects_table(study: Study) -> list[str]:
    lvl = f"{study.level:.0%}"
    lines = [
        f"| variant | dA ({lvl} interval) | A | dB at common A ({lvl} interval) | B | "
        "paper: A, B | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in study.effects:
        p = e.paper
        paper = "-" if p is None else f"{p.a or '-'}, {p.b or '-'}"
        a_mark = " *" if e.a_exceeds_noise else ""
        b_mark = " *" if e.b_exceeds_noise else ""
        lines.append(
            f"| {md_cell(e.group)} | {_signed(e.dA)}{a_mark} {_ci(e.dA_interval)} | {e.a_class} | "
            f"{_signed(e.dB, 2)}{b_mark} {_ci(e.dB_interval)} | {e.b_class} | {paper} | "
            f"{e.verdict} |"
        )
    notes = [f"- **{md_cell(e.group)}** (paper): {e.paper.note}" for e in study.effects if e.paper]
    return lines + ([""] + notes if notes else [])


def _extrapolation_md(study: Study, summary: dict[str, Any], rows) -> list[str]:
    lvl = f"{study.level:.0%}"
    lines = [
        f"Each run fitted on its first {study.report.settings['extrapolate']:.0%} of compute, "
        f"then asked for the rest. 'inside': held-out evaluations within the {lvl} "
        "predictive interval (curve band plus evaluation noise).",
        "",
    ]
    if summary["runs"]:
        lines += [
            f"- runs: {summary['runs']}; final point within +-0.02: "
            f"{summary['final_within_0.02']}; inside its interval: "
            f"{summary['final_inside_interval']}",
            f"- |final error|: median {summary['final_abs_error_median']:.3f}, max "
            f"{summary['final_abs_error_max']:.3f}",
            f"- held-out points inside: {summary['held_out_inside']:.0%} of "
            f"{summary['held_out_points']}",
            "",
        ]
    mean = study.baseline_mean
    if mean is not None:
        lo, hi = mean.predictive
        lines += [
            f"**Baseline seed-mean curve**: fitted on {mean.fit.n_points} points, final error "
            f"{mean.final_error:+.4f} (predicted {mean.y_pred[-1]:.3f}, measured "
            f"{mean.y_test[-1]:.3f}, interval [{lo[-1]:.3f}, {hi[-1]:.3f}]), "
            f"{mean.coverage:.0%} of its held-out points inside.",
            "",
        ]
    else:
        lines += [f"Baseline seed-mean curve: not fitted ({study.baseline_mean_note}).", ""]
    lines += [
        "| run | seed | fitted / held out | A (partial) | final error | final inside | inside |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "final_error" not in r:
            lines.append(f"| {md_cell(r['group'])} | {r['seed']} | - | - | - | - | - |")
            continue
        lines.append(
            f"| {md_cell(r['group'])} | {r['seed']} | {r['n_fit']} / {r['n_test']} | "
            f"{_f(r['A_partial'])} | {r['final_error']:+.4f} | {_f(r['final_within'])} | "
            f"{r['coverage']:.0%} |"
        )
    return lines


def _differences_text(study: Study) -> str:
    lvl = f"{study.level:.0%}"
    if not study.paired:
        return (
            f"dA: variant's seed-mean A minus the baseline's, {lvl} t interval from the pooled "
            "seed variance. dB: both recipes' runs refitted at their common A (the mean of their "
            f"pooled A), seed-mean B difference, {lvl} t interval from their seeds. `*`: the "
            "difference exceeds two standard errors of the seed noise. "
        )
    return (
        "Paired by seed (each seed's runs share their start: the warm-up and the sampling "
        f"seed). dA: the mean over seeds of the variant's A minus the baseline's, {lvl} t "
        "interval from the spread of those differences (seeds - 1 degrees of freedom). dB: "
        "both recipes' runs refitted at their common A (the mean of their pooled A), the mean "
        f"of the per-seed B differences, {lvl} t interval likewise. `*`: the difference exceeds "
        "two standard errors of the per-seed differences. "
    )


def _unpaired_lines(study: Study) -> list[str]:
    if not study.paired:
        return []
    lines = ["Unpaired, as the seeds-pooled study computes them (for comparison):", ""]
    for e in study.effects:
        lines.append(
            f"- {md_cell(e.group)}: dA {_ci(e.dA_interval_unpaired)} (pooled seed variance), "
            f"dB {_ci(e.dB_interval_unpaired)}"
        )
    return [*lines, ""]


def _markdown_lines(study: Study) -> list[str]:
    s = study.report.settings
    noise = study.noise
    ext = _extrapolation_rows(study)
    lvl = f"{study.level:.0%}"
    names = plot_names(study)
    lines = [
        f"x = `{s['x']}`, metric = `{s['metric']}`; sigmoid fits by the `{s['method']}` method, "
        f"R0 `{s['r0']}` (first: each run's first evaluation; fit: a free parameter), points "
        f"before `{s['fit_start']}` of each run's compute left out. Baseline: "
        f"**{study.baseline}**.",
        "",
        "## Recipes (seeds pooled)",
        "",
        f"One sigmoid through each recipe's seeds; {lvl} intervals from a bootstrap over seeds "
        f"and evaluation points ({s['n_boot']} resamples each). Ranked by ScaleRL's rule: A "
        f"within {study.a_tol:g} is one tier, ranked by B refitted at the tier's mean A.",
        "",
        table_markdown(study.report.table, RECIPE_COLUMNS).rstrip(),
        "",
        *_img(names, "recipes"),
        "## Seed noise",
        "",
        "Each run fitted alone. Pooled over recipes, the seed-to-seed standard deviation is "
        f"{_f(noise['sd_A'])} in A ({noise['df_A']} degrees of freedom; runs with A on its "
        f"bound left out) and {_f(noise['sd_B'], 2)} in B ({noise['df_B']} degrees of "
        f"freedom); ScaleRL's tie band on A is +-{study.a_tol:g}.",
        "",
        *_seed_table(study),
        "",
        "## Each variant against the baseline and the paper",
        "",
        _differences_text(study) + "Classes: A `higher`/`lower` (interval "
        f"excludes 0 and |dA| > {study.a_tol:g}), `tie` (interval inside +-{study.a_tol:g}), "
        "`differs within band`, `not resolved`; B `higher`/`lower` (interval excludes 0) or "
        "`not resolved`; `identical`: every seed's curve equals the baseline's.",
        "",
        *_effects_table(study),
        "",
        *_unpaired_lines(study),
    ]
    n_a = sum(e.a_exceeds_noise for e in study.effects)
    n_b = sum(e.b_exceeds_noise for e in study.effects)
    lines += [
        f"{n_a} of {len(study.effects)} A differences and {n_b} of {len(study.effects)} B "
        "differences exceed two standard errors of the seed noise.",
        "",
    ]
    for e in study.effects:
        lines += _img(names, f"loo:{e.group}")
    lines += ["## Half-budget extrapolation", ""]
    lines += _extrapolation_md(study, extrapolation_summary(ext), ext)
    lines += ["", *_img(names, "baseline_mean")]
    lines += ["## Notes", ""]
    return lines + ([f"- {n}" for n in study.notes] or ["None."])


def _write_plots(study: Study, out: Path) -> list[Path]:
    from rl_jax.scaling._plots import plot_curves, plot_extrapolation, recipe_plot

    rep = study.report
    names = plot_names(study)
    labels = {"x_label": rep.x, "y_label": rep.metric, "formats": ("png",)}

    def stem(key):
        return out / names[key].removesuffix(".png")

    files = plot_curves(
        [recipe_plot(rep, g) for g in rep.recipes], stem("recipes"), title="recipes", **labels
    )
    for e in study.effects:
        files += plot_curves(
            [recipe_plot(rep, study.baseline), recipe_plot(rep, e.group)],
            stem(f"loo:{e.group}"),
            title=f"{e.group} vs {study.baseline}",
            **labels,
        )
    mean = study.baseline_mean
    if mean is not None:
        x, y = mean_curve([c for c in rep.curves if c.group == study.baseline])
        files += plot_extrapolation(mean, x, y, stem("baseline_mean"), **labels)
    return files


def write_files(
    out_dir: str | Path, *, data: dict, lines: list[str], title: str, preamble: str, plots=None
) -> list[Path]:
    """A study's `study.json` (data) and `report.md` (the title, the preamble where given,
    then lines) in out_dir, after `plots(out_dir)` where given (it writes the figures and
    returns their paths)."""
    head = [f"# {title}", ""] + ([preamble.strip(), ""] if preamble else [])
    markdown = "\n".join(head + lines).rstrip() + "\n"
    files = plots(Path(out_dir)) if plots is not None else []
    return [*write_texts(out_dir, {"study.json": _json_text(data), "report.md": markdown}), *files]


def write_study(
    study: Study, out_dir: str | Path, *, title: str, preamble: str = "", plots: bool = True
) -> list[Path]:
    """study.json, report.md and (plots=True) PNGs under out_dir/plots."""
    return write_files(
        out_dir,
        data=study_json(study),
        lines=_markdown_lines(study),
        title=title,
        preamble=preamble,
        plots=(lambda out: _write_plots(study, out)) if plots else None,
    )
