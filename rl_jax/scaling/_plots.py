"""Plots, PNG and SVG: fitted curves with interval bands, extrapolation, frontier, n*(C).

Figures are built with matplotlib's object API on the Agg canvas (no pyplot, no
global backend switch), so they render on a headless machine and never touch an
analyst's interactive session.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rl_jax.scaling._bootstrap import Bootstrap
from rl_jax.scaling._extrapolate import Extrapolation
from rl_jax.scaling._isocompute import Frontier
from rl_jax.scaling._sigmoid import SigmoidFit

FORMATS = ("png", "svg")


@dataclass(frozen=True, kw_only=True, eq=False)
class CurvePlot:
    """One curve (or recipe) to draw: its points, and optionally its fit and bootstrap."""

    label: str
    x: np.ndarray
    y: np.ndarray
    fit: SigmoidFit | None = None
    boot: Bootstrap | None = None


def recipe_plot(report, recipe: str) -> CurvePlot:
    """A FitReport's recipe as one curve to draw: its runs' points pooled, its fit and
    bootstrap."""
    by_run = {c.run_id: c for c in report.curves}
    e = report.recipes[recipe]
    xs = np.concatenate([by_run[r].x for r in e.run_ids])
    ys = np.concatenate([by_run[r].y for r in e.run_ids])
    return CurvePlot(label=recipe, x=xs, y=ys, fit=e.fit, boot=e.boot)


def safe_name(name: str) -> str:
    """A file-name-safe version of a run id or recipe name; at most 80 characters (a longer
    one keeps its start and ends in a hash of the whole name)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"
    return safe if len(safe) <= 80 else f"{safe[:69]}-{_digest(name)}"


def safe_names(names) -> dict[str, str]:
    """{name: safe_name(name)}, but a name whose safe name an earlier one took ('a b' after
    'a|b') gets a hash of itself appended: two names never share a file."""
    out: dict[str, str] = {}
    for n in names:
        s = safe_name(n)
        out[n] = f"{s}-{_digest(n)}" if s in out.values() else s
    return out


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def _figure(w=7.0, h=4.5):
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _axes():
    """The one axes of a new default-size figure."""
    return _figure().add_subplot()


def _finish(ax, stem, formats, x_label, y_label, title=None, **legend) -> list[Path]:
    """A log-compute axis with its labels, title (when given), grid and legend (by default
    small, lower right), saved as `formats`."""
    ax.set_xscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(**(legend or {"fontsize": 7, "loc": "lower right"}))
    return _save(ax.figure, stem, formats)


def _save(fig: Figure, stem: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        p = stem.with_name(f"{stem.name}.{fmt}")
        fig.savefig(p, format=fmt, dpi=120)
        out.append(p)
    return out


def _log_grid(xs: Sequence[np.ndarray], extend: float = 1.0) -> np.ndarray:
    pos = np.concatenate([x[x > 0] for x in xs])
    return np.geomspace(pos.min(), pos.max() * extend, 200)


def plot_curves(
    curves: Sequence[CurvePlot],
    stem: str | Path,
    *,
    x_label: str = "compute",
    y_label: str = "metric",
    title: str | None = None,
    formats: Sequence[str] = FORMATS,
) -> list[Path]:
    """Points, fitted sigmoid and its bootstrap band for each curve, on a log-compute axis.

    Evaluations at compute 0 cannot sit on a log axis; R0 is drawn as a dotted line instead.
    """
    if not curves:
        raise ValueError("nothing to plot")
    ax = _axes()
    grid = _log_grid([c.x for c in curves])
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        pos = c.x > 0
        ax.plot(c.x[pos], c.y[pos], "o", ms=3, color=color, alpha=0.6)
        if c.fit is not None:
            style = "-" if c.fit.reliable else "--"
            label = f"{c.label}: A={c.fit.A:.3f} B={c.fit.B:.2f} C_mid={c.fit.C_mid:.3g}"
            if not c.fit.reliable:
                label += " (unreliable)"
            ax.plot(grid, c.fit.predict(grid), style, color=color, label=label)
            ax.axhline(c.fit.R0, color=color, ls=":", lw=0.8)
            if c.boot is not None:
                lo, hi = c.boot.band(grid)
                ax.fill_between(grid, lo, hi, color=color, alpha=0.15, lw=0)
        else:
            ax.plot([], [], "o", color=color, label=f"{c.label} (no fit)")
    return _finish(ax, stem, formats, x_label, y_label, title)


def plot_curve(
    x,
    y,
    stem: str | Path,
    *,
    fit: SigmoidFit | None = None,
    boot: Bootstrap | None = None,
    label: str = "run",
    x_label: str = "compute",
    y_label: str = "metric",
    title: str | None = None,
) -> list[Path]:
    """One curve with its fit and band: plot_curves for a single run. Returns [png, svg]."""
    item = CurvePlot(
        label=label, x=np.asarray(x, float), y=np.asarray(y, float), fit=fit, boot=boot
    )
    return plot_curves([item], stem, x_label=x_label, y_label=y_label, title=title)


def plot_extrapolation(
    ext: Extrapolation,
    x,
    y,
    stem: str | Path,
    *,
    x_label: str = "compute",
    y_label: str = "metric",
    title: str | None = None,
    formats: Sequence[str] = FORMATS,
) -> list[Path]:
    """Fitted window, held-out points, prediction with its band and predictive interval."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ax = _axes()
    grid = _log_grid([x])
    lo, hi = ext.boot.band(grid)
    plo, phi = ext.boot.band(grid, predictive=True)
    level = f"{ext.boot.level:.0%}"
    ax.fill_between(grid, plo, phi, color="C0", alpha=0.1, lw=0, label=f"{level} predictive")
    ax.fill_between(grid, lo, hi, color="C0", alpha=0.25, lw=0, label=f"{level} curve band")
    ax.plot(grid, ext.fit.predict(grid), "-", color="C0", label=f"sigmoid (A={ext.fit.A:.3f})")
    if ext.power_law is not None:
        ax.plot(
            grid,
            ext.power_law.predict(grid),
            "--",
            color="C3",
            label=f"power law (A={ext.power_law.A:.3f})",
        )
    fitted = (x > 0) & (x <= ext.cutoff)
    ax.plot(x[fitted], y[fitted], "o", ms=3, color="k", label="fitted")
    ax.plot(ext.x_test, ext.y_test, "o", ms=3, mfc="none", color="C1", label="held out")
    ax.axvline(ext.cutoff, color="gray", ls=":", lw=1)
    title = (
        title
        or f"fit on {ext.fraction:.0%} of compute: final error {ext.final_error:+.3f}, "
        f"{ext.coverage:.0%} of held-out points inside"
    )
    return _finish(ax, stem, formats, x_label, y_label, title)


def plot_frontier(
    fr: Frontier,
    stem: str | Path,
    *,
    x_label: str = "compute",
    y_label: str = "reward",
    formats: Sequence[str] = FORMATS,
) -> list[Path]:
    """Record-breaking points and the monotone sigmoid of each n; the upper envelope."""
    ax = _axes()
    for i, n in enumerate(fr.n_values):
        color = f"C{i % 10}"
        xr, yr = fr.records[n]
        pos = xr > 0
        ax.plot(xr[pos], yr[pos], "o", ms=3, color=color, alpha=0.6)
        f = fr.fits.get(n)
        if f is not None:
            lo, hi = fr.ranges[n]
            g = np.geomspace(lo, hi, 100)
            ax.plot(g, f.predict(g), "-", color=color, lw=1, label=f"n = {n:g}")
    ax.plot(fr.c_grid, fr.envelope, "-", color="k", lw=2.5, alpha=0.5, label="frontier")
    title = "compute-optimal frontier (upper envelope over n)"
    return _finish(ax, stem, formats, x_label, y_label, title)


def plot_heatmaps(
    fr: Frontier, stem: str | Path, *, y_label: str = "reward", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Reward over (n, B_p) at each budget; empty cells: no run reached that budget."""
    if not fr.budgets:
        raise ValueError("the frontier has no budget reached by two runs")
    k = len(fr.budgets)
    fig = _figure(4.2 * k, 3.8)
    axes = fig.subplots(1, k, squeeze=False)[0]
    finite = [m[np.isfinite(m)] for m in fr.heat.values()]
    vals = np.concatenate(finite) if finite else np.array([0.0, 1.0])
    vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    for ax, b in zip(axes, fr.budgets, strict=True):
        m = fr.heat[b]
        im = ax.imshow(m, origin="lower", cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(fr.bp_values)), [f"{v:g}" for v in fr.bp_values], fontsize=7)
        ax.set_yticks(range(len(fr.n_values)), [f"{v:g}" for v in fr.n_values], fontsize=7)
        ax.set_xlabel(fr.bp_key)
        ax.set_ylabel(fr.n_key)
        ax.set_title(f"budget {b:.3g}", fontsize=9)
        if np.isfinite(m).any():
            i, j = np.unravel_index(np.nanargmax(m), m.shape)
            ax.plot(j, i, marker="*", color="red", ms=12)
        for (i, j), v in np.ndenumerate(m):
            if math.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
    fig.colorbar(im, ax=list(axes), label=y_label, shrink=0.8)
    return _save(fig, stem, formats)


def plot_n_star(
    fr: Frontier, stem: str | Path, *, x_label: str = "compute", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """The compute-optimal n* along the frontier, and its sigmoid fit in log2 n*."""
    ax = _axes()
    ok = np.isfinite(fr.n_star)
    ax.step(fr.c_grid[ok], np.log2(fr.n_star[ok]), where="mid", color="k", label="n* (frontier)")
    if fr.n_star_fit is not None:
        f = fr.n_star_fit
        ax.plot(
            fr.c_grid, f.predict(fr.c_grid), "-", color="C0", label=f"sigmoid fit (B={f.B:.2f})"
        )
    title = "compute-optimal n*(C)" + ("" if fr.n_star_fit else f": {fr.n_star_note}")
    return _finish(ax, stem, formats, x_label, f"log2 {fr.n_key}*", title, fontsize=8)
