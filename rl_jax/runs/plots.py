"""The run's curve as a picture: `<run>/plots/curve.png`, redrawn at every evaluation."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

CURVE_PNG = "plots/curve.png"


def draw_curve(
    run, rows: list[dict[str, Any]], *, x: str = "flops", metric: str = "val/pass@1", fit=None
) -> str | None:
    """Plot `metric` against training compute `x` from curve rows (and a fitted sigmoid,
    if given) into the run's plots/curve.png; returns its path, None when no row has both."""
    pts = [(float(r[x]), float(r[metric])) for r in rows if x in r and metric in r]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = (np.array(v, float) for v in zip(*pts, strict=True))
    fig, ax = plt.subplots(figsize=(6, 4))
    pos = xs > 0
    # The evaluation before training sits at zero compute, off a log axis: a level.
    if (~pos).any():
        ax.axhline(ys[~pos][0], color="gray", ls=":", label=f"before RL ({ys[~pos][0]:.2f})")
    ax.plot(xs[pos], ys[pos], "o-", label="validation")
    if fit is not None and pos.any():
        grid = np.geomspace(xs[pos].min(), xs.max() * 4, 200)
        ax.plot(grid, fit.predict(grid), "--", label=f"sigmoid fit (A={fit.A:.2f})")
    if pos.any():
        ax.set_xscale("log")
    ax.set_xlabel(f"training compute ({x})")
    ax.set_ylabel(metric)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    run.store.write(CURVE_PNG, png.getvalue())
    plt.close(fig)
    return run.url(CURVE_PNG)
