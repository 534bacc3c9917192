"""A grid's results: every curve row in one table, fits, comparisons, the frontier, report.md.

Outputs under the grid directory:
- curves.jsonl: every curve row of every run, plus grid, run_name, group, seed,
  status and one column per axis (its point label);
- report.md with plots/: run status, early stops, curves, and by report kind
  - compare: a sigmoid per group (seeds pooled) with bootstrap intervals, A and B
    against the baseline (B at a common A when the A's are within 0.02, the
    paper's rule), and an extrapolation check (fit the first part of compute,
    predict the rest);
  - isocompute: per split a heat map of the metric at the budget over (n, B_p),
    the compute-optimal frontier (upper envelope of per-n sigmoids fitted to
    record-breaking points) and n*(C) with a sigmoid fit of log2 n* in log C.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.grid import _scaling as sc
from rl_jax.grid.driver import is_done, run_dir
from rl_jax.grid.expand import RunPlan
from rl_jax.grid.spec import GridSpec
from rl_jax.grid.state import GridState
from rl_jax.runs.atomic import atomic_write_text, read_jsonl

# The paper's error bar on A: recipes whose asymptotes differ by less are compared on B.
A_TIE = 0.02


# ---- gathering --------------------------------------------------------------------------


def gather(spec: GridSpec, plans: Sequence[RunPlan], root: Path) -> list[dict[str, Any]]:
    """Every curve row of the grid, labelled, in plan order; written to curves.jsonl."""
    st = GridState.load(root, spec.name)
    out = []
    for p in plans:
        rec = st.runs.get(p.run_id)
        status = "done" if is_done(root, p) else (rec.status if rec else "new")
        extra = {
            "grid": spec.name,
            "run_name": p.name,
            "group": p.group,
            "seed": p.seed,
            "status": status,
            **dict(p.labels),
        }
        for row in read_jsonl(run_dir(root, p) / "curve.jsonl"):
            out.append({**row, **extra, "run_id": p.run_id})
    text = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in out)
    atomic_write_text(root / "curves.jsonl", text)
    return out


def _curve(rows: list[dict], x: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(compute, metric) of one run's rows, sorted by step, rows lacking either dropped."""
    rows = sorted(rows, key=lambda r: r.get("step", 0))
    pts = [
        (float(r[x]), float(r[metric]))
        for r in rows
        if _finite(r.get(x)) and _finite(r.get(metric))
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    xs, ys = map(np.asarray, zip(*pts, strict=True))
    return xs, ys


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _by_run(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r["run_id"]].append(r)
    return out


# ---- analysis ---------------------------------------------------------------------------


def record_breaking(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points whose metric beats every point at lower compute (IsoCompute's fitting set)."""
    keep, best = [], -math.inf
    for i, v in enumerate(y):
        if v > best:
            keep.append(i)
            best = v
    idx = np.asarray(keep, dtype=int)
    return x[idx], y[idx]


def _fit_or_error(runs, **options):
    if sc.missing():
        return None, sc.missing()
    try:
        return sc.fit(runs, **options), ""
    except (sc.FitError, ValueError) as e:
        return None, str(e)


def compare_groups(
    spec: GridSpec, plans: Sequence[RunPlan], rows: list[dict]
) -> list[dict[str, Any]]:
    """One sigmoid per group (seeds pooled): parameters, intervals, A/B against the baseline."""
    x, metric = spec.report.x, spec.report.metric
    per_run = _by_run(rows)
    groups: dict[str, list] = defaultdict(list)
    for p in plans:
        xs, ys = _curve(per_run.get(p.run_id, []), x, metric)
        if xs.size:
            groups[p.group].append((xs, ys))
    out = []
    for g, runs in groups.items():
        res: dict[str, Any] = {
            "group": g,
            "runs": len(runs),
            "points": sum(len(r[0]) for r in runs),
        }
        f, err = _fit_or_error(runs)
        if f is None:
            res["error"] = err
            out.append(res)
            continue
        res.update(fit=f, **sc.params(f), reliable=f.reliable, warnings=list(f.warnings))
        try:
            samples, intervals = sc.param_samples(f, runs)
            res["ci"] = intervals
            res["samples"] = samples
        except (sc.FitError, ValueError) as e:
            res["warnings"].append(f"no intervals: {e}")
        res["extrapolation"] = extrapolation_check(runs, spec.report.fit_fraction)
        out.append(res)
    base = spec.report.baseline or (out[0]["group"] if out else "")
    ref = next((r for r in out if r["group"] == base and "fit" in r), None)
    for r in out:
        if ref is None or "fit" not in r:
            continue
        r["dA"] = r["A"] - ref["A"]
        r["dB"] = r["B"] - ref["B"]
        if r is not ref and abs(r["dA"]) < A_TIE:
            a = 0.5 * (r["A"] + ref["A"])
            try:
                r["B_at_common_A"] = sc.params(sc.refit_at(r["fit"], a))["B"]
                r["ref_B_at_common_A"] = sc.params(sc.refit_at(ref["fit"], a))["B"]
                r["common_A"] = a
            except (sc.FitError, ValueError) as e:
                r["warnings"].append(f"no refit at common A: {e}")
    return out


def extrapolation_check(runs, fraction: float) -> dict[str, Any]:
    """Fit on compute <= fraction * max, predict the later points: how far off is it?"""
    cut = fraction * max(float(r[0].max()) for r in runs)
    early = [(x[x <= cut], y[x <= cut]) for x, y in runs]
    late = [(x[x > cut], y[x > cut]) for x, y in runs]
    n_late = sum(len(x) for x, _ in late)
    if n_late == 0 or any(len(x) < 2 for x, _ in early):
        return {"error": "too few points on one side of the cut"}
    f, err = _fit_or_error(early)
    if f is None:
        return {"error": err}
    xl = np.concatenate([x for x, _ in late])
    yl = np.concatenate([y for _, y in late])
    pred = sc.predict(f, xl)
    last = int(np.argmax(xl))
    return {
        "cut": cut,
        "rmse": float(np.sqrt(np.mean((pred - yl) ** 2))),
        "final_pred": float(pred[last]),
        "final_obs": float(yl[last]),
        "A_early": float(f.A),
        "reliable": bool(f.reliable),
    }


def isocompute_frontier(
    spec: GridSpec, plans: Sequence[RunPlan], rows: list[dict]
) -> dict[str, dict[str, Any]]:
    """Per split: the (n, B_p) heat map at the budget, per-n fits, the frontier and n*(C)."""
    x, metric = spec.report.x, spec.report.metric
    n_key, bp_key = spec.report.frontier
    per_run = _by_run(rows)
    splits: dict[str, list[RunPlan]] = defaultdict(list)
    for p in plans:
        label = dict(p.labels).get(spec.report.split_by, "all") if spec.report.split_by else "all"
        splits[label].append(p)
    out: dict[str, dict[str, Any]] = {}
    for split, ps in splits.items():
        cells: dict[tuple[int, int], list[float]] = defaultdict(list)
        per_n: dict[int, list] = defaultdict(list)
        for p in ps:
            xs, ys = _curve(per_run.get(p.run_id, []), x, metric)
            if not xs.size:
                continue
            knobs = {k: v for r in per_run[p.run_id][:1] for k, v in r.items()}
            n = int(knobs.get(n_key, p.config.sampling.n))
            bp = int(knobs.get(bp_key, p.config.data.prompts_per_batch))
            cells[(n, bp)].append(float(ys[-1]))
            per_n[n].append(record_breaking(xs, ys))
        res: dict[str, Any] = {
            "heat": {k: float(np.mean(v)) for k, v in cells.items()},
            "n_values": sorted(per_n),
            "bp_values": sorted({bp for _, bp in cells}),
        }
        # Per n: the record-breaking points of all its runs (any B_p), their upper envelope.
        env: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n, curves in per_n.items():
            best: dict[float, float] = {}
            for cx, cy in curves:
                for xi, yi in zip(cx.tolist(), cy.tolist(), strict=True):
                    best[xi] = max(best.get(xi, -math.inf), yi)
            xs = np.asarray(sorted(best))
            env[n] = record_breaking(xs, np.asarray([best[v] for v in xs.tolist()]))
        res["envelopes"] = env
        cgrid = np.unique(np.concatenate([e[0] for e in env.values()])) if env else np.zeros(0)
        cgrid = cgrid[cgrid > 0]
        res["c_grid"] = cgrid
        fits, curves_at = {}, {}
        for n, (xs, ys) in env.items():
            f = None
            if xs.size >= 4:
                f, err = _fit_or_error([(xs, ys)])
                if f is None and not sc.missing():
                    res.setdefault("warnings", []).append(f"n={n}: no fit ({err})")
            fits[n] = f
            if f is not None:
                curves_at[n] = sc.predict(f, cgrid)
            else:  # the envelope as a step function: best seen at compute <= C
                idx = np.searchsorted(xs, cgrid, side="right") - 1
                curves_at[n] = np.where(idx >= 0, ys[np.clip(idx, 0, None)], -np.inf)
        res["fits"] = fits
        res["curves_at"] = curves_at
        if curves_at and cgrid.size:
            ns = sorted(curves_at)
            stack = np.stack([curves_at[n] for n in ns])  # [N_n, C]
            best = np.argmax(stack, axis=0)
            res["frontier"] = stack[best, np.arange(cgrid.size)]
            res["n_star"] = np.asarray([ns[i] for i in best], dtype=float)
            res["n_star_fit"], res["n_star_error"] = _fit_n_star(cgrid, res["n_star"], ns)
        out[split] = res
    return out


def _fit_n_star(c: np.ndarray, n_star: np.ndarray, ns: list[int]):
    """log2 n* against compute, fitted with the sigmoid in log C (IsoCompute, not a power law)."""
    if sc.missing():
        return None, sc.missing()
    if len(set(n_star.tolist())) < 2:
        return None, f"n* is {int(n_star[0])} at every compute: nothing to fit"
    lo, hi = math.log2(min(ns)), math.log2(max(ns))
    f, err = _fit_or_error(
        [(c, np.log2(n_star))], r0="fit", metric_range=(lo - 1e-9, hi + 1e-9), method="lsq"
    )
    return f, err


# ---- early stopping ---------------------------------------------------------------------


def early_stopper(spec: GridSpec, plans: Sequence[RunPlan]):
    """The driver's early-stop check: stop runs whose asymptote cannot catch the leader's.

    A run is judged once it has `min_points` evaluations and `min_fraction` of its
    steps; the leader is the run (finished or not, in the same split) with the
    highest fitted A among reliable fits. The run stops when P(A_run >= A_leader),
    from bootstrap samples of both, is below `threshold`.
    """
    es = spec.early_stop
    assert es is not None
    x, metric = spec.report.x, spec.report.metric
    by_id = {p.run_id: p for p in plans}

    def split_of(p: RunPlan) -> str:
        return dict(p.labels).get(spec.report.split_by, "") if spec.report.split_by else ""

    def check(curves: dict[str, list[dict]], running: Sequence[RunPlan]) -> dict[str, dict]:
        if sc.missing():
            return {}
        fitted: dict[str, tuple[Any, np.ndarray]] = {}
        for rid, rows in curves.items():
            xs, ys = _curve(rows, x, metric)
            if xs.size < es.min_points:
                continue
            f, _ = _fit_or_error([(xs, ys)])
            if f is None or not f.reliable:
                continue
            try:
                samples, _ = sc.param_samples(f, [(xs, ys)], n_boot=100)
            except (sc.FitError, ValueError):
                continue
            fitted[rid] = (f, samples["A"])
        out = {}
        for p in running:
            if p.run_id not in fitted:
                continue
            steps_seen = max((r.get("step", 0) for r in curves[p.run_id]), default=0)
            if steps_seen < es.min_fraction * p.steps:
                continue
            rivals = [
                rid for rid in fitted if rid != p.run_id and split_of(by_id[rid]) == split_of(p)
            ]
            if not rivals:
                continue
            leader = max(rivals, key=lambda rid: fitted[rid][0].A)
            prob = sc.p_reaches(fitted[p.run_id][1], fitted[leader][1])
            if prob < es.threshold:
                out[p.run_id] = {
                    "reason": (
                        f"P(A >= leader's) = {prob:.3f} < {es.threshold}: A = "
                        f"{fitted[p.run_id][0].A:.3f} vs {fitted[leader][0].A:.3f} of "
                        f"{by_id[leader].name}"
                    ),
                    "p": prob,
                    "A": float(fitted[p.run_id][0].A),
                    "leader": by_id[leader].name,
                    "leader_A": float(fitted[leader][0].A),
                    "step": steps_seen,
                }
        return out

    return check


# ---- report -----------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def _ci(res: dict, name: str) -> str:
    ci = res.get("ci", {}).get(name)
    return f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else ""


def write_report(spec: GridSpec, plans: Sequence[RunPlan], root: Path) -> Path:
    """Gather the curves, fit, plot and write <root>/report.md; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    rows = gather(spec, plans, root)
    st = GridState.load(root, spec.name)
    plots = root / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    per_run = _by_run(rows)
    x, metric = spec.report.x, spec.report.metric
    md = [f"# Grid {spec.name}", ""]
    if spec.description:
        md += [spec.description, ""]
    b = spec.budget
    md += [
        f"Recipe `{spec.recipe}`, {len(plans)} runs"
        + (f", budget {b.amount:g} {b.unit} per run" if b else "")
        + f". Metric `{metric}` against `{x}`. All curve rows: `curves.jsonl`.",
        "",
    ]
    counts: dict[str, int] = defaultdict(int)
    md += [
        "## Runs",
        "",
        "| run | status | steps | attempts | last " + metric + " | " + x + " |",
        "|---|---|---|---|---|---|",
    ]
    for p in plans:
        rec = st.runs.get(p.run_id)
        status = "done" if is_done(root, p) else (rec.status if rec else "new")
        counts[status] += 1
        xs, ys = _curve(per_run.get(p.run_id, []), x, metric)
        last_y = _fmt(float(ys[-1])) if ys.size else "-"
        last_x = _fmt(float(xs[-1])) if xs.size else "-"
        launches = rec.launches if rec else 0
        md.append(f"| {p.name} | {status} | {p.steps} | {launches} | {last_y} | {last_x} |")
    md += ["", "Status: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
    stopped = [
        (p, st.runs[p.run_id].stopped)
        for p in plans
        if st.runs.get(p.run_id) and st.runs[p.run_id].stopped
    ]
    if spec.early_stop is not None or stopped:
        md += ["## Early stopping", ""]
        if stopped:
            md += [
                f"- {p.name}: stopped at step {s.get('step')}: {s.get('reason')}"
                for p, s in stopped
            ]
        else:
            md.append("No run was stopped early.")
        md.append("")
    _plot_curves(plans, per_run, x, metric, plots / "curves.png")
    md += ["## Curves", "", "![curves](plots/curves.png)", ""]
    if sc.missing():
        md += [f"_Fits skipped: {sc.missing()}._", ""]
    if spec.report.kind == "compare":
        md += _compare_section(spec, plans, rows, plots)
    else:
        md += _isocompute_section(spec, plans, rows, plots)
    path = root / "report.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def _compare_section(spec, plans, rows, plots: Path) -> list[str]:
    res = compare_groups(spec, plans, rows)
    base = spec.report.baseline or (res[0]["group"] if res else "")
    md = [
        "## Recipe comparison",
        "",
        f"Sigmoid R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) per group (seeds pooled), 95%"
        f" bootstrap intervals; baseline `{base}`. Where |dA| < {A_TIE}, both are refitted at"
        " their mean A and compared on B.",
        "",
        "| group | runs | R0 | A | B | C_mid | dA | dB | B vs baseline at common A | fit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        if "fit" not in r:
            md.append(f"| {r['group']} | {r['runs']} | | | | | | | | no fit: {r['error']} |")
            continue
        common = "-"
        if "B_at_common_A" in r:
            common = (
                f"{_fmt(r['B_at_common_A'])} vs {_fmt(r['ref_B_at_common_A'])}"
                f" (A = {_fmt(r['common_A'])})"
            )
        ok = "ok" if r["reliable"] else "unreliable: " + "; ".join(r["warnings"])
        md.append(
            f"| {r['group']} | {r['runs']} | {_fmt(r['R0'])} | {_fmt(r['A'])}{_ci(r, 'A')} |"
            f" {_fmt(r['B'])}{_ci(r, 'B')} | {_fmt(r['C_mid'])} | {_fmt(r.get('dA'))} |"
            f" {_fmt(r.get('dB'))} | {common} | {ok} |"
        )
    md += [
        "",
        "### Extrapolation check",
        "",
        f"Each group fitted on compute <= {spec.report.fit_fraction:g} x its maximum; the fit"
        " predicts the later points.",
        "",
        "| group | cut | A (early fit) | RMSE on later points | final predicted | final observed |",
        "|---|---|---|---|---|---|",
    ]
    for r in res:
        e = r.get("extrapolation", {})
        if "error" in e or not e:
            md.append(f"| {r['group']} | | | | | {e.get('error', 'no fit')} |")
            continue
        md.append(
            f"| {r['group']} | {_fmt(e['cut'])} | {_fmt(e['A_early'])} | {_fmt(e['rmse'])} |"
            f" {_fmt(e['final_pred'])} | {_fmt(e['final_obs'])} |"
        )
    _plot_fits(spec, plans, rows, res, plots / "fits.png")
    md += ["", "![fits](plots/fits.png)", ""]
    return md


def _isocompute_section(spec, plans, rows, plots: Path) -> list[str]:
    fr = isocompute_frontier(spec, plans, rows)
    n_key, bp_key = spec.report.frontier
    md = [
        "## Iso-compute frontier",
        "",
        f"Heat map: `{spec.report.metric}` at the end of each run (the full budget) over"
        f" `{n_key}` x `{bp_key}`. Frontier: per n, a sigmoid through the record-breaking"
        " points of its runs; the upper envelope over n is the compute-optimal frontier and"
        " its argmax n*(C), fitted as a sigmoid of log2 n* in log C.",
        "",
    ]
    for split, res in fr.items():
        tag = split.replace("/", "-")
        _plot_heat(res, n_key, bp_key, f"{split}", plots / f"heat_{tag}.png")
        _plot_frontier(res, spec.report.x, spec.report.metric, split, plots / f"frontier_{tag}.png")
        md += [
            f"### {split}",
            "",
            f"![heat map {split}](plots/heat_{tag}.png)",
            f"![frontier {split}](plots/frontier_{tag}.png)",
            "",
        ]
        if res.get("heat"):
            (n, bp), v = max(res["heat"].items(), key=lambda kv: kv[1])
            md.append(f"Best cell at the budget: n = {n}, B_p = {bp} ({_fmt(v)}).")
        for n, f in res["fits"].items():
            if f is not None:
                md.append(
                    f"- n = {n}: A = {_fmt(f.A)}, B = {_fmt(f.B)}, C_mid = {_fmt(f.C_mid)}"
                    + ("" if f.reliable else " (unreliable)")
                )
        if "n_star" in res:
            pts = ", ".join(
                f"{_fmt(float(c))}: {int(n)}"
                for c, n in zip(res["c_grid"], res["n_star"], strict=True)
            )
            md += ["", f"n*(C) at each evaluated compute: {pts}."]
            f = res.get("n_star_fit")
            if f is not None:
                md.append(
                    f"Fitted log2 n*(C) = {_fmt(f.R0)} + ({_fmt(f.A)} - {_fmt(f.R0)}) /"
                    f" (1 + ({_fmt(f.C_mid)} / C)^{_fmt(f.B)}): n* grows from {_fmt(2**f.R0)}"
                    f" to {_fmt(2**f.A)}" + ("" if f.reliable else " (unreliable fit)") + "."
                )
            else:
                md.append(f"No fit of n*(C): {res.get('n_star_error')}.")
        for w in res.get("warnings", []):
            md.append(f"- {w}")
        md.append("")
    return md


# ---- plots ------------------------------------------------------------------------------


def _plot_curves(plans, per_run, x, metric, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({p.group for p in plans})
    colors = {g: plt.cm.tab20(i % 20) for i, g in enumerate(groups)}
    seen = set()
    for p in plans:
        xs, ys = _curve(per_run.get(p.run_id, []), x, metric)
        if not xs.size:
            continue
        pos = xs > 0  # a log axis has no C = 0 (the R0 evaluation)
        ax.plot(
            xs[pos],
            ys[pos],
            "o-",
            ms=3,
            color=colors[p.group],
            label=None if p.group in seen else p.group,
        )
        seen.add(p.group)
    ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    if seen:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_fits(spec, plans, rows, res, path: Path) -> None:
    import matplotlib.pyplot as plt

    per_run = _by_run(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(res):
        color = plt.cm.tab20(i % 20)
        xmax = 0.0
        for p in plans:
            if p.group != r["group"]:
                continue
            xs, ys = _curve(per_run.get(p.run_id, []), spec.report.x, spec.report.metric)
            if xs.size:
                pos = xs > 0
                ax.plot(xs[pos], ys[pos], "o", ms=3, color=color, alpha=0.6)
                xmax = max(xmax, float(xs.max()))
        if "fit" in r and xmax > 0:
            c = np.geomspace(xmax / 1e3, xmax * 10, 200)
            ax.plot(
                c,
                sc.predict(r["fit"], c),
                "-",
                color=color,
                label=f"{r['group']}: A={r['A']:.3f} B={r['B']:.2f}",
            )
    ax.set_xscale("log")
    ax.set_xlabel(spec.report.x)
    ax.set_ylabel(spec.report.metric)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_heat(res, n_key, bp_key, title, path: Path) -> None:
    import matplotlib.pyplot as plt

    ns, bps = res["n_values"], res["bp_values"]
    grid = np.full((len(ns), len(bps)), np.nan)
    for (n, bp), v in res["heat"].items():
        grid[ns.index(n), bps.index(bp)] = v
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * max(len(bps), 1), 1.2 + 0.7 * max(len(ns), 1)))
    im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    for i in range(len(ns)):
        for j in range(len(bps)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
    ax.set_xticks(range(len(bps)), [str(b) for b in bps])
    ax.set_yticks(range(len(ns)), [str(n) for n in ns])
    ax.set_xlabel(f"B_p ({bp_key})")
    ax.set_ylabel(f"n ({n_key})")
    ax.set_title(f"{title}: metric at the budget", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_frontier(res, x, metric, title, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    c = res.get("c_grid", np.zeros(0))
    for i, n in enumerate(sorted(res.get("envelopes", {}))):
        color = plt.cm.viridis(i / max(len(res["envelopes"]) - 1, 1))
        ex, ey = res["envelopes"][n]
        ex, ey = ex[ex > 0], ey[ex > 0]
        a1.plot(ex, ey, "o", ms=3, color=color)
        if res["fits"].get(n) is not None and c.size:
            cc = np.geomspace(c.min(), c.max(), 200)
            a1.plot(cc, sc.predict(res["fits"][n], cc), "-", color=color, label=f"n={n}")
        else:
            a1.plot(ex, ey, "-", color=color, label=f"n={n} (envelope)")
    if "frontier" in res:
        a1.plot(c, res["frontier"], "k--", lw=2, label="frontier")
        a2.plot(c, res["n_star"], "ko", label="n*(C)")
        f = res.get("n_star_fit")
        if f is not None:
            cc = np.geomspace(c.min(), c.max(), 200)
            a2.plot(cc, 2.0 ** sc.predict(f, cc), "r-", label="sigmoid fit of log2 n*")
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xlabel(x)
    a2.set_yscale("log", base=2)
    a1.set_ylabel(metric)
    a2.set_ylabel("compute-optimal n*")
    a1.set_title(f"{title}: record-breaking points and fits", fontsize=9)
    a2.set_title(f"{title}: n*(C)", fontsize=9)
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
