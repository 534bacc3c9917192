"""An iso-compute study's findings against the IsoCompute paper, its JSON, report and plots.

`findings` sets each of the paper's claims (PAPERS.md section 2) beside what the study's
splits show: `agree` / `disagree` when the interval (or the bootstrap's share of
replicates) settles it at the study's level, `not resolved` otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.scaling._iso_study import Effects, IsoStudy, NStar, SplitStudy, percentile_interval
from rl_jax.scaling._report import _jsonable, _signed
from rl_jax.scaling._study_report import write_files

EASY, HARD = "easy", "hard"


def _sign(interval: tuple[float, float], expect: int) -> str:
    """agree / disagree / not resolved for an interval and the sign the paper expects."""
    lo, hi = interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "not resolved"
    if (lo > 0 and expect > 0) or (hi < 0 and expect < 0):
        return "agree"
    if (lo > 0 and expect < 0) or (hi < 0 and expect > 0):
        return "disagree"
    return "not resolved"


def _share(p_yes: float, p_no: float, level: float) -> str:
    return "agree" if p_yes >= level else "disagree" if p_no >= level else "not resolved"


def _ci(iv) -> str:
    ok = all(math.isfinite(v) for v in iv)
    return f"[{iv[0]:+.3f}, {iv[1]:+.3f}]" if ok else "[-]"


def _n_vs_bp(s: SplitStudy, level: float) -> dict[str, Any] | None:
    if not s.effects:
        return None
    e = s.effects[-1]
    return {
        "id": "n_vs_bp",
        "claim": "at a fixed budget, n moves reward more than B_p",
        "paper": "easy set: varying n moved reward 9.2%, varying B_p 1.9%",
        "ours": f"at {e.budget:.4g}: over n {e.over_n:.3f} ({e.over_n / e.mean:.1%}), over B_p "
        f"{e.over_bp:.3f} ({e.over_bp / e.mean:.1%}); difference {e.diff:+.3f} "
        f"{_ci(e.diff_interval)}",
        "verdict": _sign(e.diff_interval, +1),
    }


def _n_star_grows(s: SplitStudy, level: float) -> dict[str, Any] | None:
    ns = s.n_star
    if ns is None:
        return None
    return {
        "id": "n_star_grows",
        "claim": "the compute-optimal n* grows with the budget",
        "paper": "n* grows, then saturates (7B: ~512 easy, ~128 hard)",
        "ours": f"n* = {ns.lo:g} at {ns.lo_budget:.4g}, {ns.hi:g} at {ns.hi_budget:.4g}; "
        f"P(grows) = {ns.p_grows:.2f}, P(shrinks) = {ns.p_shrinks:.2f}",
        "verdict": _share(ns.p_grows, ns.p_shrinks, level),
    }


def _bp_early(s: SplitStudy, level: float) -> dict[str, Any] | None:
    if len(s.effects) < 2:
        return None
    lo, hi = s.effects[0], s.effects[-1]
    iv = percentile_interval(lo.draws[:, 1] - hi.draws[:, 1], level)
    return {
        "id": "bp_early",
        "claim": "B_p matters at low budgets, little later",
        "paper": "B_p matters at low budgets and little in a moderate range",
        "ours": f"reward moved by B_p: {lo.over_bp:.3f} at {lo.budget:.4g}, {hi.over_bp:.3f} at "
        f"{hi.budget:.4g}; difference {lo.over_bp - hi.over_bp:+.3f} {_ci(iv)}",
        "verdict": _sign(iv, +1),
    }


def _fixed_batch(s: SplitStudy, level: float) -> dict[str, Any] | None:
    es = [e for e in s.effects if math.isfinite(e.fixed_batch)]
    if len(es) < 2:
        return None
    lo, hi = es[0], es[-1]
    v_lo, v_hi = _sign(lo.fixed_batch_interval, -1), _sign(hi.fixed_batch_interval, +1)
    verdict = (
        "agree"
        if v_lo == v_hi == "agree"
        else "disagree"
        if "disagree" in (v_lo, v_hi)
        else "not resolved"
    )
    return {
        "id": "fixed_batch",
        "claim": "at a fixed batch B = B_p x n, small M favours larger B_p, large M larger n",
        "paper": "small M favours larger B_p; large M favours larger n",
        "ours": f"reward(largest n) - reward(largest B_p) at one B, averaged over B: "
        f"{lo.fixed_batch:+.3f} {_ci(lo.fixed_batch_interval)} at {lo.budget:.4g}, "
        f"{hi.fixed_batch:+.3f} {_ci(hi.fixed_batch_interval)} at {hi.budget:.4g}",
        "verdict": verdict,
    }


def _interference(s: SplitStudy, level: float) -> dict[str, Any] | None:
    rows = s.interference
    if len(rows) < 2:
        return None
    lo, hi = rows[0], rows[-1]
    iv = percentile_interval(lo["draws"] - hi["draws"], level)
    return {
        "id": "interference",
        "claim": "small n polarizes problems (rich get richer); larger n is flatter",
        "paper": "small n: a few problems race to 1, many stay at 0; larger n is flatter",
        "ours": "polarization of the training pass rates at the end (between-problem share "
        "of their variance, n's binomial noise taken out): "
        + ", ".join(f"n = {r['n']:g}: {_f(r['polarization'], 2)}" for r in rows)
        + f"; n = {lo['n']:g} minus n = {hi['n']:g}: "
        f"{_signed(lo['polarization'] - hi['polarization'])} {_ci(iv)}",
        "verdict": _sign(iv, +1),
    }


def _hard_saturates_lower(study: IsoStudy) -> dict[str, Any] | None:
    e, h = study.splits.get(EASY), study.splits.get(HARD)
    if e is None or h is None or e.n_star is None or h.n_star is None:
        return None
    de, dh = e.n_star.draws_hi, h.n_star.draws_hi
    return {
        "split": f"{HARD} vs {EASY}",
        "id": "hard_lower",
        "claim": "n* at the largest budget is smaller on the hard split",
        "paper": "n* saturates at ~128 on hard, ~512 on easy",
        "ours": f"n* = {h.n_star.hi:g} (hard) vs {e.n_star.hi:g} (easy) at the largest budgets; "
        f"P(hard < easy) = {np.mean(dh < de):.2f}, P(hard > easy) = {np.mean(dh > de):.2f}",
        "verdict": _share(float(np.mean(dh < de)), float(np.mean(dh > de)), study.level),
    }


PER_SPLIT = (_n_vs_bp, _n_star_grows, _bp_early, _fixed_batch, _interference)


def findings(study: IsoStudy) -> list[dict[str, Any]]:
    """The paper's claims beside the study's numbers, per split (then across splits)."""
    out = []
    for name, s in study.splits.items():
        for f in PER_SPLIT:
            row = f(s, study.level)
            if row is not None:
                out.append({"split": name, **row})
    cross = _hard_saturates_lower(study)
    return out + ([cross] if cross else [])


def _effects_json(e: Effects) -> dict[str, Any]:
    d = {k: getattr(e, k) for k in Effects.__dataclass_fields__ if k != "draws"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _n_star_json(ns: NStar) -> dict[str, Any]:
    keys = ("lo_budget", "hi_budget", "lo", "hi", "p_grows", "p_shrinks")
    return {k: getattr(ns, k) for k in keys} | {
        "p_lo": {f"{k:g}": v for k, v in ns.p_lo.items()},
        "p_hi": {f"{k:g}": v for k, v in ns.p_hi.items()},
    }


def _split_json(s: SplitStudy) -> dict[str, Any]:
    ns = s.n_star
    return {
        "runs": s.runs,
        "frontier": s.frontier.summary(),
        "budgets": list(s.frontier.budgets),
        "heat": {f"{b:.6g}": m.tolist() for b, m in s.frontier.heat.items()},
        "effects": [_effects_json(e) for e in s.effects],
        "n_star": None if ns is None else _n_star_json(ns),
        "interference": [{k: v for k, v in r.items() if k != "draws"} for r in s.interference],
        "notes": list(s.notes),
    }


def iso_study_json(study: IsoStudy) -> dict[str, Any]:
    """Everything the report prints, as strict JSON (None where a number is undefined)."""
    return _jsonable(
        {
            "x": study.x,
            "metric": study.metric,
            "level": study.level,
            "n_boot": study.n_boot,
            "splits": {k: _split_json(s) for k, s in study.splits.items()},
            "findings": findings(study),
        }
    )


def _f(v, d=3) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.{d}f}"


def _heat_md(s: SplitStudy) -> list[str]:
    fr = s.frontier
    out = []
    for b in fr.budgets:
        m = fr.heat[b]
        out += [
            f"At {b:.4g} (rows n, columns B_p):",
            "",
            "| n \\ B_p | " + " | ".join(f"{v:g}" for v in fr.bp_values) + " |",
            "|---" * (len(fr.bp_values) + 1) + "|",
        ]
        for i, n in enumerate(fr.n_values):
            out.append(f"| {n:g} | " + " | ".join(_f(v) for v in m[i]) + " |")
        out.append("")
    return out


def _effects_md(s: SplitStudy, lvl: str) -> list[str]:
    out = [
        f"| budget | cells | residual sd (dof) | over n | over B_p | difference ({lvl}) | "
        f"fixed-B: largest n - largest B_p ({lvl}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in s.effects:
        sizes = ", ".join(f"{b:g}" for b in e.fixed_batch_sizes)
        out.append(
            f"| {e.budget:.4g} | {e.cells} | {_f(e.resid_sd)} ({e.dof}) | {_f(e.over_n)} "
            f"{_ci(e.over_n_interval)} | {_f(e.over_bp)} {_ci(e.over_bp_interval)} | "
            f"{_signed(e.diff)} {_ci(e.diff_interval)} | {_signed(e.fixed_batch)} "
            f"{_ci(e.fixed_batch_interval)} over B = {sizes} |"
        )
    return out


def _frontier_md(s: SplitStudy) -> list[str]:
    fr = s.frontier
    out = ["| n | A | B | C_mid | R0 | reliable |", "|---|---|---|---|---|---|"]
    for n in fr.n_values:
        f = fr.fits.get(n)
        out.append(
            f"| {n:g} | - | - | - | - | {fr.fit_errors.get(n)} |"
            if f is None
            else f"| {n:g} | {_f(f.A)} | {_f(f.B, 2)} | {f.C_mid:.4g} | {_f(f.R0)} | {f.reliable} |"
        )
    nf = fr.n_star_fit
    out.append("")
    out.append(
        f"n*(C): no fit ({fr.n_star_note})."
        if nf is None
        else f"n*(C): log2 n* = {nf.R0:.2f} + ({nf.A:.2f} - {nf.R0:.2f}) / (1 + ({nf.C_mid:.4g}"
        f" / C)^{nf.B:.2f}): n* from {2**nf.R0:.3g} to {2**nf.A:.3g} ({fr.n_star_note})."
    )
    ns = s.n_star
    if ns is not None:
        out += [
            "",
            f"n* on the frontier: {ns.lo:g} at {ns.lo_budget:.4g}, {ns.hi:g} at "
            f"{ns.hi_budget:.4g}. Bootstrap share of each n as n*: "
            + "; ".join(
                f"{b:.4g}: " + ", ".join(f"{k:g}: {v:.2f}" for k, v in p.items())
                for b, p in ((ns.lo_budget, ns.p_lo), (ns.hi_budget, ns.p_hi))
            )
            + ".",
        ]
    return out


def _interference_md(s: SplitStudy) -> list[str]:
    if not s.interference:
        return ["No run logged `train/pass_rate_hist`."]
    out = [
        "At each run's last evaluation, its runs pooled; polarization over training: at the"
        " first and last compute all of n's runs were evaluated at.",
        "",
        "| n | runs | problems seen (runs pooled) | mean pass rate | polarization | "
        "over training | share < 0.1 | share >= 0.9 | histogram (10 bins) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s.interference:
        tr = r["over_training"]
        course = f"{_f(tr[0][1])} -> {_f(tr[-1][1])}" if tr else "-"
        out.append(
            f"| {r['n']:g} | {r['runs']} | {r['problems']} | {r['mean_pass']:.3f} | "
            f"{_f(r['polarization'])} {_ci(r['polarization_interval'])} | {course} | "
            f"{r['near_zero']:.2f} | {r['near_one']:.2f} | "
            f"{' '.join(f'{v:.2f}' for v in r['share'])} |"
        )
    return out


def _split_md(name: str, s: SplitStudy, lvl: str) -> list[str]:
    from rl_jax.scaling._plots import safe_name

    stem = safe_name(name)  # a split is a value of the rows: no path of its own
    lines = ["", f"## Split `{name}` ({s.runs} runs)", "", "### Frontier", "", *_frontier_md(s)]
    lines += ["", f"![frontier](plots/{stem}_frontier.png)", f"![n*](plots/{stem}_n_star.png)"]
    lines += [
        "",
        "### Reward per cell at each budget",
        "",
        "Each run's best-so-far evaluation at that compute (linear in log compute between"
        " evaluations).",
        "",
        *_heat_md(s),
        f"![heat maps](plots/{stem}_heat.png)",
        "",
        "### n against B_p (additive model)",
        "",
        *_effects_md(s, lvl),
        "",
        "### Interference",
        "",
        *_interference_md(s),
        "",
        f"![interference](plots/{stem}_interference.png)",
        f"![polarization over training](plots/{stem}_polarization.png)",
        "",
    ]
    return lines + [f"- {n}" for n in (*s.notes, *s.frontier.warnings)]


def _markdown_lines(study: IsoStudy) -> list[str]:
    lvl = f"{study.level:.0%}"
    lines = [
        f"x = `{study.x}`, metric = `{study.metric}`; {lvl} intervals from {study.n_boot} "
        "bootstrap replicates. How each number is computed: `rl_jax/scaling/_iso_study.py`.",
        "",
        "## The paper's findings and ours",
        "",
        "| split | claim | paper | ours | verdict |",
        "|---|---|---|---|---|",
    ]
    for f in findings(study):
        lines.append(
            f"| {f['split']} | {f['claim']} | {f['paper']} | {f['ours']} | {f['verdict']} |"
        )
    for name, s in study.splits.items():
        lines += _split_md(name, s, lvl)
    return lines


def _plot_interference(s: SplitStudy, stem: Path) -> list[Path]:
    from rl_jax.scaling._plots import _axes, _save

    ax = _axes()
    width = 0.8 / max(len(s.interference), 1)
    for k, r in enumerate(s.interference):
        ax.bar(np.arange(10) + k * width, r["share"], width, label=f"n = {r['n']:g}")
    ax.set_xticks(np.arange(10) + 0.4, [f"{i / 10:.1f}" for i in range(10)], fontsize=7)
    ax.set_xlabel("latest training pass rate of a problem (bin start)")
    ax.set_ylabel("share of problems seen")
    ax.set_title(f"interference: split {s.split}, each run's last evaluation")
    ax.legend(fontsize=7)
    return _save(ax.figure, stem, ("png",))


def _plot_polarization(s: SplitStudy, stem: Path, x: str) -> list[Path]:
    from rl_jax.scaling._plots import _axes, _finish

    ax = _axes()
    for r in s.interference:
        if r["over_training"]:
            c, v = np.array(r["over_training"]).T
            ax.plot(c, v, "o-", ms=3, label=f"n = {r['n']:g}")
    y_label = "polarization (between-problem share of variance)"
    title = f"interference over training: split {s.split}"
    return _finish(ax, stem, ("png",), x, y_label, title, fontsize=7)


def _write_plots(study: IsoStudy, out: Path) -> list[Path]:
    from rl_jax.scaling._plots import plot_frontier, plot_heatmaps, plot_n_star, safe_name

    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    for split, s in study.splits.items():
        name = safe_name(split)  # a value of the rows, e.g. '../x': never a path
        fr = s.frontier
        labels = {"x_label": study.x, "y_label": study.metric, "formats": ("png",)}
        files += plot_frontier(fr, out / f"{name}_frontier", **labels)
        files += plot_n_star(fr, out / f"{name}_n_star", x_label=study.x, formats=("png",))
        if fr.budgets:
            files += plot_heatmaps(fr, out / f"{name}_heat", y_label=study.metric, formats=("png",))
        if s.interference:
            files += _plot_interference(s, out / f"{name}_interference")
            files += _plot_polarization(s, out / f"{name}_polarization", study.x)
    return files


def write_iso_study(
    study: IsoStudy, out_dir: str | Path, *, title: str, preamble: str = "", plots: bool = True
) -> list[Path]:
    """study.json, report.md and (plots=True) PNGs under out_dir/plots."""
    return write_files(
        out_dir,
        data=iso_study_json(study),
        lines=_markdown_lines(study),
        title=title,
        preamble=preamble,
        plots=(lambda out: _write_plots(study, out / "plots")) if plots else None,
    )
